"""Optimizer step on CPU for one flat fp32 shard: torch.optim.AdamW's implementations side by side.

The offloaded (streamed) step runs the torch optimizer on flat sub-groups, so the fastest torch
implementation on this CPU is what zeroshard should use there. Median of repeated steps after
warm-up; elements per second and effective memory bandwidth (AdamW touches 4 arrays read + 3 written).

    python benchmarks/cpu_adam.py --numel 16e6 --threads 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

VARIANTS = {
    "for-loop (foreach=False; torch's default for CPU tensors)": dict(foreach=False),
    "foreach (foreach=True)": dict(foreach=True),
    "fused": dict(fused=True),
}


def time_variant(numel: int, kwargs: dict, repeats: int) -> float:
    param = torch.randn(numel)
    param.grad = torch.randn(numel)
    optimizer = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.1, **kwargs)
    for _ in range(2):
        optimizer.step()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=float, default=16e6)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    numel = int(args.numel)
    rows = []
    print(f"AdamW step on one flat fp32 tensor of {numel / 1e6:.0f}M elements (torch {torch.__version__})")
    print(f"{'threads':>7}  {'implementation':<26} {'median s':>9} {'Melem/s':>9} {'GB/s':>7}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, kwargs in VARIANTS.items():
            seconds = time_variant(numel, kwargs, args.repeats)
            rate = numel / seconds
            rows.append(
                dict(
                    threads=threads,
                    implementation=name,
                    seconds=seconds,
                    elements_per_s=rate,
                    gb_per_s=rate * 7 * 4 / 1e9,
                )
            )
            print(f"{threads:>7}  {name:<26} {seconds:>9.4f} {rate / 1e6:>9.1f} {rate * 28 / 1e9:>7.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
