"""One node count / link rate of the bandwidth sweep: step time per stage, bytes per step (run by torchrun).

    torchrun ... scripts/sweep_job.py --out result.json --runs ddp,0,1,2,3 --n-layer 4 --n-embd 256

For each run (`ddp`: torch's DistributedDataParallel; 0-3: zeroshard's stages; `3q`: stage 3 with qwZ and qgZ;
`3pp`: stage 3 with hpZ over each node's ranks, qwZ and qgZ, docs/zeropp.md) on the same GPT, data and
AdamW (fused, the bench's bench_optimizer, for every system): warm-up steps, then `--steps` timed steps,
each the slowest rank's time (DESIGN.md: median, side by side with DDP in the same invocation). Bytes per step two ways: the paper-convention volume the
implementation issued (zeroshard's comm_report; the bench's c10d counter for DDP), and what the kernel
really sent through this node's interface (`/sys/class/net/$GLOO_SOCKET_IFNAME/statistics`, which
`ip netns exec` shows for the node's own namespace) during the timed steps, per node.
Rank 0 writes one JSON object to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.config.schema import ZeroConfig
from zeroshard.tools.bench import peers
from zeroshard.tools.bench.subject import zeroshard_subject
from zeroshard.tools.bench.worker import bench_optimizer
from zeroshard.tools.models.gpt import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # netns, beside this file
import netns

LR = 1e-3
# "1o"/"2o": stages 1/2 with zeroshard.overlap_param_gather ([Note: deferred parameter gather]);
# "1"/"2" with it off (step() waits for the gather), as in the recorded sweeps (the option is on by
# default for users).
# "2i"/"3i": stages 2/3 with one gradient reduction in flight in backward, "2t"/"3t" with two (what-ifs
# of the engine's Lifecycle.max_inflight, no config key). One is the default; in the recordings
# docs/bench/multinode_sweep_2i.json and _3i.json, "2"/"3" ran with two.
RUNS = ("ddp", "0", "1", "2", "3", "3q", "3h", "3pp", "1o", "2o", "2i", "3i", "2t", "3t")


def _runs(text: str) -> list[str]:
    runs = [r.strip() for r in text.split(",") if r.strip()]
    if not runs or any(r not in RUNS for r in runs):
        raise argparse.ArgumentTypeError(f"--runs {text!r}: a comma-separated list of {', '.join(RUNS)}")
    return runs


def _link_rates(text: str) -> list[tuple[str, int | None]]:
    try:
        rates = [(r.strip(), netns.parse_rate(r)) for r in text.split(",") if r.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not rates:
        raise argparse.ArgumentTypeError(f"--link-rates {text!r}: a comma-separated list such as 1gbit,none")
    return rates


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=_runs, default=["ddp", "0", "1", "2", "3"])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="micro batch per rank")
    parser.add_argument(
        "--untied",
        action="store_true",
        help="separate input embedding and LM head "
        "(the 33.7M GPT of docs/performance.md: --n-layer 8 --n-embd 512 --n-head 8 --seq-len 128)",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="build every run at once and take their timed steps in turn (more memory: "
        "every run's model states at once), instead of one run after the other",
    )
    parser.add_argument(
        "--link-rates",
        type=_link_rates,
        default=None,
        help="comma-separated link rates (as netcluster's --rate, 'none' included) to take in "
        "turn in every round, changing this node's tbf in between (two nodes, run as root "
        "in netcluster's namespaces); implies --interleave",
    )
    args = parser.parse_args(argv)
    for key in ("n_layer", "n_embd", "n_head", "vocab", "seq_len", "batch", "steps"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} {getattr(args, key)}: at least 1")
    return args


def _config(run: str, batch: int) -> dict:
    # No optimizer section: every run is handed the same torch AdamW (the bench's bench_optimizer).
    zero = {"stage": int(run[0]), "overlap_comm": True}
    if run in ("3q", "3pp"):  # ZeRO++ (docs/zeropp.md): hpZ over the ranks of a node (off at one per node)
        zero.update(zero_quantized_weights=True, zero_quantized_gradients=True)
    if run in ("3h", "3pp"):  # "3h": hpZ alone (its secondary copy in fp32)
        zero["zero_hpz_partition_size"] = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": False},
        "zero_optimization": zero,
        "zeroshard": {"comm_timeout_s": 600, **({"overlap_param_gather": run.endswith("o")} if run[0] in "12" else {})},
    }


def _vmhwm_bytes() -> int:
    """This process's peak resident memory so far (VmHWM): per run only with one run per invocation."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _link_tx_bytes() -> int:
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    path = Path(f"/sys/class/net/{ifname}/statistics/tx_bytes")
    return int(path.read_text()) if ifname and path.exists() else 0


def _subject(run: str, model, device, batch: int):
    make_optimizer = bench_optimizer({"lr": LR})
    if run == "ddp":
        return peers.build({"kind": "ddp"}, model, device, _config("0", batch), make_optimizer)

    def in_flight(engine):
        engine.sharded.lifecycle.max_inflight = 1 if run.endswith("i") else 2

    return zeroshard_subject(model, _config(run, batch), device, make_optimizer, in_flight if run[-1] in "it" else None)


def _batch(args, gpt: GPTConfig, rank: int):
    gen = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, gpt.vocab_size, (args.batch, gpt.block_size + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]  # (B, T), (B, T)


def _build(run: str, args, gpt: GPTConfig, rank: int):
    torch.manual_seed(0)
    subject = _subject(run, GPT(gpt), torch.device("cpu"), args.batch)
    x, y = _batch(args, gpt, rank)
    for _ in range(args.warmup):
        subject.step(x, y)
    paper = subject.count_comm(lambda: subject.step(x, y))  # one step, counted
    return subject, paper


def _result(run: str, subject, paper: dict, times: list[float], tx_per_step: float) -> dict:
    node_tx = subject.gather((os.environ.get("NETCLUSTER_NODE", "0"), tx_per_step))
    subject.settle()
    states = subject.states()  # at rest, after a step (an hpZ secondary copy lives from forward to step)
    return {
        "run": run,
        "params": subject.params,
        "median_s": statistics.median(times),
        "times_s": times,
        "paper_bytes_per_step": sum(paper.values()),
        "paper_bytes_by_kind": paper,
        "link_tx_bytes_per_step": dict(sorted(node_tx)),  # node -> bytes (its ranks read one counter)
        "states_bytes": states.get("total"),
        "vmhwm_bytes_by_rank": subject.gather(_vmhwm_bytes()),  # the process's peak so far
    }


def measure(run: str, args, gpt: GPTConfig, rank: int) -> dict:
    """One run's timed steps back to back (then the next run)."""
    subject, paper = _build(run, args, gpt, rank)
    x, y = _batch(args, gpt, rank)
    tx_before, times = _link_tx_bytes(), []
    for _ in range(args.steps):
        started = time.perf_counter()
        subject.step(x, y)
        times.append(subject.slowest(time.perf_counter() - started))
    result = _result(run, subject, paper, times, (_link_tx_bytes() - tx_before) / args.steps)
    subject.close()
    return result


class _Link:
    """This node's egress limit, changed between rounds (`--link-rates`): the node's first rank runs
    `tc` in the node's namespace (root there), then every rank waits for every node's change."""

    def __init__(self):
        self.rate_bps: int | None = None  # the launcher leaves the links unlimited (bandwidth_sweep.py)
        self.leader = os.environ.get("LOCAL_RANK", "0") == "0"

    def set(self, rate_bps: int | None) -> None:
        if rate_bps != self.rate_bps and self.leader:
            subprocess.run(
                netns.tbf_argv(os.environ["GLOO_SOCKET_IFNAME"], rate_bps), check=True, timeout=20, capture_output=True
            )
        self.rate_bps = rate_bps
        dist.barrier()


def measure_interleaved(
    runs: list[str], args, gpt: GPTConfig, rank: int, rates: list[tuple[str, int | None]] | None = None
) -> dict[str | None, list[dict]]:
    """Every run built at once, then round after round one timed step of each in turn, so that the
    box's load drifts over all of them alike (DESIGN.md: side by side in the same invocation); with
    `rates` (label, bits/s) each round takes them in turn too, the link limit changed in between.
    A run that leaves its parameter all-gather in flight past step() (overlap_param_gather,
    "1o"/"2o") takes an untimed step first in each turn, so that its timed step's forward overlaps a
    gather as in a run of consecutive steps, and is settled afterwards (outside the timing), so that
    the gather does not share the link with the next run's step. Bytes: a turn's, per step of it
    (nothing is in flight before or after a turn). Results by rate label (None without `rates`)."""
    x, y = _batch(args, gpt, rank)
    built = {run: _build(run, args, gpt, rank) for run in runs}  # warm-up and counted step: unlimited
    for subject, _ in built.values():
        subject.settle()
    rates, link = rates or [(None, None)], _Link()
    times = {(label, run): [] for label, _ in rates for run in runs}
    tx = {(label, run): 0.0 for label, _ in rates for run in runs}
    for _ in range(args.steps):
        for label, rate_bps in rates:
            if label is not None:
                link.set(rate_bps)
            for run, (subject, _) in built.items():
                tx_before = _link_tx_bytes()
                primed = run.endswith("o")
                if primed:
                    subject.step(x, y)
                started = time.perf_counter()
                subject.step(x, y)
                times[label, run].append(subject.slowest(time.perf_counter() - started))
                subject.settle()
                tx[label, run] += (_link_tx_bytes() - tx_before) / (2 if primed else 1)
    link.set(None)
    results = {
        label: [
            _result(run, subject, paper, times[label, run], tx[label, run] / args.steps)
            for run, (subject, paper) in built.items()
        ]
        for label, _ in rates
    }
    for subject, _ in built.values():
        subject.close()
    return results


def _reduce_scatter_algorithm() -> str:
    """What zeroshard's Communicator runs for a reduce-scatter here (it decides the bytes sent, see
    [Note: the advisor's time model]): a gloo pair's exchange of halves where it has one, else the
    backend's own (gloo's: an all-reduce's bytes; NCCL's: a ring)."""
    from zeroshard.core.comm import Communicator

    comm = Communicator(timeout_s=600)
    backend = dist.get_backend()
    algorithm = "pairwise" if getattr(comm, "pairwise", False) else ("allreduce" if backend == "gloo" else "ring")
    comm.destroy()
    return algorithm


def main(argv=None) -> None:
    args = parse_args(argv)
    zeroshard.init_distributed(timeout_s=600)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    gpt = GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq_len,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        tie_weights=not args.untied,
    )
    reduce_scatter = _reduce_scatter_algorithm()
    common = {
        "world": world,
        "gpt": vars(gpt),
        "batch": args.batch,
        "backend": dist.get_backend(),
        "reduce_scatter": reduce_scatter,
        "interleaved": bool(args.interleave or args.link_rates),
        # > 0: stage 3 keeps the unit last in forward gathered for backward
        "stage3_max_reuse_distance": ZeroConfig().stage3_max_reuse_distance,
        # and the unit last in forward too (core/gathered.py, reuse_offsets)
        "keeps_last_forward_unit": True,
    }
    if args.link_rates:  # one row per rate, every rate in every round
        by_rate = measure_interleaved(args.runs, args, gpt, rank, args.link_rates)
        document = {**common, "rows": [{"rate": label, "runs": by_rate[label]} for label, _ in args.link_rates]}
    elif args.interleave:
        document = {**common, "runs": measure_interleaved(args.runs, args, gpt, rank)[None]}
    else:
        document = {**common, "runs": [measure(run, args, gpt, rank) for run in args.runs]}
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(document, indent=1))
    dist.barrier()
    os._exit(0)  # torch 2.13 + gloo may abort at interpreter teardown (tests/harness.py)


if __name__ == "__main__":
    main()
