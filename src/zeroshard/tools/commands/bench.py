"""`zeroshard bench`: ZeRO stages 0-3 (optionally offload variants and torch's own peers) side by side."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from zeroshard.tools import estimator as est
from zeroshard.tools.commands import CommandError, add_command

log = logging.getLogger(__name__)

DESCRIPTION = """\
Trains the same GPT (member k of the bench family: k layers, width 64k) on the same data and ranks with
ZeRO stages 0-3 in one invocation (each configuration timed in torchrun launches of its own with the
environment's allocator settings, half its steps in a second pass in reverse order, and its memory
measured in a third launch), and reports for each: step time (median, min, max; per step the slowest
rank), tokens/s, peak memory per rank, model-state bytes against the paper's formula, and communication
per step against 2Ψ/3Ψ. Writes a table (bench.txt), the full data
(bench.json) and a chart in the style of the ZeRO paper's Figure 1 (bench.png) to --out. Ranks are local
processes (gloo on CPU, NCCL on GPUs).

--peers: torch's DDP, ZeroRedundancyOptimizer and FSDP2, and DeepSpeed where it imports, in the same
invocation, every system handed the same torch.optim.AdamW (--adamw) and clipping (--clip); with DDP
among them, a second table gives each system's step time against DDP's, every rank's peak and how
closely its losses follow DDP's.

--sweep: live peak memory per rank against parameters for family members --sizes, one line per stage
beside the estimator's formula (sweep.txt, sweep.json, sweep.png).
--max-model: the largest GPT (width --width, L layers) that trains two optimizer steps at stages 0-3 and
stage 3 with CPU / NVMe offload, found by trying sizes under a real per-rank memory cap (--memory, as
RLIMIT_DATA: an allocation beyond it fails), next to the estimator's prediction (max_model.txt, .json)."""

EXAMPLES = [
    "zeroshard bench                                  # stages 0-3, 2 ranks, GPT k=4, results in bench_out/",
    "zeroshard bench --peers                          # + torch DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed",
    "zeroshard bench --size 8 --vocab 8192 --untied --batch 4 --clip 0 --peers ddp,fsdp2 --deepspeed-gathering"
    "  # the README's peers table, 33.7M GPT (docs/benchmarks.md)",
    "zeroshard bench --size 1 --steps 3 --warmup 1    # a quick look",
    "zeroshard bench --stages 0,3 --out /tmp/b",
    "zeroshard bench --offload --precision bf16",
    "zeroshard bench --sweep                          # memory against parameters, k = 4,8,12,16 (3.2M-201M)",
    "zeroshard bench --max-model --memory 1.5GiB      # the largest model that trains under a 1.5 GiB cap",
    "zeroshard bench --max-model --configs 0,3,3-nvme --width 256 --memory 800MiB",
    "zeroshard bench --max-model --recipes --memory 1GiB   # stage 3 with AdamW, AdamW8bit, AdamW4bit",
]

# Defaults that differ by mode: a size sweep and the largest-model trials are kept short (their models are
# 10-100x the default one), and a largest-model trial is exactly two optimizer steps.
MODE_DEFAULTS = {
    "bench": {"seq_len": 128, "batch": 8, "steps": 10, "warmup": 3},
    "sweep": {"seq_len": 64, "batch": 2, "steps": 1, "warmup": 1},
    "max-model": {"seq_len": 64, "batch": 1, "steps": 2, "warmup": 0},
}
MAX_MODEL_MEMORY = "1GiB"


def _clip(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0: no clipping), got {text!r}")
    return value


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


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected family members like 4,8,12,16, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"sizes must be whole numbers >= 1, got {text!r}")
    return sizes


def _peers(text: str) -> list[str]:
    from zeroshard.tools.bench.peers import KINDS

    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if not kinds or unknown:
        raise argparse.ArgumentTypeError(f"unknown peer {', '.join(unknown) or repr(text)}; allowed: {','.join(KINDS)}")
    return list(dict.fromkeys(kinds))


def _configs(text: str) -> list[str]:
    from zeroshard.tools.bench.maxmodel import CONFIGS

    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in CONFIGS]
    if not keys or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown configuration {', '.join(unknown) or repr(text)}; allowed: {','.join(CONFIGS)}"
        )
    return list(dict.fromkeys(keys))


def _width(text: str) -> int:
    from zeroshard.tools.bench.maxmodel import HEAD_DIM

    value = _positive(text)
    if value % HEAD_DIM:
        raise argparse.ArgumentTypeError(f"must be a multiple of {HEAD_DIM} (heads of {HEAD_DIM}), got {text!r}")
    return value


def add_model_arguments(
    parser: argparse.ArgumentParser, size: int, seq_len: int | None, batch: int | None, mode_note: str = ""
) -> None:
    """Flags shared by bench and train: the family member, sequence, batch (None: set by the mode)."""
    parser.add_argument("--ranks", type=_positive, default=2, metavar="N", help="local ranks (default: 2)")
    parser.add_argument(
        "--size",
        type=_positive,
        default=size,
        metavar="K",
        help=f"GPT family member: K layers, width 64K, K heads (default: {size}; 12 = GPT-2 small)",
    )
    parser.add_argument(
        "--seq-len",
        type=_positive,
        default=seq_len,
        metavar="T",
        help=f"tokens per sample (default: {seq_len or MODE_DEFAULTS['bench']['seq_len']}{mode_note})",
    )
    parser.add_argument(
        "--batch",
        type=_positive,
        default=batch,
        metavar="B",
        help=f"micro batch per rank (default: {batch or MODE_DEFAULTS['bench']['batch']}{mode_note})",
    )
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="compute dtype (default: fp32)")
    parser.add_argument(
        "--threads", type=_positive, metavar="N", help="torch threads per rank (default: cores / ranks)"
    )
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default: 0)")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "bench",
        summary="ZeRO stages side by side: time, memory, communication",
        description=DESCRIPTION,
        examples=EXAMPLES,
    )
    note = "; --sweep, --max-model: see MODE DEFAULTS below"
    add_model_arguments(parser, size=4, seq_len=None, batch=None, mode_note=note)
    parser.add_argument("--stages", type=_stages, default=[0, 1, 2, 3], metavar="LIST", help="default: 0,1,2,3")
    parser.add_argument("--steps", type=_positive, help=f"timed steps per configuration (default: 10{note})")
    parser.add_argument("--warmup", type=int, help=f"untimed steps first (default: 3{note})")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    parser.add_argument(
        "--clip",
        type=_clip,
        default=1.0,
        metavar="NORM",
        help="gradient clipping every system applies: zeroshard's and DeepSpeed's "
        "gradient_clipping, torch's clip_grad_norm_ for the torch peers (default: 1.0, "
        "the config default; 0: none)",
    )
    parser.add_argument(
        "--adamw",
        choices=("fused", "default"),
        default="fused",
        help="the torch.optim.AdamW every system gets: fused=True, or the kernel torch picks by default (default: fused)",
    )
    parser.add_argument(
        "--vocab",
        type=_positive,
        metavar="V",
        help="the GPT's vocabulary (default: the data's characters); a larger one grows the embedding and "
        "the head, the tokens stay the data's",
    )
    parser.add_argument("--untied", action="store_true", help="an LM head of its own, not tied to the embedding")
    parser.add_argument(
        "--offload",
        action="store_true",
        help="also run optimizer offload to CPU (stages 1-3) and parameter offload (stage 3)",
    )
    parser.add_argument(
        "--deepspeed-gathering",
        action="store_true",
        help="also run stage 3 with DeepSpeed's gathering values (stage3_prefetch_bucket_size, "
        "stage3_param_persistence_threshold, stage3_max_live_parameters, stage3_max_reuse_distance at "
        "DeepSpeed's defaults), a row beside stage 3 with zeroshard's own",
    )
    from zeroshard.tools.bench.peers import KINDS

    parser.add_argument(
        "--peers",
        nargs="?",
        const=list(KINDS),
        type=_peers,
        metavar="LIST",
        help=f"also run torch's own implementations and DeepSpeed (if installed): the bare flag all of "
        f"them, or a list among {','.join(KINDS)}",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sweep", action="store_true", help="peak memory per rank against parameters, per stage")
    mode.add_argument(
        "--max-model",
        action="store_true",
        help="the largest model that trains under a per-rank memory cap, tried, per stage and offload",
    )
    parser.add_argument(
        "--sizes",
        type=_sizes,
        metavar="LIST",
        help="--sweep: family members k (k layers, width 64k) (default: 4,8,12,16)",
    )
    parser.add_argument(
        "--memory",
        type=_bytes,
        metavar="SIZE",
        help=f"--max-model: the cap per rank, RLIMIT_DATA, process baseline included (default: {MAX_MODEL_MEMORY})",
    )
    parser.add_argument(
        "--configs",
        type=_configs,
        metavar="LIST",
        help="--max-model: among 0,1,2,3,3-cpu,3-nvme (default: all; with --recipes: 3)",
    )
    parser.add_argument(
        "--recipes",
        action="store_true",
        help="--max-model: search every configuration with each Adam recipe of --precision (fp32: AdamW, "
        "torchao's AdamW8bit and AdamW4bit; bf16: those with fp32 masters, then with bf16 masters), "
        "each row with its model-state bytes per parameter (torchao is the lowbit extra)",
    )
    parser.add_argument(
        "--width",
        type=_width,
        default=256,
        metavar="D",
        help="--max-model: width of the searched GPT; layers are the size knob (default: 256)",
    )
    parser.add_argument(
        "--max-layers",
        type=_positive,
        default=96,
        metavar="L",
        help="--max-model: the search ceiling in layers (default: 96)",
    )
    parser.add_argument(
        "--nvme-path",
        type=Path,
        metavar="DIR",
        help="--max-model: where the NVMe configuration's swap files go (default: the temp dir)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench_out"),
        metavar="DIR",
        help="where bench.txt, bench.json, bench.png go (default: bench_out)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        metavar="S",
        help="time limit of the whole run; the ranks are stopped when it runs out",
    )
    parser.epilog = (parser.epilog or "") + (
        "\n\nMODE DEFAULTS (--seq-len, --batch, --steps, --warmup):\n"
        + "\n".join(f"  {m}: {', '.join(f'{k}={v}' for k, v in d.items())}" for m, d in MODE_DEFAULTS.items())
    )
    parser.set_defaults(func=run)


def mode_of(args: argparse.Namespace) -> str:
    return "sweep" if args.sweep else "max-model" if args.max_model else "bench"


def check_mode(args: argparse.Namespace) -> None:
    """Fill the mode's defaults; a flag that belongs to another mode is an error naming it."""
    mode = mode_of(args)
    for key, value in MODE_DEFAULTS[mode].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.warmup < 0:
        raise CommandError(f"--warmup must be >= 0, got {args.warmup}")
    owners = {
        "--peers": ("bench", args.peers),
        "--offload": ("bench", args.offload),
        "--deepspeed-gathering": ("bench", args.deepspeed_gathering),
        "--vocab": ("bench", args.vocab is not None),
        "--untied": ("bench", args.untied),
        "--adamw": ("bench", args.adamw != "fused"),
        "--sizes": ("sweep", args.sizes is not None),
        "--memory": ("max-model", args.memory is not None),
        "--configs": ("max-model", args.configs is not None),
        "--recipes": ("max-model", args.recipes),
        "--nvme-path": ("max-model", args.nvme_path is not None),
    }
    for flag, (owner, given) in owners.items():
        if given and owner != mode:
            raise CommandError(
                f"{flag} applies to {'the side-by-side bench' if owner == 'bench' else '--' + owner} "
                f"only, not to {'the side-by-side bench' if mode == 'bench' else '--' + mode}"
            )
    if mode == "max-model" and args.steps < 2:
        raise CommandError(
            f"--max-model: --steps must be >= 2 (the first step creates the optimizer states), got {args.steps}"
        )
    if args.nvme_path is not None and not args.nvme_path.is_dir():
        raise CommandError(f"--nvme-path {str(args.nvme_path)!r} is not a directory")
    if args.deepspeed_gathering and 3 not in args.stages:
        raise CommandError(
            f"--deepspeed-gathering adds a stage-3 row: --stages must include 3, got {','.join(map(str, args.stages))}"
        )
    if args.vocab is not None:
        from zeroshard.tools.demo.corpus import CharTokenizer, load_corpus

        characters = CharTokenizer(load_corpus().text).vocab_size
        if args.vocab < characters:
            raise CommandError(
                f"--vocab {args.vocab} is smaller than the bench data's {characters} distinct characters; "
                f"allowed: {characters} or more"
            )


def runs_for(args: argparse.Namespace) -> list[dict]:
    runs = [{"name": f"stage {s}", "kind": "zeroshard", "stage": s} for s in args.stages]
    if args.deepspeed_gathering:
        runs.append(
            {"name": "stage 3, DeepSpeed's gathering", "kind": "zeroshard", "stage": 3, "gathering": "deepspeed"}
        )
    if args.offload:
        runs += [
            {"name": f"stage {s} +opt->cpu", "kind": "zeroshard", "stage": s, "offload_optimizer": "cpu"}
            for s in args.stages
            if s >= 1
        ]
        if 3 in args.stages:
            runs.append(
                {
                    "name": "stage 3 +opt,param->cpu",
                    "kind": "zeroshard",
                    "stage": 3,
                    "offload_optimizer": "cpu",
                    "offload_param": "cpu",
                }
            )
    peers = args.peers or []
    names = {"ddp": "torch DDP", "torch-zero": "torch ZeroRedundancyOpt", "fsdp2": "torch FSDP2"}
    runs += [{"name": names[kind], "kind": kind, "stage": None} for kind in names if kind in peers]
    if "deepspeed" in peers:
        runs += [{"name": f"DeepSpeed stage {s}", "kind": "deepspeed", "stage": s} for s in args.stages]
    return runs


def bench_spec(args: argparse.Namespace, runs: list[dict]) -> dict:
    from zeroshard.tools.bench import family

    shape = family.gpt_shape(args.size, 0, args.seq_len)
    return {
        "size": args.size,
        "shape": {**shape, "tie_weights": False} if args.untied else shape,
        "vocab": args.vocab,  # None: the data's characters
        "batch": args.batch,
        "lr": args.lr,
        "adamw": args.adamw,
        "clip": args.clip,
        "seed": args.seed,
        "precision": args.precision,
        "warmup": args.warmup,
        "steps": args.steps,
        "threads": args.threads,
        "runs": runs,
    }


def command_line(args: argparse.Namespace) -> str:
    """The command with every effective value spelled out, so a result says exactly how it was made."""
    parts = [
        "zeroshard",
        "bench",
        "--ranks",
        args.ranks,
        "--size",
        args.size,
        "--seq-len",
        args.seq_len,
        "--batch",
        args.batch,
        "--precision",
        args.precision,
        "--stages",
        ",".join(map(str, args.stages)),
        "--steps",
        args.steps,
        "--warmup",
        args.warmup,
        "--seed",
        args.seed,
        "--lr",
        args.lr,
        "--clip",
        args.clip,
        "--adamw",
        args.adamw,
    ]
    parts += (["--vocab", args.vocab] if args.vocab else []) + ["--untied"] * args.untied
    parts += ["--threads", args.threads] if args.threads else []
    parts += ["--offload"] * args.offload + ["--deepspeed-gathering"] * args.deepspeed_gathering
    parts += ["--peers", ",".join(args.peers)] if args.peers else []
    parts += ["--out", args.out]
    return shlex.join(str(p) for p in parts)


def mode_command_line(args: argparse.Namespace) -> str:
    """`--sweep` / `--max-model` with every effective value spelled out."""
    parts = [
        "zeroshard",
        "bench",
        f"--{mode_of(args)}",
        "--ranks",
        args.ranks,
        "--seq-len",
        args.seq_len,
        "--batch",
        args.batch,
        "--precision",
        args.precision,
        "--steps",
        args.steps,
        "--seed",
        args.seed,
        "--lr",
        args.lr,
    ]
    if args.sweep:
        parts += [
            "--warmup",
            args.warmup,
            "--stages",
            ",".join(map(str, args.stages)),
            "--sizes",
            ",".join(map(str, args.sizes)),
        ]
    else:
        parts += [
            "--memory",
            args.memory,
            "--configs",
            ",".join(args.configs),
            "--width",
            args.width,
            "--max-layers",
            args.max_layers,
        ]
        parts += (["--recipes"] if args.recipes else []) + (["--nvme-path", args.nvme_path] if args.nvme_path else [])
    parts += (["--threads", args.threads] if args.threads else []) + ["--out", args.out]
    return shlex.join(str(p) for p in parts)


class StepBars:
    """One tqdm bar per configuration, fed by the ranks' progress lines."""

    bar: Any  # the running configuration's tqdm bar; None between configurations

    def __init__(self, total_runs: int):
        from tqdm import tqdm

        self._tqdm, self.total_runs, self.bar, self.index = tqdm, total_runs, None, 0

    def __call__(self, event: dict) -> None:
        if event["event"] == "start":
            self.close()
            # the worker's warm-up in every launch, and the machine's warm-up launch (bench/separate.py)
            known = event["run"] != "process warm-up" and not event.get("warm_up")
            self.index += known
            prefix = f"[{self.index}/{self.total_runs}] " if known else ""
            self.bar = self._tqdm(
                total=event["total"],
                desc=f"{prefix}{event['run']}" + (" (warm-up)" if event.get("warm_up") else ""),
                unit="step",
                leave=False,
                file=sys.stderr,
                disable=None,
            )
            if self.bar.disable and known:  # not a terminal: a log line per configuration instead
                log.info("%srunning %s", prefix, event["run"])
        elif event["event"] == "step" and self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(
                loss=f"{event['loss']:.3f}", **({"ms": f"{event['step_s'] * 1e3:.0f}"} if "step_s" in event else {})
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run_bench(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """Launch the ranks, three launches per configuration (`bench/separate.py`), and summarise;
    returns (raw result, summary rows)."""
    from zeroshard.tools.bench import peers, report, separate

    runs = runs_for(args)
    launched = [run for run in runs if run["kind"] == "zeroshard" or peers.available(run["kind"])]
    timing_launches = 2 if args.steps >= 2 else 1  # the second pass, in reverse order, needs two steps
    bars = StepBars((timing_launches + 1) * len(launched))  # + the memory launch
    try:
        result = separate.run_configurations(
            runs,
            bench_spec(args, runs),
            args.ranks,
            on_progress=bars,
            timeout_s=args.timeout,
            threads_per_rank=args.threads,
            warm_up=getattr(args, "machine_warm_up", True),
        )
    finally:
        bars.close()
    return result, report.summarize(result)


def machine_info(torch_version: str) -> dict:
    import psutil

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch_version,
        "cpus": psutil.cpu_count(),
        "cpu_model": platform.processor() or _cpu_model(),
        "memory_bytes": psutil.virtual_memory().total,
        "load_average_after": list(os.getloadavg()),
    }  # other work on the machine skews step times


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def write_outputs(args: argparse.Namespace, result: dict, rows: list[dict], table: str) -> list[Path]:
    args.out.mkdir(parents=True, exist_ok=True)
    machine = machine_info(result["torch"])
    document = {
        "command": command_line(args),
        "machine": machine,
        "memory_method": result["memory_method"],
        "rows": rows,
        "raw": result,
    }
    written = [args.out / "bench.json", args.out / "bench.txt"]
    written[0].write_text(json.dumps(document, indent=2))
    load = ", ".join(f"{v:.1f}" for v in machine["load_average_after"])
    written[1].write_text(
        f"$ {command_line(args)}\n\n{table}\nmachine: {machine['cpus']} CPUs, "
        f"{est.format_bytes(machine['memory_bytes'])}, torch {machine['torch']}; load average "
        f"(1, 5, 15 min) after the run: {load}\n"
    )
    from zeroshard.tools.bench.plot import write_chart

    title = table.splitlines()[0].replace("zeroshard bench: ", "")
    try:  # plot.py imports matplotlib when it draws, so the missing extra shows up here
        written.append(write_chart(rows, title, args.out / "bench.png"))
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'zeroshard[plot]'): no chart written")
    return written


def run(args: argparse.Namespace) -> int:
    check_mode(args)
    if args.sweep:
        return run_sweep(args)
    if args.max_model:
        return run_max_model(args)
    from zeroshard.tools.bench import report

    result, rows = run_bench(args)
    table = report.format_table(result, rows)
    written = write_outputs(args, result, rows, table)
    sys.stdout.write(table + "\n\nwrote " + ", ".join(str(p) for p in written) + "\n")
    return 0


def run_sweep(args: argparse.Namespace) -> int:
    from zeroshard.tools.bench import sweep
    from zeroshard.tools.bench.launch import launch

    args.sizes = args.sizes or [4, 8, 12, 16]
    runs = sweep.runs_for(args.sizes, args.stages, args.seq_len)
    spec = {**bench_spec(args, runs), "size": max(args.sizes)}
    bars = StepBars(len(runs))
    try:
        result = launch(
            "zeroshard.tools.bench.worker",
            spec,
            args.ranks,
            on_progress=bars,
            timeout_s=args.timeout,
            threads_per_rank=args.threads,
        )
    finally:
        bars.close()
    points = sweep.summarize(result)
    command = mode_command_line(args)
    written = sweep.write_outputs(args.out, result, points, command, machine_info(result["torch"]))
    sys.stdout.write(
        sweep.format_table(result, points, command) + "\n\nwrote " + ", ".join(str(p) for p in written) + "\n"
    )
    return 0


def run_max_model(args: argparse.Namespace) -> int:
    import torch

    from zeroshard.tools.bench import maxmodel

    if torch.cuda.is_available():  # the ranks would compute on the GPUs, whose memory RLIMIT_DATA does not bound
        raise CommandError(
            "--max-model caps the process memory of CPU ranks (RLIMIT_DATA); on a GPU machine "
            "run it with CUDA_VISIBLE_DEVICES= to measure the CPU case"
        )
    args.memory = args.memory or est.parse_bytes(MAX_MODEL_MEMORY)
    args.configs = args.configs or (["3"] if args.recipes else list(maxmodel.CONFIGS))
    spec = maxmodel.trial_spec(args)
    started = time.perf_counter()
    runs = [
        (key, recipe)
        for key in args.configs
        for recipe in (maxmodel.recipes(args.precision) if args.recipes else [None])
    ]
    rows = []
    for i, (key, recipe) in enumerate(runs, 1):
        log.info("[%d/%d] %s %s", i, len(runs), maxmodel.CONFIGS[key]["name"], recipe or "")
        rows.append(
            maxmodel.search(spec, key, args.ranks, args.max_layers, args.timeout, args.threads, args.nvme_path, recipe)
        )
    document = {
        "command": mode_command_line(args),
        "machine": machine_info(torch.__version__),
        "ranks": args.ranks,
        "spec": spec,
        "rows": rows,
        "wall_s": time.perf_counter() - started,
    }
    written = maxmodel.write_outputs(args.out, document)
    sys.stdout.write(maxmodel.format_table(document) + "\n\nwrote " + ", ".join(str(p) for p in written) + "\n")
    return 0
