"""What a checkpoint costs the training loop, saved synchronously and asynchronously.

    python benchmarks/async_checkpoint.py --stages 1,3 --out /tmp/async_checkpoint.txt

One `torchrun --standalone --nproc_per_node 2` launch (gloo, 1 torch thread per rank, fp32, torch's
default AdamW) per stage, on the 218M GPT (vocab 8192, width 1024, 16 layers, untied head; micro-batch
4 x 128 random tokens per rank). After `--warmup` steps (the optimizer state exists), per rank:
  * `step s`: the median of `--steps` training steps with no save running;
  * `sync save s`: `engine.save_checkpoint(dir)`, what the loop waits for today;
  * for `--saves` asynchronous saves, one after another, each followed by training steps until it is
    published: `stall s`, the time `save_checkpoint(..., async_save=True)` blocks (staging); `steps
    while writing`, their median step time; `published s`, from the call to the checkpoint being
    published (`wait_checkpoint()` after the first step that finds the writer done). The first save
    allocates the staging buffers, later ones reuse them ([Note: staging buffers]): both are shown;
  * `staged MB`: the host copy the asynchronous save keeps (the rank file's tensors).
Each figure is the slowest rank's. Checkpoints go to `--dir` (default: a temporary directory on the
same disk as /tmp), deleted after each save is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(vocab_size=8192, block_size=128, n_layer=16, n_head=16, n_embd=1024, tie_weights=False)
MICRO, SEQ = 4, 128


def _worker(args) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    import torch
    import torch.distributed as dist

    import zeroshard
    from zeroshard.tools.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234)
    model = GPT(GPTConfig(**SHAPE))
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": args.stage},
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = zeroshard.initialize(model=model, optimizer=optimizer, config=config)
    generator = torch.Generator().manual_seed(rank)

    def step() -> float:
        tokens = torch.randint(0, SHAPE["vocab_size"], (MICRO, SEQ + 1), generator=generator)
        dist.barrier()
        started = time.perf_counter()
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - started

    def timed(fn) -> float:
        dist.barrier()
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    def slowest(value: float) -> float:
        out = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return float(out.item())

    directory = Path(args.dir)
    for _ in range(args.warmup):
        step()
    steps = [slowest(step()) for _ in range(args.steps)]
    sync = slowest(timed(lambda: engine.save_checkpoint(directory / "sync", tag="t")))
    rank_file = directory / "sync" / "t" / f"rank_{rank:05d}.safetensors"
    staged_mb = slowest(os.path.getsize(rank_file) / 1e6)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(directory / "sync")
    saves = []
    for index in range(args.saves):
        started = time.perf_counter()
        stall = slowest(
            timed(lambda i=index: engine.save_checkpoint(directory / f"async{i}", tag="t", async_save=True))
        )
        during = []
        while True:
            during.append(slowest(step()))
            busy = torch.tensor([int(engine._background_saves.busy)])
            dist.all_reduce(busy, op=dist.ReduceOp.MAX)
            if not busy.item():
                break
        engine.wait_checkpoint()
        published = slowest(time.perf_counter() - started)
        saves.append({"stall_s": stall, "steps_while_writing": during, "published_s": published})
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory / f"async{index}")
    if rank == 0:
        print(
            json.dumps(
                {
                    "stage": args.stage,
                    "params": sum(p.numel() for p in GPT(GPTConfig(**SHAPE)).parameters()),
                    "step_s": statistics.median(steps),
                    "step_times": steps,
                    "sync_save_s": sync,
                    "staged_mb": staged_mb,
                    "saves": saves,
                }
            ),
            flush=True,
        )
    engine.destroy()
    dist.destroy_process_group()


def _table(results: list[dict]) -> str:
    lines = [
        "| stage | step s | sync save s | async save | stall s | stall / sync save | median step while writing s "
        "| published after s | staged MB/rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for index, save in enumerate(r["saves"]):
            lines.append(
                f"| {r['stage']} | {r['step_s']:.2f} | {r['sync_save_s']:.2f} | "
                f"{'first (allocates)' if index == 0 else f'#{index + 1} (reuses)'} | {save['stall_s']:.3f} | "
                f"{save['stall_s'] / r['sync_save_s']:.1%} | {statistics.median(save['steps_while_writing']):.2f} | "
                f"{save['published_s']:.2f} | {r['staged_mb']:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--stages", default="1,3")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--saves", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=None, help="write the table and the raw results here")
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    results = []
    with tempfile.TemporaryDirectory(prefix="zs-async-ckpt-") as tmp:
        for stage in [int(s) for s in args.stages.split(",")]:
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                __file__, "--worker", "--stage", str(stage), "--steps", str(args.steps),
                "--warmup", str(args.warmup), "--saves", str(args.saves), "--dir", args.dir or tmp,
            ]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 and not lines:
                sys.exit(f"stage {stage}: exit {done.returncode}\n{done.stderr[-3000:]}")
            results.append(json.loads(lines[-1]))
            print(lines[-1], flush=True)
    table = _table(results)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n\n" + "\n".join(json.dumps(r) for r in results) + "\n")


if __name__ == "__main__":
    main()
