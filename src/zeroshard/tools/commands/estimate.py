"""`zeroshard estimate`: ZeRO's memory table (arXiv 1910.02054 §5, Figure 1) for a parameter count or a model."""
from __future__ import annotations

import argparse
import json
import sys

from zeroshard.tools import estimator as est
from zeroshard.tools.commands import add_command, bounded, params_from_args

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
]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "estimate", summary="model-state memory and communication per ZeRO stage",
                         description=DESCRIPTION, examples=EXAMPLES)
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=bounded(est.parse_count, 1), metavar="N",
                      help="parameter count: 7.5e9, 7.5B, 350M")
    size.add_argument("--model", metavar="NAME_OR_JSON",
                      help=f"built-in model ({', '.join(est.BUILTIN_MODELS)}) or a HuggingFace config.json")
    parser.add_argument("--ranks", type=bounded(int, 1), default=1, metavar="N",
                        help="data-parallel ranks (default: 1)")
    parser.add_argument("--precision", choices=list(est.PRECISIONS), default="bf16",
                        help="compute dtype; bf16/fp16 keep fp32 master weights (default: bf16)")
    parser.add_argument("--optimizer", choices=list(est.OPTIMIZER_STATES), default="adam",
                        help="sets K, the optimizer bytes per parameter (default: adam, K=12 mixed)")
    parser.add_argument("--k", type=bounded(int, 0), metavar="BYTES",
                        help="override K, optimizer-state bytes per parameter (incl. fp32 master copy)")
    parser.add_argument("--offload-optimizer", choices=list(est.OFFLOAD_TARGETS),
                        help="ZeRO-Offload: optimizer states and their fp32 gradients off the device")
    parser.add_argument("--offload-param", choices=list(est.OFFLOAD_TARGETS),
                        help="stage 3 only: the parameter shard off the device")
    parser.add_argument("--memory", type=bounded(est.parse_bytes, 1), metavar="SIZE",
                        help="device memory per rank (32GiB, 80GB, 1.5e10): adds the largest model that fits")
    parser.add_argument("--cpu-memory", type=bounded(est.parse_bytes, 1), metavar="SIZE",
                        help="host memory per rank bounding CPU offload in the largest-model column")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


def _stage_row(args: argparse.Namespace, params: int, stage: int, rec: est.Recipe) -> dict:
    offload = {"offload_optimizer": args.offload_optimizer, "offload_param": args.offload_param}
    row = {"stage": stage, "sharded": SHARDED[stage]}
    reason = est.offload_error(stage, **offload)
    if reason is not None:  # e.g. offload_param below stage 3: that row is n/a, the others still count
        return {**row, "error": reason}
    state = est.model_state_bytes(params, args.ranks, stage, rec, **offload)
    row.update(params_bytes=state.params, grads_bytes=state.grads, optimizer_bytes=state.optimizer,
               total_bytes=state.total, offloaded_cpu_bytes=state.offloaded_cpu,
               offloaded_nvme_bytes=state.offloaded_nvme,
               comm_elements=est.comm_elements_per_step(params, stage),
               comm_bytes=est.comm_bytes_per_step(params, stage, rec.param_bytes),
               ring_bytes_sent_per_rank=est.ring_bytes_sent_per_rank(params, args.ranks, stage, rec.param_bytes))
    if args.memory is not None:
        try:
            row["largest_params"] = est.largest_model(args.memory, args.ranks, stage, rec, **offload,
                                                      cpu_bytes=args.cpu_memory)
        except ValueError:  # every model state is offloaded and no host budget bounds it
            row["largest_params"] = None
    return row


def _result(args: argparse.Namespace) -> dict:
    params = params_from_args(args)
    rec = est.recipe(args.precision, args.optimizer, args.k)  # argparse has validated every input
    return {"params": params, "model": args.model, "ranks": args.ranks,
            "recipe": {"name": rec.name, "param_bytes": rec.param_bytes, "grad_bytes": rec.grad_bytes, "k": rec.k},
            "offload_optimizer": args.offload_optimizer, "offload_param": args.offload_param,
            "memory_bytes": args.memory, "cpu_memory_bytes": args.cpu_memory,
            "stages": [_stage_row(args, params, stage, rec) for stage in range(4)]}


def _columns(result: dict) -> list[tuple[str, str]]:
    """(header, row key) of the table, offload and largest-model columns only when they carry something."""
    columns = [("stage", "stage"), ("sharded", "sharded"), ("params", "params_bytes"), ("grads", "grads_bytes"),
               ("optimizer", "optimizer_bytes"), ("total/rank", "total_bytes")]
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
    if key == "largest_params":
        return "unbounded" if row[key] is None else est.format_count(row[key])
    return est.format_bytes(row[key])


def format_table(result: dict) -> str:
    rec, columns = result["recipe"], _columns(result)
    source = f" ({result['model']})" if result["model"] else ""
    lines = [f"ZeRO model states per rank: {est.format_count(result['params'])} parameters{source}, "
             f"{result['ranks']} ranks, {rec['name']} "
             f"({rec['param_bytes']} + {rec['grad_bytes']} + K={rec['k']} bytes per parameter)"]
    offload = [f"{name} -> {result[key]}" for name, key in
               (("optimizer", "offload_optimizer"), ("params", "offload_param")) if result[key]]
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
    lines.append(f"comm/step: paper convention (§7: all-reduce of Ψ = 2Ψ, stage 3 = 3Ψ) in "
                 f"{rec['param_bytes']}-byte elements; a ring sends (N-1)/N of it per rank.")
    reasons: dict[str, list[str]] = {}
    for row in result["stages"]:
        if "error" in row:
            reasons.setdefault(row["error"], []).append(str(row["stage"]))
    lines += [f"n/a at stage {', '.join(stages)}: {reason}." for reason, stages in reasons.items()]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = _result(args)
    sys.stdout.write((json.dumps(result, indent=2) if args.json else format_table(result)) + "\n")
    return 0
