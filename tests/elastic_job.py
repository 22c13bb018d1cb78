"""The job of the elastic-restart test: train the tiny GPT with `train_batch_size` fixed, checkpoint after
every step, and at every (re)start resume from the newest checkpoint, whatever the world size now.

    torchrun --nnodes 1:2 --max-restarts 3 ... -m tests.elastic_job --out DIR --ckpt CK --steps 12
    torchrun --standalone --nproc_per_node 2 -m tests.elastic_job --out DIR2 --ckpt CK --tag global_step3 --no-save

This is what a user's elastic script looks like: `engine.load_checkpoint(dir)` at start (`latest`), or
with `--snapshots` `engine.recover()` from the snapshots in host memory, the same config at every world size; zeroshard derives the gradient accumulation from the fixed global batch.
Each rank writes DIR/rank<R>.restart<K>.json after every step (K: torchelastic's restart count): the
world size, the accumulation steps, the tag it resumed and its loss per global step.

The data is a fixed function of the global sample index: step s's global batch is samples
[s*B, (s+1)*B) (B = train_batch_size), rank r's micro step m takes the micro-batch at index
m*world + r of it, so every world size trains on the same samples per step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

import zeroshard
from tests.reference import gpt_loss
from tests.zs_common import adamw, gpt_model_fn
from zeroshard.tools.models.gpt import tiny_gpt_config

MICRO = 2
VOCAB_CONFIG = tiny_gpt_config()


def sample(index: int) -> torch.Tensor:
    """Global sample `index`: a row counting up from a random start (mod vocab), learnable."""
    start = torch.randint(0, VOCAB_CONFIG.vocab_size, (1,), generator=torch.Generator().manual_seed(index))
    return (start + torch.arange(VOCAB_CONFIG.block_size + 1)) % VOCAB_CONFIG.vocab_size  # (T + 1,)


def micro_batch(step: int, micro: int, rank: int, world: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    first = step * batch + (micro * world + rank) * MICRO
    rows = torch.stack([sample(first + i) for i in range(MICRO)])  # (MICRO, T + 1)
    return rows[:, :-1], rows[:, 1:]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12, help="global steps to reach")
    parser.add_argument("--batch", type=int, default=16, help="train_batch_size, fixed")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--tag", default=None, help="resume this tag instead of latest")
    parser.add_argument("--no-save", action="store_true", help="do not checkpoint (a comparison run)")
    parser.add_argument("--comm-timeout-s", type=float, default=20.0)
    parser.add_argument(
        "--first-run-step-s", type=float, default=0.0, help="before restarts: each step lasts this long"
    )
    parser.add_argument(
        "--snapshots",
        type=Path,
        default=None,
        help="after each step's checkpoint, a snapshot in DIR/node<N> (this machine's memory, N its "
        "netcluster index); at a (re)start, engine.recover() from the snapshots instead of the checkpoint",
    )
    return parser.parse_args(argv)


def main(argv=None, *, leave: bool = True) -> None:
    """`leave`: end the process with os._exit, as under torchrun; False for a test's kept ranks."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    path = args.out / f"rank{rank}.restart{restart}.json"
    torch.set_num_threads(1)
    try:
        zeroshard.init_distributed(timeout_s=args.comm_timeout_s)
        config = {
            "train_batch_size": args.batch,
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": args.stage},
            "zeroshard": {"comm_timeout_s": args.comm_timeout_s},
        }
        if args.snapshots is not None:
            config["zeroshard"]["snapshot_dir"] = str(args.snapshots / f"node{os.environ['NETCLUSTER_NODE']}")
        model = gpt_model_fn()()
        engine, *_ = zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config=config)
        resumed, source = None, None
        if args.snapshots is not None:
            recovered = engine.recover()  # the snapshots alone: the checkpoints are the test's oracle
            source = recovered.source
            resumed = None if recovered.step is None else f"global_step{recovered.step}"
        elif args.tag is not None or (args.ckpt / "latest").exists():
            loaded, _ = engine.load_checkpoint(args.ckpt, tag=args.tag)
            resumed, source = Path(loaded).name, "checkpoint"
        gas = engine.gradient_accumulation_steps()
        report = {"rank": rank, "world": world, "restart": restart, "gas": gas, "resumed": resumed, "source": source}
        report["losses"] = {}
        for step in range(engine.global_steps, args.steps):
            losses = []
            for micro in range(gas):
                loss = gpt_loss(engine, *micro_batch(step, micro, rank, world, args.batch))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            report["losses"][str(step)] = sum(losses) / len(losses)
            if restart == 0 and args.first_run_step_s:  # time for the test to kill a machine mid-run
                time.sleep(args.first_run_step_s)
            if not args.no_save:
                engine.save_checkpoint(args.ckpt)
            if args.snapshots is not None:  # after the checkpoint: a snapshot's step always has one
                engine.snapshot()
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(report))
            os.replace(tmp, path)
        engine.destroy()
    except Exception:
        if not leave:
            raise
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    if not leave:
        return
    sys.stdout.flush()
    os._exit(0)  # torch 2.13 + gloo may abort at teardown (tests/harness.py)


if __name__ == "__main__":
    main()
