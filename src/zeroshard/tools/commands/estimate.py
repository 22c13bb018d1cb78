"""`zeroshard estimate`: ZeRO's memory table (arXiv 1910.02054 §5, Figure 1) for a parameter count or a model."""

from __future__ import annotations

import argparse
import json
import sys

from zeroshard.tools import estimator as est
from zeroshard.tools.commands import CommandError, add_command, bounded, params_from_args, recipe_from_args

SHARDED = {0: "nothing (DDP)", 1: "optimizer states", 2: "+ gradients", 3: "+ parameters"}

DESCRIPTION = """\
Model-state memory per rank (parameters, gradients, optimizer states) for ZeRO stages 0-3, the
communication volume per step, and optionally the largest model that fits a memory budget.
Activations, temporary buffers and fragmentation are not included. Sizes are decimal (1 GB = 1e9 B)."""

EXAMPLES = [
    "zeroshard estimate --params 7.5e9 --ranks 64            # the paper's 120 / 31.4 / 16.6 / 1.9 GB",
    "zeroshard estimate --model gpt2-xl --ranks 8 --memory 32GiB",
    "zeroshard estimate --model path/to/config.json --ranks 16 --precision fp32",
    "zeroshard estimate --params 13B --ranks 8 --offload-optimizer cpu --json",
    "zeroshard estimate --params 70B --ranks 32 --offload-optimizer nvme --offload-param nvme",
    "zeroshard estimate --model gpt-7.5b --tp 2 --pp 2 --dp 16 --tokens 8192   # 3D parallelism",
    "zeroshard estimate --params 7.5B --ranks 8 --memory 24GiB --recipes   # bf16 masters, 8-bit states",
]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "estimate",
        summary="model-state memory and communication per ZeRO stage",
        description=DESCRIPTION,
        examples=EXAMPLES,
    )
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument(
        "--params", type=bounded(est.parse_count, 1), metavar="N", help="parameter count: 7.5e9, 7.5B, 350M"
    )
    size.add_argument(
        "--model",
        metavar="NAME_OR_JSON",
        help=f"built-in model ({', '.join(est.BUILTIN_MODELS)}) or a HuggingFace config.json",
    )
    parser.add_argument(
        "--ranks", type=bounded(int, 1), default=None, metavar="N", help="data-parallel ranks (default: 1)"
    )
    parser.add_argument("--dp", type=bounded(int, 1), metavar="N", help="data-parallel ranks (same as --ranks)")
    parser.add_argument(
        "--tp",
        type=bounded(int, 1),
        default=1,
        metavar="N",
        help="tensor-parallel ranks: parameters split over tp before ZeRO (default: 1)",
    )
    parser.add_argument(
        "--pp",
        type=bounded(int, 1),
        default=1,
        metavar="N",
        help="pipeline stages: layers split over pp before ZeRO (default: 1)",
    )
    parser.add_argument(
        "--tokens",
        type=bounded(int, 1),
        metavar="N",
        help="tokens per micro-batch and rank (batch x sequence), for tp/pp traffic; "
        "needs a built-in --model (hidden size, layers)",
    )
    parser.add_argument(
        "--micro-batches",
        type=bounded(int, 1),
        default=1,
        metavar="N",
        help="micro-batches per step (pipeline / accumulation), for tp/pp traffic (default: 1)",
    )
    parser.add_argument(
        "--precision",
        choices=list(est.PRECISIONS),
        default="bf16",
        help="compute dtype; bf16/fp16 keep fp32 master weights (default: bf16)",
    )
    parser.add_argument(
        "--optimizer",
        choices=list(est.OPTIMIZERS),
        default="adam",
        help="sets K, the optimizer bytes per parameter (default: adam, K=12 mixed; adamw8bit, adamw4bit, adamwfp8: "
        "torchao's block-wise states, K=6.03, 5.06, 6.03 mixed)",
    )
    parser.add_argument(
        "--master",
        choices=list(est.MASTERS),
        default="fp32",
        help="master weights' dtype; bf16 (with --precision bf16): the parameters are the masters and Adam's "
        "states bf16, K=4 (default: fp32)",
    )
    parser.add_argument(
        "--k",
        type=bounded(int, 0),
        metavar="BYTES",
        help="override K, optimizer-state bytes per parameter (incl. fp32 master copy)",
    )
    parser.add_argument(
        "--offload-optimizer",
        choices=list(est.OFFLOAD_TARGETS),
        help="ZeRO-Offload: optimizer states and their fp32 gradients off the device",
    )
    parser.add_argument(
        "--offload-param", choices=list(est.OFFLOAD_TARGETS), help="stage 3 only: the parameter shard off the device"
    )
    parser.add_argument(
        "--memory",
        type=bounded(est.parse_bytes, 1),
        metavar="SIZE",
        help="device memory per rank (32GiB, 80GB, 1.5e10): adds the largest model that fits",
    )
    parser.add_argument(
        "--cpu-memory",
        type=bounded(est.parse_bytes, 1),
        metavar="SIZE",
        help="host memory per rank bounding CPU offload in the largest-model column",
    )
    parser.add_argument(
        "--recipes",
        action="store_true",
        help="also compare Adam's model-state recipes at --precision (fp32 or bf16 masters, fp32, 8-bit or "
        "4-bit states): bytes per parameter, per rank at each stage, and with --memory the largest model",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


def _stage_row(args: argparse.Namespace, params: int, stage: int, rec: est.Recipe) -> dict:
    offload = {"offload_optimizer": args.offload_optimizer, "offload_param": args.offload_param}
    row = {"stage": stage, "sharded": SHARDED[stage]}
    reason = est.offload_error(stage, **offload)
    if reason is not None:  # e.g. offload_param below stage 3: that row is n/a, the others still count
        return {**row, "error": reason}
    state = est.mesh_state_bytes(params, args.layout, stage, rec, replicated=args.replicated, **offload)
    row.update(
        params_bytes=state.params,
        grads_bytes=state.grads,
        optimizer_bytes=state.optimizer,
        total_bytes=state.total,
        offloaded_cpu_bytes=state.offloaded_cpu,
        offloaded_nvme_bytes=state.offloaded_nvme,
        comm_elements=est.comm_elements_per_step(params, stage),
        comm_bytes=est.comm_bytes_per_step(params, stage, rec.param_bytes),
        ring_bytes_sent_per_rank=est.ring_bytes_sent_per_rank(params, args.ranks, stage, rec.param_bytes),
    )
    if args.layout.model_parallel > 1:  # ZeRO's volume is that of the rank's model-parallel part
        local = est.local_params(params, args.layout, args.replicated)
        row.update(
            local_params=local,
            comm_elements=est.comm_elements_per_step(local, stage),
            comm_bytes=est.comm_bytes_per_step(local, stage, rec.param_bytes),
            ring_bytes_sent_per_rank=est.ring_bytes_sent_per_rank(local, args.ranks, stage, rec.param_bytes),
            comm_bytes_per_dim=est.mesh_comm_bytes(
                params, args.layout, stage, rec.param_bytes, replicated=args.replicated, activations=args.activations
            ),
        )
    if args.memory is not None:
        try:
            row["largest_params"] = args.layout.model_parallel * est.largest_model(
                args.memory, args.ranks, stage, rec, **offload, cpu_bytes=args.cpu_memory
            )
        except ValueError:  # every model state is offloaded and no host budget bounds it
            row["largest_params"] = None
    return row


def _mesh(args: argparse.Namespace) -> None:
    """args.ranks, .layout, .replicated, .activations from --ranks/--dp, --tp, --pp, --tokens."""
    if args.ranks is not None and args.dp is not None and args.ranks != args.dp:
        raise CommandError(f"--ranks {args.ranks} and --dp {args.dp} both set the data-parallel ranks: give one")
    args.ranks = args.dp or args.ranks or 1
    args.layout = est.Layout(args.ranks, args.tp, args.pp)
    spec = est.BUILTIN_MODELS.get(args.model) if args.model else None
    args.replicated = spec.tp_replicated_params() if spec is not None and args.tp > 1 else 0
    args.activations = None
    if args.tokens is not None:
        if spec is None:
            raise CommandError(
                "--tokens needs a built-in --model (its hidden size and layer count): " + ", ".join(est.BUILTIN_MODELS)
            )
        args.activations = est.Activations(args.tokens, spec.n_embd, spec.n_layer, args.micro_batches)


def _recipe_rows(args: argparse.Namespace, params: int) -> list[dict]:
    """Each of Adam's recipes at --precision (`estimator.adam_recipes`), under the same mesh and offload."""
    rows = []
    for master, optimizer, rec in est.adam_recipes(args.precision):
        stages = [_stage_row(args, params, stage, rec) for stage in range(4)]
        rows.append(
            {
                "recipe": rec.name,
                "master": master,
                "optimizer": optimizer,
                "bytes_per_param": float(est.bytes_per_param(rec)),
                "total_bytes": [row.get("total_bytes") for row in stages],
                "largest_params": [row.get("largest_params") for row in stages] if args.memory is not None else None,
            }
        )
    return rows


def _result(args: argparse.Namespace) -> dict:
    params = params_from_args(args)
    _mesh(args)
    rec = recipe_from_args(args, args.k)
    if args.recipes and args.optimizer not in ("adam", "adamw", *est.LOW_BIT_ADAM):
        raise CommandError(f"--recipes compares Adam's recipes; --optimizer {args.optimizer} is not Adam")
    return {
        "params": params,
        "model": args.model,
        "ranks": args.ranks,
        "mesh": {
            "dp": args.layout.dp,
            "tp": args.layout.tp,
            "pp": args.layout.pp,
            "replicated_params": args.replicated,
        },
        "recipe": {"name": rec.name, "param_bytes": rec.param_bytes, "grad_bytes": rec.grad_bytes, "k": float(rec.k)},
        "offload_optimizer": args.offload_optimizer,
        "offload_param": args.offload_param,
        "memory_bytes": args.memory,
        "cpu_memory_bytes": args.cpu_memory,
        "stages": [_stage_row(args, params, stage, rec) for stage in range(4)],
        "recipes": _recipe_rows(args, params) if args.recipes else None,
    }


def _columns(result: dict) -> list[tuple[str, str]]:
    """(header, row key) of the table, offload and largest-model columns only when they carry something."""
    columns = [
        ("stage", "stage"),
        ("sharded", "sharded"),
        ("params", "params_bytes"),
        ("grads", "grads_bytes"),
        ("optimizer", "optimizer_bytes"),
        ("total/rank", "total_bytes"),
    ]
    if result["offload_optimizer"] == "cpu" or result["offload_param"] == "cpu":
        columns.append(("on cpu", "offloaded_cpu_bytes"))
    if result["offload_optimizer"] == "nvme" or result["offload_param"] == "nvme":
        columns.append(("on nvme", "offloaded_nvme_bytes"))
    columns.append(("comm/step", "comm_bytes"))
    if result["memory_bytes"] is not None:
        columns.append(("largest model", "largest_params"))
    return columns


def _cell(row: dict, key: str) -> str:
    if key in ("stage", "sharded"):
        return str(row[key])
    if "error" in row:
        return "-"
    if key.startswith("largest_params"):
        return "unbounded" if row[key] is None else est.format_count(row[key])
    return est.format_bytes(row[key])


def format_table(result: dict) -> str:
    rec, columns = result["recipe"], _columns(result)
    source = f" ({result['model']})" if result["model"] else ""
    mesh = result["mesh"]
    ranks = (
        f"{result['ranks']} ranks"
        if mesh["tp"] * mesh["pp"] == 1
        else f"dp {mesh['dp']} x tp {mesh['tp']} x pp {mesh['pp']} (ZeRO over dp of each rank's "
        f"{est.format_count(result['stages'][0].get('local_params', result['params']))} parameters)"
    )
    lines = [
        f"ZeRO model states per rank: {est.format_count(result['params'])} parameters{source}, "
        f"{ranks}, {rec['name']} "
        f"({rec['param_bytes']} + {rec['grad_bytes']} + K={est.format_k(rec['k'])} bytes per parameter)"
    ]
    offload = [
        f"{name} -> {result[key]}"
        for name, key in (("optimizer", "offload_optimizer"), ("params", "offload_param"))
        if result[key]
    ]
    if offload:
        lines.append("offload: " + ", ".join(offload) + "; params/grads/optimizer/total are device bytes")
    if result["memory_bytes"] is not None:
        budget = f"largest model: model states within {est.format_bytes(result['memory_bytes'])} of device memory"
        if offload and result["cpu_memory_bytes"] is not None:
            budget += f" and {est.format_bytes(result['cpu_memory_bytes'])} of host memory"
        lines.append(budget + " per rank" + (", offload tiers without a budget unbounded" if offload else ""))
    cells = [[header for header, _ in columns]]
    cells += [[_cell(row, key) for _, key in columns] for row in result["stages"]]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines.append("")
    for line in cells:  # text columns left-aligned, sizes right-aligned
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
    lines.append("")
    lines.append(
        f"comm/step: paper convention (§7: all-reduce of Ψ = 2Ψ, stage 3 = 3Ψ) in "
        f"{rec['param_bytes']}-byte elements; a ring sends (N-1)/N of it per rank."
    )
    reasons: dict[str, list[str]] = {}
    for row in result["stages"]:
        if "error" in row:
            reasons.setdefault(row["error"], []).append(str(row["stage"]))
    lines += [f"n/a at stage {', '.join(stages)}: {reason}." for reason, stages in reasons.items()]
    lines += _per_dimension(result)
    lines += _recipe_table(result)
    return "\n".join(lines)


def _recipe_table(result: dict) -> list[str]:
    if not result["recipes"]:
        return []
    largest = result["memory_bytes"] is not None
    header = ["recipe", "B/param"] + [f"stage {s}/rank" for s in range(4)] + ["largest (stage 3)"] * largest
    cells = [header]
    for row in result["recipes"]:
        line = [row["recipe"], f"{row['bytes_per_param']:.2f}".rstrip("0").rstrip(".")]
        line += ["-" if b is None else est.format_bytes(b) for b in row["total_bytes"]]
        if largest:
            top = row["largest_params"][3]
            line.append("unbounded" if top is None else est.format_count(top))
        cells.append(line)
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    lines = ["", "Adam's model-state recipes (bytes per parameter: params + grads + K; 8- and 4-bit states modelled):"]
    lines += [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))) for line in cells
    ]
    return lines


def _per_dimension(result: dict) -> list[str]:
    rows = [r for r in result["stages"] if "comm_bytes_per_dim" in r]
    if not rows:
        return []

    def cell(value):
        return "needs --model and --tokens" if value is None else est.format_bytes(value)

    lines = [
        "comm/step per rank and mesh dimension (dp: ZeRO; tp: Megatron's 4 activation all-reduces "
        "per layer; pp: activations and their gradients at stage boundaries):"
    ]
    for row in rows:
        dims = row["comm_bytes_per_dim"]
        lines.append(f"  stage {row['stage']}: " + ", ".join(f"{d} {cell(dims[d])}" for d in ("dp", "tp", "pp")))
    return lines


def run(args: argparse.Namespace) -> int:
    result = _result(args)
    sys.stdout.write((json.dumps(result, indent=2) if args.json else format_table(result)) + "\n")
    return 0
