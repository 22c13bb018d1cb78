"""`zeroshard advise`: which ZeRO stage to use, for a model, ranks, memory per rank and interconnect."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys

from zeroshard.tools import estimator as est
from zeroshard.tools.bench import steptime
from zeroshard.tools.commands import CommandError, add_command, bounded, params_from_args, recipe_from_args

log = logging.getLogger(__name__)

DESCRIPTION = """\
Recommends the fastest ZeRO configuration whose model states (paper §5) plus activations fit the memory
per rank, and says why each other one was passed over. Time per step is compute (--compute-time) plus
the communication compute does not hide: the bytes each stage's collectives send per rank on --backend
(a ring: 2Ψ for stages 0-2, 3Ψ for stage 3, paper §7, times (N-1)/N; gloo's reduce-scatter sends an
all-reduce's) at the given or measured bandwidth, overlapped with the forward (30%) or backward (60%)
share of compute where the code overlaps them (of a built-in GPT: its blocks' share of those) (and, with --offload, the host link). Without
--compute-time, or with --no-overlap, nothing overlaps and times are upper bounds. --sweep checks the
model against a recorded bandwidth sweep (scripts/bandwidth_sweep.py): predicted against measured
step time per stage and rate, and the pick against the measured fastest stage that fits --memory. When
nothing fits because of the model states, it proposes the recipe closest to the one asked (the most
bytes per parameter among those with fewer) under which something fits: bf16 master weights, torchao's
8- or 4-bit Adam states, or both (docs/lowbit.md)."""

EXAMPLES = [
    "zeroshard advise --model gpt2-xl --ranks 8 --memory 24GiB --bandwidth 25GB/s",
    "zeroshard advise --params 7.5B --ranks 64 --memory 32GB --bandwidth 100GB/s --offload",
    "zeroshard advise --model gpt-small --ranks 2 --memory 4GiB --measure-bandwidth   # local ranks, a few seconds",
    "zeroshard advise --model config.json --ranks 16 --memory 80GB --bandwidth 200GB/s --batch 8 --seq-len 2048",
    "zeroshard advise --params 1.3B --ranks 4 --memory 16GiB --bandwidth 10GB/s --json",
    "zeroshard advise --model gpt-7.5b --dp 16 --tp 2 --pp 2 --memory 24GB --bandwidth 25GB/s   # 3D parallelism",
    "zeroshard advise --model gpt-small --ranks 2 --memory 8GB --bandwidth 1gbit --backend gloo --compute-time 1.5",
    "zeroshard advise --sweep docs/bench/multinode_sweep.json --memory 400MB   # predicted vs measured",
]

_RATE = re.compile(r"^\s*(.+?)\s*(/s|ps)?\s*$", re.IGNORECASE)


def parse_rate(text: str) -> float:
    """'25GB/s', '25 GB/s', '2.5e10', '100Gbit/s' -> bytes per second."""
    match = _RATE.match(text)
    body = match.group(1) if match else ""  # blank text: parse_bytes refuses it below
    bits = re.match(r"^(.*?)(gbit|mbit|gb?ps)$", body, re.IGNORECASE)
    try:
        if bits:
            scale = {"gbit": 1e9, "mbit": 1e6}.get(bits.group(2).lower(), 1e9)
            return float(bits.group(1)) * scale / 8
        return float(est.parse_bytes(body))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"cannot read a bandwidth from {text!r}: expected e.g. 25GB/s, 12.5GiB/s, 100Gbit/s or bytes per second"
        ) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "advise",
        summary="recommend a ZeRO stage for a model, ranks, memory, network",
        description=DESCRIPTION,
        examples=EXAMPLES,
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--params",
        type=bounded(est.parse_count, 0, inclusive=False),
        metavar="N",
        help="parameter count: 7.5e9, 7.5B, 350M",
    )
    size.add_argument(
        "--model",
        metavar="NAME_OR_JSON",
        help=f"built-in model ({', '.join(est.BUILTIN_MODELS)}) or a HuggingFace config.json",
    )
    parser.add_argument(
        "--ranks", type=bounded(int, 0, inclusive=False), metavar="N", help="data-parallel ranks (required, or --dp)"
    )
    parser.add_argument(
        "--dp", type=bounded(int, 0, inclusive=False), metavar="N", help="data-parallel ranks (same as --ranks)"
    )
    parser.add_argument(
        "--tp",
        type=bounded(int, 0, inclusive=False),
        default=1,
        metavar="N",
        help="tensor-parallel ranks: parameters split over tp before ZeRO (default: 1)",
    )
    parser.add_argument(
        "--pp",
        type=bounded(int, 0, inclusive=False),
        default=1,
        metavar="N",
        help="pipeline stages: layers split over pp before ZeRO (default: 1)",
    )
    parser.add_argument(
        "--memory",
        type=bounded(est.parse_bytes, 0, inclusive=False),
        metavar="SIZE",
        help="device memory per rank: 24GiB, 80GB (required, except with --sweep)",
    )
    net = parser.add_mutually_exclusive_group()
    net.add_argument(
        "--bandwidth",
        type=parse_rate,
        metavar="RATE",
        help="interconnect bus bandwidth per rank: 25GB/s, 100Gbit/s (nccl-tests' busbw)",
    )
    net.add_argument(
        "--measure-bandwidth",
        action="store_true",
        help="measure all-reduce bus bandwidth between --measure-ranks local ranks first",
    )
    net.add_argument(
        "--sweep",
        metavar="JSON",
        help="check the time model against a recorded bandwidth sweep "
        "(docs/bench/multinode_sweep.json): its model, ranks, link rates and compute times",
    )
    parser.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default="nccl",
        help="what the collectives run on; it decides a reduce-scatter's bytes (default: nccl)",
    )
    parser.add_argument(
        "--reduce-scatter",
        choices=steptime.REDUCE_SCATTER_ALGORITHMS,
        help="the reduce-scatter algorithm, if not the one zeroshard runs on --backend",
    )
    parser.add_argument(
        "--no-overlap", action="store_true", help="assume no communication overlaps compute (an upper bound)"
    )
    parser.add_argument(
        "--overlap-efficiency",
        type=float,
        default=1.0,
        metavar="SHARE",
        help="share of the overlap windows communication really runs in (default: 1; a CPU "
        "box whose ranks use every core measured 0, docs/multinode.md)",
    )
    parser.add_argument(
        "--overlap-param-gather",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stages 1-2 gather updated parameters under the next forward (default: on, as "
        "zeroshard.overlap_param_gather)",
    )
    parser.add_argument(
        "--measure-ranks",
        type=bounded(int, 1, inclusive=False),
        default=2,
        metavar="N",
        help="local ranks for --measure-bandwidth (default: 2)",
    )
    parser.add_argument("--precision", choices=list(est.PRECISIONS), default="bf16", help="default: bf16")
    parser.add_argument("--optimizer", choices=list(est.OPTIMIZERS), default="adam", help="default: adam")
    parser.add_argument(
        "--master",
        choices=list(est.MASTERS),
        default="fp32",
        help="master weights' dtype (bf16 needs --precision bf16)",
    )
    parser.add_argument(
        "--activations",
        type=bounded(est.parse_bytes, -1, inclusive=False),
        metavar="SIZE",
        help="memory per rank besides model states (activations, buffers); "
        "estimated for built-in GPTs from --batch/--seq-len, else 0",
    )
    parser.add_argument(
        "--batch",
        type=bounded(int, 0, inclusive=False),
        metavar="B",
        help="micro batch per rank, for the activation estimate",
    )
    parser.add_argument(
        "--seq-len",
        type=bounded(int, 0, inclusive=False),
        metavar="T",
        help="sequence length, for the activation estimate",
    )
    parser.add_argument(
        "--reserve",
        type=float,
        default=0.1,
        metavar="FRACTION",
        help="share of memory kept free for fragmentation and temporaries (default: 0.1)",
    )
    parser.add_argument(
        "--compute-time",
        type=float,
        default=0.0,
        metavar="S",
        help="compute seconds per step, to show communication as a share of the step",
    )
    parser.add_argument("--offload", action="store_true", help="also consider ZeRO-Offload to CPU")
    parser.add_argument(
        "--host-bandwidth",
        type=parse_rate,
        default=12e9,
        metavar="RATE",
        help="device<->host bandwidth for offload (default: 12GB/s, PCIe 4 x16 in practice)",
    )
    parser.add_argument(
        "--cpu-memory",
        type=bounded(est.parse_bytes, 0, inclusive=False),
        metavar="SIZE",
        help="host memory per rank for offload",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


def gpt_activation_bytes(spec: est.GPTSpec, batch: int, seq_len: int, dtype_bytes: int, tp: int = 1) -> int:
    """Korthikanti et al. (arXiv 2205.05198, §4.1-4.2): per layer s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes
    in 16-bit under tensor parallelism t (34 + 5as/h at t = 1), no recomputation; scaled for fp32,
    plus the fp32 logits the loss keeps (vocabulary-parallel: 1/t). Pipeline stages do not shrink it:
    under 1F1B the first stage holds p micro-batches of L/p layers, all L layers' worth (§4.2.3)."""
    s, b, h, a, t = seq_len, batch, spec.n_embd, spec.n_head, tp
    per_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * dtype_bytes / 2
    return int(spec.n_layer * per_layer + 4 * s * b * spec.vocab / t)


def _activations(args: argparse.Namespace) -> tuple[int, str]:
    if args.activations is not None:
        return args.activations, "given"
    spec = est.BUILTIN_MODELS.get(args.model or "")
    if spec is not None and args.batch and args.seq_len:
        return gpt_activation_bytes(
            spec, args.batch, args.seq_len, est.PRECISIONS[args.precision], args.tp
        ), "estimated (Korthikanti et al. 2022, no recomputation)"
    return 0, "not counted: give --activations, or --batch and --seq-len with a built-in --model"


def _tp_replicated(args: argparse.Namespace) -> int:
    """Parameters every tp rank holds whole, for a built-in GPT under tp (`GPTSpec.tp_replicated_params`,
    as `zeroshard estimate` counts them); 0 for other models (their split is not known: every
    parameter counts 1/tp)."""
    spec = est.BUILTIN_MODELS.get(args.model) if args.model else None
    if spec is None or args.tp == 1:
        return 0
    return spec.tp_replicated_params()


def measure_bandwidth(ranks: int) -> dict:
    from tqdm import tqdm

    from zeroshard.tools.bench.launch import launch

    spec = {"bytes": 64 * 2**20, "warmup": 2, "repeats": 8}
    with tqdm(
        total=spec["warmup"] + spec["repeats"],
        desc=f"all-reduce between {ranks} local ranks",
        unit="op",
        file=sys.stderr,
        leave=False,
        disable=None,
    ) as bar:
        return launch(
            "zeroshard.tools.bench.bandwidth", spec, ranks, on_progress=lambda e: bar.update(1), timeout_s=600
        )


def _overlap(args: argparse.Namespace, params: int) -> steptime.Overlap:
    if args.no_overlap:
        return steptime.NO_OVERLAP
    spec = est.BUILTIN_MODELS.get(args.model) if args.model else None
    if spec is None or args.tp * args.pp > 1:  # the unit reduced last is known for a built-in GPT alone
        o = steptime.Overlap()
    else:
        o = steptime.gpt_overlap(spec.vocab, spec.n_layer, spec.n_embd, spec.block_size, spec.tie, params)
    return dataclasses.replace(o, efficiency=args.overlap_efficiency)


def run(args: argparse.Namespace) -> int:
    from zeroshard.tools.bench import advisor as advise

    if not 0 <= args.reserve < 1:
        raise CommandError(f"--reserve must be in [0, 1), got {args.reserve}")
    if args.sweep:
        from zeroshard.tools.commands.advise_sweep import run_sweep

        return run_sweep(args)
    if args.params is None and args.model is None:
        raise CommandError("one of --params or --model is required (or --sweep)")
    if args.memory is None:
        raise CommandError("--memory is required: device memory per rank")
    if args.bandwidth is None and not args.measure_bandwidth:
        raise CommandError("one of --bandwidth or --measure-bandwidth is required (or --sweep)")
    if not 0 <= args.overlap_efficiency <= 1:
        raise CommandError(f"--overlap-efficiency must be in [0, 1], got {args.overlap_efficiency}")
    if args.compute_time < 0:
        raise CommandError(f"--compute-time must be at least 0 seconds, got {args.compute_time}")
    if args.ranks is not None and args.dp is not None and args.ranks != args.dp:
        raise CommandError(f"--ranks {args.ranks} and --dp {args.dp} both set the data-parallel ranks: give one")
    args.ranks = args.ranks or args.dp
    if args.ranks is None:
        raise CommandError("--ranks (or --dp) is required: the data-parallel ranks ZeRO shards over")
    params = params_from_args(args)
    replicated = _tp_replicated(args)
    if replicated > params:
        raise CommandError(
            f"--tp {args.tp}: the {replicated} parameters every tp rank holds whole exceed the model's {params}"
        )
    bandwidth, source = args.bandwidth, "given"
    if args.measure_bandwidth:
        probe = measure_bandwidth(args.measure_ranks)
        bandwidth = probe["bus_bandwidth"]
        source = (
            f"measured: all-reduce of {est.format_bytes(probe['bytes'])} between {probe['ranks']} local ranks "
            f"({probe['backend']}), median {probe['median_s'] * 1e3:.1f} ms"
        )
    activations, act_source = _activations(args)
    problem = advise.Problem(
        params=params,
        ranks=args.ranks,
        memory=args.memory,
        bandwidth=bandwidth,
        recipe=recipe_from_args(args),
        activations=activations,
        reserve=args.reserve,
        compute_s=args.compute_time,
        offload=args.offload,
        host_bandwidth=args.host_bandwidth,
        cpu_memory=args.cpu_memory,
        tp=args.tp,
        pp=args.pp,
        replicated=replicated,
        backend=args.backend,
        reduce_scatter=args.reduce_scatter,
        overlap=_overlap(args, params),
        comm=steptime.Comm(overlap_param_gather=args.overlap_param_gather),
    )
    best, every = advise.choose(problem)
    lines = advise.explain(problem, best, every)
    proposal = None
    if best is None and activations < args.memory * (1 - args.reserve):  # the model states are the limit
        proposal = advise.propose_recipe(problem, args.precision, args.optimizer, args.master)
        lines += advise.explain_proposal(proposal) if proposal else []
    if args.json:
        document = {
            "params": params,
            "ranks": args.ranks,
            "memory_bytes": args.memory,
            "bandwidth": bandwidth,
            "mesh": {"dp": args.ranks, "tp": args.tp, "pp": args.pp, "replicated_params": replicated},
            "local_params": problem.local_params,
            "bandwidth_source": source,
            "activations_bytes": activations,
            "activations_source": act_source,
            "recommendation": best.name if best else None,
            "deepspeed_config": advise.ds_config(best) if best else None,
            "recipe_proposal": None
            if proposal is None
            else {
                "recipe": proposal.recipe.name,
                "bytes_per_param": float(proposal.recipe.param_bytes + proposal.recipe.grad_bytes + proposal.recipe.k),
                "changes": list(proposal.changes),
                "recommendation": proposal.best.name,
                "deepspeed_config": proposal.config,
            },
            "explanation": lines,
            "candidates": [
                {
                    "name": c.name,
                    "stage": c.stage,
                    "fits": c.fits,
                    "need_bytes": c.need,
                    "comm_bytes": c.comm_bytes,
                    "wire_bytes": c.wire_bytes,
                    "host_bytes": c.host_bytes,
                    "predicted_s": c.time_s,
                    "predicted_comm_s": c.time_s - problem.compute(c.stage),
                }
                for c in every
            ],
        }
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
        return 0 if best else 1
    ranks = (
        f"{args.ranks} ranks"
        if args.tp * args.pp == 1
        else f"dp {args.ranks} x tp {args.tp} x pp {args.pp} ({est.format_count(problem.local_params)} parameters on "
        "each rank before ZeRO)"
    )
    head = [
        f"{est.format_count(params)} parameters{f' ({args.model})' if args.model else ''}, {ranks}, "
        f"{est.format_bytes(args.memory)} per rank, {problem.recipe.name} "
        f"(K={est.format_k(problem.recipe.k)}), interconnect {est.format_bytes(bandwidth)}/s ({source})",
        f"activations and buffers: {est.format_bytes(activations)} per rank, {act_source}",
        "",
    ]
    tail = ["", "DeepSpeed / zeroshard config: " + json.dumps(advise.ds_config(best))] if best else []
    if proposal is not None:
        tail = ["", f"DeepSpeed / zeroshard config with {proposal.recipe.name}: " + json.dumps(proposal.config)]
    if best and args.compute_time:
        comm = best.time_s - args.compute_time
        tail.append(
            f"communication compute does not hide is ~{comm / best.time_s:.0%} of a predicted {best.time_s:.2f} s step"
        )
    sys.stdout.write("\n".join(head + lines + tail) + "\n")
    return 0 if best else 1
