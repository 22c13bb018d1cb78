"""`zeroshard train`: the demo job (`make demo`), a small GPT trained with ZeRO on local ranks."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from zeroshard.tools import estimator as est
from zeroshard.tools.commands import CommandError, add_command
from zeroshard.tools.commands.bench import add_model_arguments

log = logging.getLogger(__name__)

DESCRIPTION = """\
Trains a character-level GPT on text every Python installation carries (its own standard library's
source) with ZeRO on local ranks (torchrun; gloo on CPU, NCCL on GPUs), showing a live progress bar
(loss, tokens/s, memory per rank). At the end it prints the held-out loss, a sample of generated text and
the short stage table of `zeroshard bench` for the same model (stages 0-3: step time, memory,
communication against the paper's formulas). With no arguments: 2 ranks, stage 3, GPT k=3 (3 layers,
width 192, ~1.4M parameters), 300 steps: about 2.5 minutes on 2 CPU cores, training loss from ~4.4 to ~2.0."""

EXAMPLES = [
    "zeroshard train                                # the demo: 2 ranks, stage 3, then the stage table",
    "zeroshard train --stage 2 --ranks 4 --steps 500",
    "zeroshard train --size 2 --steps 50 --no-table # a quick look",
    "zeroshard train --config ds_config.json        # a DeepSpeed config merged over the defaults; --stage wins",
    "zeroshard train --json > run.json              # the result as JSON (losses, sample, memory)",
]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "train",
        summary="train a small GPT with ZeRO (the demo)",
        description=DESCRIPTION,
        examples=EXAMPLES,
    )
    add_model_arguments(parser, size=3, seq_len=128, batch=8)
    parser.add_argument(
        "--stage", type=int, choices=(0, 1, 2, 3), default=None, help="ZeRO stage (default: 3, or the config file's)"
    )
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate (default: 2e-3)")
    parser.add_argument(
        "--config",
        type=Path,
        metavar="JSON",
        help="DeepSpeed config merged over the defaults (optimizer, scheduler, zero_optimization, ...)",
    )
    parser.add_argument(
        "--sample-chars", type=int, default=300, metavar="N", help="characters to generate (default: 300)"
    )
    parser.add_argument("--no-table", action="store_true", help="skip the stage table at the end")
    parser.add_argument(
        "--table-steps",
        type=int,
        default=1,
        metavar="N",
        help="timed steps per stage in the table, after 2 untimed ones (default: 1: one launch per stage "
        "for its time, one for its memory; from 2, the bench's second timing pass in reverse order)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    parser.add_argument("--timeout", type=float, default=3600.0, metavar="S", help="stop the ranks after S seconds")
    parser.set_defaults(func=run)


def _read_config(path: Path | None) -> dict | None:
    if path is None:
        return None
    from zeroshard.config import ConfigError, read_config

    try:
        return read_config(path)
    except ConfigError as err:
        raise CommandError(f"--config: {err}") from None


def _check_config(spec: dict, ranks: int, path: Path | None) -> None:
    """Parse the config the ranks will use here, so that a bad key is named once, not by every rank."""
    from zeroshard.config import load_config
    from zeroshard.tools.demo.loop import build_config

    try:
        load_config(build_config(spec), ranks)
    except ValueError as err:
        raise CommandError(f"--config {path}: {err}" if path else str(err)) from None


def train_spec(args: argparse.Namespace) -> dict:
    from zeroshard.tools.bench import family

    if args.steps < 1:
        raise CommandError(f"--steps must be >= 1, got {args.steps}")
    if args.sample_chars < 0:
        raise CommandError(f"--sample-chars must be >= 0, got {args.sample_chars}")
    spec = {
        "size": args.size,
        "shape": family.gpt_shape(args.size, 0, args.seq_len),
        "batch": args.batch,
        "steps": args.steps,
        "lr": args.lr,
        "seed": args.seed,
        "precision": args.precision,
        "stage": args.stage if args.stage is not None else (None if args.config else 3),
        "config": _read_config(args.config),
        "sample_chars": args.sample_chars,
        "threads": args.threads,
    }
    _check_config(spec, args.ranks, args.config)
    return spec


class TrainBar:
    """The live progress bar: loss, tokens/s, memory of every rank. Where stderr is not a terminal
    (CI logs, pipes) tqdm stays silent and a log line every tenth of the run takes its place."""

    def __init__(self):
        from tqdm import tqdm

        self._tqdm, self.bar, self.every = tqdm, None, 1

    def __call__(self, event: dict) -> None:
        if event["event"] == "start":
            desc = f"stage {event['stage']}, {est.format_count(event['params'])} params"
            self.bar = self._tqdm(
                total=event["total"], unit="step", file=sys.stderr, dynamic_ncols=True, desc=desc, disable=None
            )
            self.every = max(1, event["total"] // 10)
        elif event["event"] == "step" and self.bar is not None:
            self._step(event)
        elif event["event"] == "sampling":
            self.close()
            log.info("generating a sample...")

    def _step(self, event: dict) -> None:
        memory = " ".join(f"{m / 1e6:.0f}" for m in event["memory"])
        status = f"loss {event['loss']:.3f}, {event['tokens_per_s']:,.0f} tok/s, MB/rank {memory}"
        self.bar.update(1)
        if not self.bar.disable:
            self.bar.set_postfix_str(status)
        elif event["step"] % self.every == 0 or event["step"] == self.bar.total:
            log.info("step %d/%d: %s", event["step"], self.bar.total, status)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def format_result(result: dict) -> str:
    losses, states = result["losses"], result["memory_report"]
    first, last = sum(losses[:10]) / len(losses[:10]), sum(losses[-10:]) / len(losses[-10:])
    lines = [
        f"trained GPT k={result['spec']['size']} ({est.format_count(result['params'])} parameters, vocab "
        f"{result['vocab']} characters) with ZeRO stage {result['stage']} on {result['world_size']} ranks: "
        f"{len(losses)} steps in {result['train_seconds']:.0f} s, {result['tokens_per_s']:,.0f} tokens/s",
        f"loss {first:.3f} -> {last:.3f} (mean of the first / last 10 steps); held-out loss "
        f"{result['validation_loss']:.3f}",
        f"model states on rank 0: {est.format_bytes(states['total'])} (params {est.format_bytes(states['params'])},"
        f" grads {est.format_bytes(states['grads'])}, optimizer {est.format_bytes(states['optimizer'] + states['master'])})",
        f"corpus: {len(result['corpus'])} standard-library files, e.g. {result['corpus'][0]}",
        "",
        "sample:",
        "-" * 60,
        result["sample"],
        "-" * 60,
    ]
    return "\n".join(lines)


def stage_table(args: argparse.Namespace) -> str:
    from zeroshard.tools.commands.bench import run_bench

    bench_args = argparse.Namespace(
        **{
            **vars(args),
            "stages": [0, 1, 2, 3],
            "steps": args.table_steps,
            "warmup": 2,
            "offload": False,
            "peers": None,
            "deepspeed_gathering": False,
            "vocab": None,
            "untied": False,
            "adamw": "fused",
            "lr": 1e-3,
            "clip": 1.0,
            # The training run just kept the machine busy: the bench's warm-up launch would add nothing.
            "machine_warm_up": False,
        }
    )  # the bench's default, as the training loop clips
    result, rows = run_bench(bench_args)
    cells = stage_cells(rows)
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    text = [
        f"stage table (`zeroshard bench --size {args.size} --seq-len {args.seq_len} --batch {args.batch} "
        f"--ranks {args.ranks} --steps {args.table_steps} --warmup 2`):"
    ]
    text += [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))) for line in cells
    ]
    baseline = max(row["baseline_memory"] for row in rows if "baseline_memory" in row)
    text += [
        "model states: the parameters, gradients and optimizer state one rank holds, counted from its tensors,",
        "  against the paper's formula (§5).",
        "above baseline: the rank's peak during the steps less its memory before the model was built (the torch",
        f"  process itself, {est.format_bytes(baseline)} here); {result['memory_method']}. It holds the",
        "  activations too, which ZeRO does not partition: on a model this small they are most of it.",
        "comm: bytes per step in the paper's convention, against 2Ψ (stages 0-2) and 3Ψ (stage 3).",
    ]
    return "\n".join(text)


def stage_cells(rows: list[dict]) -> list[list[str]]:
    """The demo's table: memory per rank above the process, which falls by stage, before time."""

    def vs(measured: int, predicted: int | None) -> str:
        return est.format_bytes(measured) + (f" / {est.format_bytes(predicted)}" if predicted is not None else "")

    lines = [["config", "model states/rank meas/pred", "peak above baseline", "comm/step meas/pred", "step ms"]]
    for row in rows:
        if "skipped" in row:
            continue
        lines.append(
            [
                row["name"],
                vs(row["states_measured"]["total"], row.get("states_predicted", {}).get("total")),
                est.format_bytes(row["peak_above_baseline"]),
                vs(row["comm_measured"], row.get("comm_predicted")),
                f"{row['step_time']['median_s'] * 1e3:.0f}",
            ]
        )
    return lines


def run(args: argparse.Namespace) -> int:
    from zeroshard.tools.bench.launch import launch

    spec = train_spec(args)
    bar, started = TrainBar(), time.monotonic()
    try:
        result = launch(
            "zeroshard.tools.demo.loop",
            spec,
            args.ranks,
            on_progress=bar,
            timeout_s=args.timeout,
            threads_per_rank=args.threads,
        )
    finally:
        bar.close()
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return 0
    sys.stdout.write(format_result(result) + "\n")
    sys.stdout.flush()
    if not args.no_table:
        sys.stdout.write("\n" + stage_table(args) + "\n")
    sys.stdout.write(f"\ntotal {time.monotonic() - started:.0f} s\n")
    return 0
