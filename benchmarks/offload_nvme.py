"""Train a GPT whose model states do not fit in this machine's RAM: stage 3 + NVMe offload of
parameters and optimizer states (ZeRO-Infinity, arXiv 2104.07857), on ranks launched by torchrun.

    torchrun --nproc_per_node 2 benchmarks/offload_nvme.py --nvme /work/nvme --steps 3 --out offload.json

Reports, per rank: peak RSS (sampled; anonymous and file-backed), step time split into compute /
communication wait / optimizer step (whose I/O wait is measured separately), bytes read and written
per step (/proc/self/io, block layer), and the achieved disk throughput against what `dd` with
O_DIRECT measures on the same path in the same run.

I/O on its own (the store's IOClock, offload/blockio.py): the bytes the NVMe store's aligned direct
requests moved, and the time they were in flight (union over requests), per step and for the
optimizer's sub-group stream alone; throughput while busy = bytes / busy time, as a fraction of
dd's (read against dd's read, write against dd's write, both against dd's time for the same
bytes); hidden = the share of that busy time the training thread did not wait for
(1 - store wait / busy time). The NVMe store's I/O path (O_DIRECT, or buffered where the file
system refuses it) is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import threading
import time

import psutil
import torch
import torch.distributed as dist

import zeroshard

try:
    from zeroshard.offload.blockio import union_s
except ImportError:  # an older zeroshard (before/after runs): it has no clock, so no spans to join

    def union_s(spans, start=None, end=None) -> float:
        return 0.0


from zeroshard.tools.models.gpt import GPT, GPTConfig

OPTIMIZERS = {"adamw": "AdamW", "adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}  # torchao's names


def dd_throughput(path: str, gigabytes: int = 2) -> dict:
    """Sequential write and read with O_DIRECT (no page cache), in GB/s."""
    target = os.path.join(path, "dd-probe.bin")
    count = gigabytes * 64  # 16 MiB blocks
    out = {}
    for name, args in (
        ("write", ["if=/dev/zero", f"of={target}", "oflag=direct"]),
        ("read", [f"if={target}", "of=/dev/null", "iflag=direct"]),
    ):
        result = subprocess.run(["dd", *args, "bs=16M", f"count={count}"], capture_output=True, text=True)
        match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", result.stderr)
        out[name] = int(match.group(1)) / float(match.group(2)) / 1e9 if match else None
    os.unlink(target)
    return out


class RSSSampler(threading.Thread):
    """Peak RSS and peak anonymous RSS, the latter per phase (`phase` is set by the main thread)."""

    def __init__(self, period: float = 0.2):
        super().__init__(daemon=True)
        self.period, self.peak, self.peak_anon, self.stop = period, 0, 0, False
        self.phase, self.anon_by_phase = "start", {}

    def run(self):
        while not self.stop:
            info = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith("Rss"))
            anon = int(info["RssAnon"].split()[0]) * 1024
            rss = psutil.Process().memory_info().rss
            self.peak, self.peak_anon = max(self.peak, rss), max(self.peak_anon, anon)
            phase = self.phase
            self.anon_by_phase[phase] = max(self.anon_by_phase.get(phase, 0), anon)
            time.sleep(self.period)


class NoClock:
    """Stands in for the store's IOClock when the benchmark runs an older zeroshard (PYTHONPATH), for
    a before/after of the figures both can report."""

    spans: list = []
    keep_spans = False

    def snapshot(self) -> dict:
        return dict.fromkeys(("read_bytes", "write_bytes", "read_busy_s", "write_busy_s", "busy_s"), 0)


def delta(after: dict, before: dict) -> dict:
    return {key: after[key] - before[key] for key in after}


def io_summary(io: dict, wait_s: float, dd: dict) -> dict:
    """Throughput of the store's requests while they were in flight, against dd; share hidden."""
    read, write, busy = io["read_bytes"], io["write_bytes"], io["busy_s"]
    dd_time = read / 1e9 / dd["read"] + write / 1e9 / dd["write"]  # dd's seconds for the same bytes
    out = dict(
        read_gb=read / 1e9,
        written_gb=write / 1e9,
        busy_s=busy,
        wait_s=wait_s,
        hidden=max(0.0, 1 - wait_s / busy) if busy else None,
        gb_per_s=(read + write) / busy / 1e9 if busy else None,
        of_dd=dd_time / busy if busy else None,
        read_gb_per_s=read / io["read_busy_s"] / 1e9 if io["read_busy_s"] else None,
        write_gb_per_s=write / io["write_busy_s"] / 1e9 if io["write_busy_s"] else None,
    )
    out["read_of_dd"] = out["read_gb_per_s"] / dd["read"] if out["read_gb_per_s"] else None
    out["write_of_dd"] = out["write_gb_per_s"] / dd["write"] if out["write_gb_per_s"] else None
    return out


def headline(summary: dict) -> str:
    """The figures of the run in a few lines (steps after the first)."""
    dd = summary["dd_gb_per_s"]
    lines = [
        f"dd O_DIRECT in this run: read {dd['read']:.2f} GB/s, write {dd['write']:.2f} GB/s; "
        f"NVMe store I/O path: {summary['io_mode']}",
        f"whole step (block-layer bytes of both ranks / step time): {summary['achieved_gb_per_s']:.2f} GB/s = "
        f"{summary['achieved_of_dd']:.0%} of dd's mean of read and write; optimizer phase alone "
        f"{summary['optimizer_phase_gb_per_s']:.2f} GB/s",
    ]
    for phase, io in summary["store_io"].items():
        if io.get("gb_per_s"):
            lines.append(
                f"store I/O while busy ({phase}): {io['read_gb']:.1f} GB read + {io['written_gb']:.1f} GB "
                f"written in {io['busy_s']:.1f} s busy = {io['gb_per_s']:.2f} GB/s = {io['of_dd']:.0%} of dd "
                f"(read {io['read_of_dd'] or 0:.0%}, write {io['write_of_dd'] or 0:.0%}); "
                f"hidden {io['hidden']:.0%} (waited {io['wait_s']:.1f} s)"
            )
    return "\n".join(lines)


def io_bytes() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme", required=True, help="directory on the disk to offload to")
    parser.add_argument("--n-layer", type=int, default=40)
    parser.add_argument("--n-embd", type=int, default=2048)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="offload_nvme.json")
    parser.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default="adamw",
        help="adamw: the config's AdamW (fp32 moments); adamw8bit / adamw4bit: torchao's block-wise one, "
        "passed as the client optimizer (the lowbit extra)",
    )
    parser.add_argument(
        "--masters",
        choices=["fp32", "bf16"],
        default="fp32",
        help="fp32: fp32 compute and masters; bf16: bf16 compute with bf16 masters and optimizer states "
        "(bf16.bf16_master_weights_and_grads and bf16_optimizer_states; a torchao optimizer rounds "
        "stochastically)",
    )
    parser.add_argument(
        "--slices",
        choices=["config", "memory"],
        default="config",
        help="where zero.Init keeps each rank's slices until the engine takes them: 'config' passes the "
        "config to zero.Init, whose offload_param puts them in files (DeepSpeed's remote_device='nvme'); "
        "'memory': zero.Init() without a config, slices in memory",
    )
    parser.add_argument(
        "--nvme-io",
        choices=["direct", "buffered", "mapped"],
        default=None,
        help="zeroshard.nvme_io (default: unset, training's default, 'mapped')",
    )
    args = parser.parse_args()

    zeroshard.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, os.cpu_count() // world))
    sampler = RSSSampler()
    sampler.start()
    os.makedirs(args.nvme, exist_ok=True)  # dd writes its probe there before the store exists
    dd = dd_throughput(args.nvme) if rank == 0 else None
    dist.barrier()

    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme},
            "offload_param": {"device": "nvme", "nvme_path": args.nvme},
        },
    }
    if args.masters == "bf16":
        config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    if args.nvme_io is not None:
        config["zeroshard"] = {"nvme_io": args.nvme_io}
    torch.manual_seed(0)
    started = time.monotonic()
    sampler.phase = "construction"
    # No rank ever holds the whole model; with the config, each slice goes to a file as it is cut.
    with zeroshard.zero.Init(config_dict_or_path=config if args.slices == "config" else None):
        model = GPT(
            GPTConfig(
                vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
            )
        )
    constructed_s = time.monotonic() - started
    sampler.phase = "initialize"
    params = sum(p.numel() for p in model.parameters())
    client = None
    if args.optimizer != "adamw":
        import torchao.optim

        rounding = {"bf16_stochastic_round": True} if args.masters == "bf16" else {}
        client = getattr(torchao.optim, OPTIMIZERS[args.optimizer])(
            model.parameters(), lr=1e-4, weight_decay=0.1, **rounding
        )
        del config["optimizer"]
    engine, *_ = zeroshard.initialize(model=model, optimizer=client, config=config)
    build_s = time.monotonic() - started
    peak_after_build = sampler.peak
    sampler.phase = "steps"
    store = engine.placement.optimizer_store
    clock = store.io.clock if hasattr(store, "io") else NoClock()  # a store before the aligned path: no clock
    clock.keep_spans = True
    steps = []
    for step in range(args.steps):
        tokens = torch.randint(
            0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(step * world + rank)
        )
        read0, write0 = io_bytes()
        comm0, io_wait0 = engine.comm.counter.wait_s, store.counters.wait_s
        clock0, first_span = clock.snapshot(), len(clock.spans)
        t0 = time.monotonic()
        _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        t1 = time.monotonic()
        clock1, io_wait1, opt_read0, opt_write0 = clock.snapshot(), store.counters.wait_s, *io_bytes()
        engine.step()
        t2 = time.monotonic()
        read1, write1 = io_bytes()
        clock2 = clock.snapshot()
        comm = engine.comm.counter.wait_s - comm0
        steps.append(
            dict(
                step=step,
                loss=loss.item(),
                total_s=t2 - t0,
                forward_backward_s=t1 - t0,
                optimizer_s=t2 - t1,
                comm_wait_s=comm,
                io_wait_s=store.counters.wait_s - io_wait0,
                optimizer_io_wait_s=store.counters.wait_s - io_wait1,
                compute_s=(t1 - t0) - comm,
                read_bytes=read1 - read0,
                written_bytes=write1 - write0,
                optimizer_read_bytes=read1 - opt_read0,
                optimizer_written_bytes=write1 - opt_write0,
                store_io=delta(clock2, clock0),
                optimizer_store_io=delta(clock2, clock1),
                step_window=(t0, t2),
                optimizer_window=(t1, t2),
                spans=clock.spans[first_span:],
            )
        )
    sampler.stop = True
    report = dict(
        rank=rank,
        params=params,
        model_state_bytes_fp32_adam=16 * params,
        optimizer=args.optimizer,
        masters=args.masters,
        slices=args.slices,
        construction_s=constructed_s,
        build_s=build_s,
        peak_rss=sampler.peak,
        peak_rss_anon=sampler.peak_anon,
        peak_rss_after_build=peak_after_build,
        peak_rss_anon_by_phase=dict(sampler.anon_by_phase),  # start, construction, initialize, steps
        ru_maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        offloaded_bytes=engine.memory_report()["offloaded_nvme"],
        steps=steps,
    )
    reports = engine.comm.all_gather_objects(report, "benchmark report")
    if rank == 0:
        disk = sum(s["read_bytes"] + s["written_bytes"] for r in reports for s in r["steps"][1:])
        seconds = sum(s["total_s"] for s in reports[0]["steps"][1:])
        later = [(r, s) for r in reports for s in r["steps"][1:]]  # after the first step (states created)
        opt_disk = sum(s["optimizer_read_bytes"] + s["optimizer_written_bytes"] for _, s in later)
        opt_seconds = sum(s["optimizer_s"] for s in reports[0]["steps"][1:])
        io = {}
        for phase, key, wait, window in (
            ("all", "store_io", "io_wait_s", "step_window"),
            ("optimizer", "optimizer_store_io", "optimizer_io_wait_s", "optimizer_window"),
        ):
            if not later:
                continue
            total = {k: sum(s[key][k] for _, s in later) for k in ("read_bytes", "write_bytes")}
            # The ranks share one disk: its busy time is the union of every rank's busy intervals
            # (one monotonic clock for the machine), per step, within that step's window.
            for name, kind in (("busy_s", None), ("read_busy_s", "read"), ("write_busy_s", "write")):
                total[name] = 0.0
                for i in range(1, len(reports[0]["steps"])):
                    start = min(r["steps"][i][window][0] for r in reports)
                    end = max(r["steps"][i][window][1] for r in reports)
                    spans = [span for r in reports for span in r["steps"][i]["spans"]]
                    if kind is None:
                        total[name] += union_s(spans, start, end)
                    else:  # one kind alone: the rank's own per-kind figure, the slowest rank's
                        total[name] = max(sum(s[key][name] for s in r["steps"][1:]) for r in reports)
            waited = max(sum(s[wait] for s in r["steps"][1:]) for r in reports)
            io[phase] = io_summary(total, waited, dd)
            io[phase]["per_step_busy_s"] = total["busy_s"] / (len(reports[0]["steps"]) - 1)
        for report in reports:
            for step in report["steps"]:
                del step["spans"]  # thousands of intervals: joined above, not kept in the JSON
        summary = dict(
            dd_gb_per_s=dd,
            ranks=reports,
            achieved_gb_per_s=disk / seconds / 1e9 if seconds else None,
            achieved_of_dd=disk / seconds / 1e9 / ((dd["read"] + dd["write"]) / 2) if seconds else None,
            optimizer_phase_gb_per_s=opt_disk / opt_seconds / 1e9 if opt_seconds else None,
            store_io=io,
            io_mode=getattr(store, "io_mode", "memory-mapped (no aligned path)"),
            command="torchrun --nproc_per_node {} benchmarks/offload_nvme.py {}".format(
                world, " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)
            ),
        )
        with open(args.out, "w") as handle:
            json.dump(summary, handle, indent=2)
        print(json.dumps(summary, indent=2))
        print(headline(summary))
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
