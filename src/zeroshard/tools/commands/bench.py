"""`zeroshard bench`: ZeRO stages 0-3 (optionally offload variants and torch's own peers) side by side."""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import sys
from pathlib import Path

from zeroshard.tools import estimator as est
from zeroshard.tools.commands import CommandError, add_command

log = logging.getLogger(__name__)

DESCRIPTION = """\
Trains the same GPT (member k of the bench family: k layers, width 64k) on the same data and ranks with
ZeRO stages 0-3 in one invocation (one torchrun launch), and reports for each: step time (median, min,
max; per step the slowest rank), tokens/s, peak memory per rank, model-state bytes against the paper's
formula, communication per step against 2Ψ/3Ψ, and the largest family member that fits a memory budget.
Writes a table (bench.txt), the full data (bench.json) and a chart in the style of the ZeRO paper's
Figure 1 (bench.png) to --out. Ranks are local processes (gloo on CPU, NCCL on GPUs)."""

EXAMPLES = [
    "zeroshard bench                                  # stages 0-3, 2 ranks, GPT k=4, results in bench_out/",
    "zeroshard bench --peers                          # + torch DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed",
    "zeroshard bench --size 1 --steps 3 --warmup 1    # a quick look",
    "zeroshard bench --stages 0,3 --memory 8GiB --out /tmp/b",
    "zeroshard bench --offload --precision bf16",
]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def _stages(text: str) -> list[int]:
    try:
        stages = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected stages like 0,1,2,3, got {text!r}") from None
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise argparse.ArgumentTypeError(f"stages must be among 0,1,2,3, got {text!r}")
    return stages


def _bytes(text: str) -> int:
    try:
        return est.parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_model_arguments(parser: argparse.ArgumentParser, size: int, seq_len: int, batch: int) -> None:
    """Flags shared by bench and train: the family member, sequence, batch."""
    parser.add_argument("--ranks", type=_positive, default=2, metavar="N", help="local ranks (default: 2)")
    parser.add_argument("--size", type=_positive, default=size, metavar="K",
                        help=f"GPT family member: K layers, width 64K, K heads (default: {size}; 12 = GPT-2 small)")
    parser.add_argument("--seq-len", type=_positive, default=seq_len, metavar="T", help=f"tokens per sample (default: {seq_len})")
    parser.add_argument("--batch", type=_positive, default=batch, metavar="B", help=f"micro batch per rank (default: {batch})")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="compute dtype (default: fp32)")
    parser.add_argument("--threads", type=_positive, metavar="N", help="torch threads per rank (default: cores / ranks)")
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default: 0)")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(subparsers, "bench", summary="ZeRO stages side by side: time, memory, communication",
                         description=DESCRIPTION, examples=EXAMPLES)
    add_model_arguments(parser, size=4, seq_len=128, batch=8)
    parser.add_argument("--stages", type=_stages, default=[0, 1, 2, 3], metavar="LIST", help="default: 0,1,2,3")
    parser.add_argument("--steps", type=_positive, default=10, help="timed steps per configuration (default: 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    parser.add_argument("--offload", action="store_true",
                        help="also run optimizer offload to CPU (stages 1-3) and parameter offload (stage 3)")
    parser.add_argument("--peers", action="store_true",
                        help="also run torch DDP, ZeroRedundancyOptimizer, FSDP2 fully_shard, DeepSpeed if installed")
    parser.add_argument("--memory", type=_bytes, metavar="SIZE",
                        help="memory budget per rank for the largest-model search (default: RAM / ranks, or GPU memory)")
    parser.add_argument("--out", type=Path, default=Path("bench_out"), metavar="DIR",
                        help="where bench.txt, bench.json, bench.png go (default: bench_out)")
    parser.add_argument("--timeout", type=float, default=3600.0, metavar="S", help="stop the ranks after S seconds")
    parser.set_defaults(func=run)


def runs_for(args: argparse.Namespace) -> list[dict]:
    runs = [{"name": f"stage {s}", "kind": "zeroshard", "stage": s} for s in args.stages]
    if args.offload:
        runs += [{"name": f"stage {s} +opt->cpu", "kind": "zeroshard", "stage": s, "offload_optimizer": "cpu"}
                 for s in args.stages if s >= 1]
        if 3 in args.stages:
            runs.append({"name": "stage 3 +opt,param->cpu", "kind": "zeroshard", "stage": 3,
                         "offload_optimizer": "cpu", "offload_param": "cpu"})
    if args.peers:
        runs += [{"name": "torch DDP", "kind": "ddp", "stage": None},
                 {"name": "torch ZeroRedundancyOpt", "kind": "torch-zero", "stage": None},
                 {"name": "torch FSDP2", "kind": "fsdp2", "stage": None}]
        runs += [{"name": f"DeepSpeed stage {s}", "kind": "deepspeed", "stage": s} for s in args.stages]
    return runs


def bench_spec(args: argparse.Namespace, runs: list[dict]) -> dict:
    from zeroshard.tools.bench import family

    return {"size": args.size, "shape": family.gpt_shape(args.size, 0, args.seq_len), "batch": args.batch,
            "lr": args.lr, "seed": args.seed, "precision": args.precision, "warmup": args.warmup,
            "steps": args.steps, "threads": args.threads, "runs": runs}


def command_line(args: argparse.Namespace) -> str:
    """The command with every effective value spelled out, so a result says exactly how it was made."""
    parts = ["zeroshard", "bench", "--ranks", args.ranks, "--size", args.size, "--seq-len", args.seq_len,
             "--batch", args.batch, "--precision", args.precision, "--stages", ",".join(map(str, args.stages)),
             "--steps", args.steps, "--warmup", args.warmup, "--seed", args.seed, "--lr", args.lr]
    parts += ["--threads", args.threads] if args.threads else []
    parts += ["--memory", args.memory] if args.memory else []
    parts += ["--offload"] * args.offload + ["--peers"] * args.peers + ["--out", args.out]
    return shlex.join(str(p) for p in parts)


def default_budget(ranks: int) -> int:
    import psutil
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return psutil.virtual_memory().total // ranks


class StepBars:
    """One tqdm bar per configuration, fed by the ranks' progress lines."""

    def __init__(self, total_runs: int):
        from tqdm import tqdm

        self._tqdm, self.total_runs, self.bar, self.index = tqdm, total_runs, None, 0

    def __call__(self, event: dict) -> None:
        if event["event"] == "start":
            self.close()
            known = event["run"] != "process warm-up"
            self.index += known
            prefix = f"[{self.index}/{self.total_runs}] " if known else ""
            self.bar = self._tqdm(total=event["total"], desc=f"{prefix}{event['run']}", unit="step",
                                  leave=False, file=sys.stderr, disable=None)
            if self.bar.disable and known:  # not a terminal: a log line per configuration instead
                log.info("%srunning %s", prefix, event["run"])
        elif event["event"] == "step" and self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{event['loss']:.3f}", **({"ms": f"{event['step_s'] * 1e3:.0f}"}
                                                                  if "step_s" in event else {}))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run_bench(args: argparse.Namespace) -> tuple[dict, list[dict], int]:
    """Launch the ranks and summarise; returns (raw result, summary rows, budget)."""
    from zeroshard.tools.bench import report
    from zeroshard.tools.bench.launch import launch

    runs = runs_for(args)
    budget = args.memory or default_budget(args.ranks)
    bars = StepBars(len(runs))
    try:
        result = launch("zeroshard.tools.bench.worker", bench_spec(args, runs), args.ranks, on_progress=bars,
                        timeout_s=args.timeout, threads_per_rank=args.threads)
    finally:
        bars.close()
    return result, report.summarize(result, budget), budget


def write_outputs(args: argparse.Namespace, result: dict, rows: list[dict], budget: int, table: str) -> list[Path]:
    import psutil
    from zeroshard.tools.bench import report

    args.out.mkdir(parents=True, exist_ok=True)
    machine = {"platform": platform.platform(), "python": platform.python_version(), "torch": result["torch"],
               "cpus": psutil.cpu_count(), "memory_bytes": psutil.virtual_memory().total,
               "load_average_after": list(os.getloadavg())}  # other work on the machine skews step times
    document = {"command": command_line(args), "machine": machine, "budget_bytes": budget,
                "largest_method": report.LARGEST_METHOD, "memory_method": result["memory_method"],
                "rows": rows, "raw": result}
    written = [args.out / "bench.json", args.out / "bench.txt"]
    written[0].write_text(json.dumps(document, indent=2))
    load = ", ".join(f"{v:.1f}" for v in machine["load_average_after"])
    written[1].write_text(f"$ {command_line(args)}\n\n{table}\nmachine: {machine['cpus']} CPUs, "
                          f"{est.format_bytes(machine['memory_bytes'])}, torch {machine['torch']}; load average "
                          f"(1, 5, 15 min) after the run: {load}\n")
    try:
        from zeroshard.tools.bench.plot import write_chart
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'zeroshard[plot]'): no chart written")
        return written
    title = table.splitlines()[0].replace("zeroshard bench: ", "")
    written.append(write_chart(rows, title, args.out / "bench.png"))
    return written


def run(args: argparse.Namespace) -> int:
    if args.warmup < 0:
        raise CommandError(f"--warmup must be >= 0, got {args.warmup}")
    from zeroshard.tools.bench import report

    result, rows, budget = run_bench(args)
    table = report.format_table(result, rows, budget)
    written = write_outputs(args, result, rows, budget, table)
    sys.stdout.write(table + "\n\nwrote " + ", ".join(str(p) for p in written) + "\n")
    return 0
