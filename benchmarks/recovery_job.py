"""The job `benchmarks/snapshot_recovery.py` runs on every machine: an elastic training script that
resumes at every (re)start, from the snapshots in host memory (`--recover snapshot`:
`engine.recover()`) or from the newest disk checkpoint (`--recover disk`: `engine.load_checkpoint`).

    torchrun --nnodes 1:3 --max-restarts 3 ... benchmarks/recovery_job.py --out DIR --ckpt CK --snapshots SHM
    torchrun --standalone --nproc_per_node 2 benchmarks/recovery_job.py --out D2 --ckpt CK --tag global_step5 --no-save

The GPT (`--layers`, `--width`, `--vocab`, sequence 128, untied head) trains at ZeRO stage 3 with
torch's AdamW and a fixed global batch (`train_batch_size`), so any world size takes the same
samples per step: step s's batch is the global samples [s*B, (s+1)*B), rank r's micro step m the
micro-batch at m*world + r of it, each sample a fixed function of its index. A disk checkpoint
after every step is the oracle the parent compares with (`--tag ... --no-save` resumes one
directly); with `--recover snapshot`, `"snapshot_every_steps": 1` writes a snapshot in every step.

Each rank writes DIR/rank<R>.restart<K>.json (K: torchelastic's restart count) after its start-up and
after every step's update (before its checkpoint): the world size, where it resumed from and why, the
wall-clock time (`time.time()`, which the parent shares) at process start, after the resume, and at
each step's end, and each step's loss.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

STARTED = time.time()

import torch  # noqa: E402 - the process start time first

import zeroshard  # noqa: E402
from zeroshard.tools.models.gpt import GPT, GPTConfig  # noqa: E402

MICRO, SEQ, SEED = 2, 128, 1234


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--snapshots", type=Path, default=None, help="host memory: DIR/node<N> per machine")
    parser.add_argument("--recover", choices=("snapshot", "disk"), default="snapshot")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=24, help="train_batch_size, fixed")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tag", default=None, help="resume this disk checkpoint (a comparison run)")
    parser.add_argument("--no-save", action="store_true", help="no checkpoints, no snapshots (a comparison run)")
    parser.add_argument("--comm-timeout-s", type=float, default=20.0)
    return parser.parse_args(argv)


def sample(index: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (SEQ + 1,), generator=torch.Generator().manual_seed(SEED + index))


def micro_batch(step: int, micro: int, rank: int, world: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    first = step * args.batch + (micro * world + rank) * MICRO
    rows = torch.stack([sample(first + i, args.vocab) for i in range(MICRO)])
    return rows[:, :-1], rows[:, 1:]


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    path = args.out / f"rank{rank}.restart{restart}.json"
    report: dict = {"rank": rank, "world": world, "restart": restart, "node": os.environ.get("NETCLUSTER_NODE")}
    report["t_start"] = STARTED

    def write() -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report))
        os.replace(tmp, path)

    torch.set_num_threads(1)
    try:
        zeroshard.init_distributed(timeout_s=args.comm_timeout_s)
        config: dict = {
            "train_batch_size": args.batch,
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3},
            "zeroshard": {"comm_timeout_s": args.comm_timeout_s},
        }
        if args.recover == "snapshot" and not args.no_save:
            node = os.environ.get("NETCLUSTER_NODE", "0")
            config["zeroshard"].update(snapshot_dir=str(args.snapshots / f"node{node}"), snapshot_every_steps=1)
        torch.manual_seed(SEED)
        shape = dict(vocab_size=args.vocab, block_size=SEQ, n_layer=args.layers, n_head=8, n_embd=args.width)
        model = GPT(GPTConfig(**shape, tie_weights=False))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, *_ = zeroshard.initialize(model=model, optimizer=optimizer, config=config)
        report["t_engine"] = time.time()
        report["phase"] = "recovering"
        write()
        if args.tag is not None:
            engine.load_checkpoint(args.ckpt, tag=args.tag)
            report.update(source="checkpoint", resumed=int(args.tag.removeprefix("global_step")), reason="")
        elif args.recover == "snapshot":
            recovered = engine.recover(checkpoint_dir=args.ckpt)
            report.update(source=recovered.source, resumed=recovered.step, reason=recovered.reason)
        elif (args.ckpt / "latest").exists():
            loaded, _ = engine.load_checkpoint(args.ckpt)
            report.update(source="checkpoint", resumed=int(Path(loaded).name.removeprefix("global_step")), reason="")
        else:
            report.update(source="nothing", resumed=None, reason="no checkpoint")
        report["t_recovered"] = time.time()
        report["phase"] = "training"
        report["gas"] = engine.gradient_accumulation_steps()
        report["steps"] = {}
        write()
        for step in range(engine.global_steps, args.steps):
            losses = []
            for micro in range(report["gas"]):
                _, loss = engine(*micro_batch(step, micro, rank, world, args))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            report["steps"][str(step)] = {"loss": sum(losses) / len(losses), "t_end": time.time()}  # updated
            write()
            if not args.no_save:
                engine.save_checkpoint(args.ckpt)  # the oracle of every step (after the step's snapshot)
        engine.destroy()
        report["phase"] = "done"
        write()
    except Exception:  # noqa: BLE001 - any failure: its traceback in the node's log, a failed exit
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # torch 2.13 + gloo may abort at teardown after all work finished


if __name__ == "__main__":
    main()
