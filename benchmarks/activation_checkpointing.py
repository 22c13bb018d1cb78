"""Peak memory of a deep GPT at stage 3 on 2 ranks, with and without activation checkpointing.

    .venv/bin/python benchmarks/activation_checkpointing.py [--layers 24] [--steps 2]

Each setting runs in fresh processes (torchrun, gloo on CPU) with MALLOC_MMAP_THRESHOLD_=65536, so that
glibc returns freed blocks to the OS and RSS follows live memory (DESIGN.md, "How performance is
measured"). A rank resets its peak RSS (VmHWM, via /proc/self/clear_refs) after one warm-up step and
reads it after the measured steps: the increase over the RSS at rest is what training needs on top of
the model states, mostly activations. Reported: the largest over ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := current RSS


def worker(args) -> None:
    import torch

    import zeroshard
    from zeroshard.tools.models.gpt import GPT, GPTConfig

    zeroshard.init_distributed()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=args.width))
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "zero_optimization": {"stage": 3},
        "zeroshard": {"activation_checkpointing_units": bool(args.checkpoint)},
    }
    engine, *_ = zeroshard.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=config
    )
    gen = torch.Generator().manual_seed(engine.global_rank)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen)  # (B, T + 1)

    def step() -> None:
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()

    step()  # warm-up: optimizer state exists from here on
    rest = _vm("VmRSS")
    _reset_peak()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = (time.perf_counter() - started) / args.steps
    mine = {"rest_mib": rest / MIB, "peak_mib": _vm("VmHWM") / MIB, "step_s": seconds}
    everyone = engine.comm.all_gather_objects(mine, "benchmark report")
    if engine.global_rank == 0:
        worst = max(everyone, key=lambda r: r["peak_mib"] - r["rest_mib"])
        print("RESULT " + json.dumps({"parameters": engine.num_parameters(), **worst}), flush=True)
    engine.destroy()


def run_setting(args, checkpoint: bool) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [
        str(torchrun),
        "--standalone",
        "--nproc_per_node",
        "2",
        __file__,
        "--worker",
        "--checkpoint",
        str(int(checkpoint)),
        "--layers",
        str(args.layers),
        "--width",
        str(args.width),
        "--seq",
        str(args.seq),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
    ]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"benchmark run failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    print(
        f"GPT: {args.layers} layers, width {args.width}, batch {args.batch} x {args.seq} tokens per rank; "
        "stage 3, 2 ranks (gloo, CPU), MALLOC_MMAP_THRESHOLD_=65536"
    )
    print(f"{'activation checkpointing':<26}{'RSS at rest':>14}{'peak RSS':>12}{'peak - rest':>14}{'step':>9}")
    for checkpoint in (False, True):
        r = run_setting(args, checkpoint)
        print(
            f"{'units' if checkpoint else 'off':<26}{r['rest_mib']:>10.0f} MiB{r['peak_mib']:>8.0f} MiB"
            f"{r['peak_mib'] - r['rest_mib']:>10.0f} MiB{r['step_s']:>8.2f}s"
        )


if __name__ == "__main__":
    main()
