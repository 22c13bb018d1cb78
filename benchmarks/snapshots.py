"""What snapshots in host memory cost per step, and how fast a run recovers from them against a
checkpoint read from disk ([Note: snapshots on a buddy] in checkpoint/snapshot.py).

    python benchmarks/snapshots.py --out docs/bench/snapshots.txt
    python benchmarks/snapshots.py --auto-steps 40 --out docs/bench/snapshots_auto.txt

One `torchrun --standalone --nproc_per_node 2` launch (gloo, 1 torch thread per rank) in which each
rank plays a machine of its own (LOCAL_WORLD_SIZE=1, a snapshot directory per rank), so each rank's
buddy is the other one. The GPT (default: vocab 8192, 8 layers of width 512, sequence 128, untied
head: 33.7M parameters; `--layers 16 --width 1024` is the 218M one) trains at ZeRO stage 3 with
torch's AdamW, micro-batch 4 per rank, random tokens. Measured, medians over `--steps` steps each,
the slowest rank's time:
  * a training step without snapshots; a synchronous snapshot after a step
    (`engine.snapshot(async_snapshot=False)`), whose overhead per step at every k is snapshot / (k x
    step); and a step followed by an asynchronous snapshot (the default: the writer's thread sends and
    writes while the next step runs, and the next snapshot first waits for it), against the plain step;
  * a synchronous checkpoint to `--disk` (`engine.save_checkpoint`), for comparison;
  * recovery by a fresh engine: `engine.recover()` with both machines' snapshots in place, and with
    machine 1's memory lost (its directory removed: machine 0 sends it every file), against
    `engine.load_checkpoint` from `--disk` with the page cache dropped first (when allowed), as after
    a restart on another machine. Each recovery is followed by a step whose losses must equal those
    of the run it recovered from;
  * with `--auto-steps N`: N steps of an engine with `snapshot_every_steps: "auto"` (budget
    `--overhead`, [Note: snapshot pace] in checkpoint/pace.py): the interval it chose after each
    step, and the mean step time from its first snapshot on against the same N steps of an engine
    without snapshots, run just before it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from two_ranks import add_shape_arguments, gpt_shape, launch, table_of, write_record

MICRO, SEED = 4, 1234


def _drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def worker(args) -> None:
    import torch.distributed as dist

    import zeroshard
    from zeroshard.tools.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # each rank a machine of its own, so the other is its buddy
    zeroshard.init_distributed()
    rank = dist.get_rank()
    mine = args.scratch / f"machine{rank}"
    shape = args.shape
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "zero_optimization": {"stage": 3},
        "gradient_clipping": 1.0,
        "zeroshard": {"snapshot_dir": str(mine)},
    }
    gen = torch.Generator().manual_seed(SEED + rank)
    count = max(3 * args.steps + 8, args.auto_steps + 1)
    tokens = torch.randint(0, shape["vocab_size"], (count, MICRO, 129), generator=gen)

    def build(**zeroshard_keys):
        torch.manual_seed(SEED)
        model = GPT(GPTConfig(**shape))
        engine, *_ = zeroshard.initialize(
            model=model,
            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
            config={**config, "zeroshard": {**config["zeroshard"], **zeroshard_keys}},
        )
        return engine

    def timed(fn) -> float:
        dist.barrier()
        started = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - started])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    def step(engine) -> float:
        batch = tokens[engine.global_steps]
        _, loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        return float(loss)

    engine = build()
    step(engine)  # warm-up
    steps = [timed(lambda: step(engine)) for _ in range(args.steps)]
    snapshots = []
    for _ in range(args.steps):
        step(engine)
        snapshots.append(timed(lambda: engine.snapshot(async_snapshot=False)))
    with_async = [timed(lambda: (step(engine), engine.snapshot())) for _ in range(args.steps)]
    engine.wait_checkpoint()
    saves = [timed(lambda: engine.save_checkpoint(args.disk)) for _ in range(args.steps)]
    at = engine.global_steps
    expected = step(engine)  # the step every recovery must repeat
    engine.destroy()
    rows = {"step": steps, "snapshot, synchronous": snapshots, "step + async snapshot": with_async}
    rows["save to disk"] = saves
    for name, prepare, restore in (
        ("recover, both machines", None, lambda e: e.recover()),
        ("recover, machine 1 lost", "lose", lambda e: e.recover()),
        ("load from disk", "drop", lambda e: e.load_checkpoint(args.disk)),
    ):
        times = []
        for _ in range(args.steps):
            if prepare == "lose" and rank == 1:
                shutil.rmtree(mine)
            if prepare == "drop" and rank == 0:
                _drop_page_cache()
            fresh = build()
            times.append(timed(lambda restore=restore, fresh=fresh: restore(fresh)))
            assert fresh.global_steps == at, (name, fresh.global_steps, at)
            assert step(fresh) == expected, f"{name}: the next step differs from the run's"
            fresh.destroy()
            if prepare == "lose":  # machine 1 has its files again (recover gave them): lose them next time
                dist.barrier()
        rows[name] = times
    files = sum(f.stat().st_size for f in (mine / f"snapshot{at}").iterdir())
    intervals, auto_times, plain_times = [], [], []
    if args.auto_steps:
        plain = build()  # the same steps without snapshots, just before: like for like
        plain_times = [timed(lambda plain=plain: step(plain)) for _ in range(args.auto_steps)]
        plain.destroy()
        shutil.rmtree(mine, ignore_errors=True)
        paced = build(snapshot_every_steps="auto", snapshot_overhead=args.overhead)
        for _ in range(args.auto_steps):
            auto_times.append(timed(lambda paced=paced: step(paced)))
            intervals.append(paced.snapshot_every)
        paced.wait_checkpoint()
        paced.destroy()
    if rank == 0:
        params = sum(p.numel() for p in GPT(GPTConfig(**shape)).parameters())
        print(
            f"GPT {params:,} parameters, stage 3, 2 ranks as 2 machines; {files / 2**20:.1f} MiB of snapshot per machine"
        )
        print(f"{'what':<26} {'median s':>9} {'min s':>7} {'max s':>7}")
        for name, times in rows.items():
            print(f"{name:<26} {statistics.median(times):>9.3f} {min(times):>7.3f} {max(times):>7.3f}")
        step_s, snap_s = statistics.median(steps), statistics.median(snapshots)
        print(
            "synchronous snapshot per step: " + ", ".join(f"k={k}: {snap_s / (k * step_s):.1%}" for k in (1, 10, 100))
        )
        print(f"asynchronous snapshot every step: {statistics.median(with_async) / step_s - 1:+.1%} step time")
        print(f"drop_caches before each disk load: {_drop_page_cache()}")
        if auto_times:
            first = next(i for i, every in enumerate(intervals) if every is not None)  # the first snapshot's step
            print(
                f'snapshot_every_steps "auto", snapshot_overhead {args.overhead}: interval after each step {intervals}'
            )
            measured = first + intervals[first] + 1  # the second snapshot's step: intervals from measurement
            for label, start in (("the first snapshot's copy", first + 1), ("the second snapshot's copy", measured)):
                after, without = auto_times[start:], plain_times[start:]
                if after:
                    print(
                        f"steps {start + 1}-{len(auto_times)} (from {label} on): mean {statistics.mean(after):.3f} s "
                        f"with auto snapshots, {statistics.mean(without):.3f} s without (the same steps, run just "
                        f"before): {statistics.mean(after) / statistics.mean(without) - 1:+.1%}"
                    )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="repeats of each measurement (default: 5)")
    add_shape_arguments(parser, layers=8, width=512)
    parser.add_argument(
        "--disk", type=Path, default=None, help="the disk checkpoint's directory (default: a temporary one)"
    )
    parser.add_argument("--auto-steps", type=int, default=0, help='steps with snapshot_every_steps "auto" (default: 0)')
    parser.add_argument("--overhead", type=float, default=0.03, help="snapshot_overhead with --auto-steps (0.03)")
    parser.add_argument("--out", type=Path, default=None, help="also write the command and the table here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: at least 1")
    args.shape = gpt_shape(parser, args)
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(dir="/dev/shm") as scratch, tempfile.TemporaryDirectory() as disk:
        argv = ["--worker", "--steps", str(args.steps), "--layers", str(args.layers), "--width", str(args.width)]
        argv += ["--auto-steps", str(args.auto_steps), "--overhead", str(args.overhead)]
        stdout = launch(__file__, [*argv, "--scratch", scratch, "--disk", str(args.disk or disk)])
    text = table_of(stdout)
    print(text)
    write_record(args.out, __file__, text)


if __name__ == "__main__":
    main()
