"""What importing zeroshard costs a process, after torch: each probe in fresh interpreters.

    python benchmarks/import_time.py --out docs/bench/import_time.txt

Probes (seconds measured around the import with `time.perf_counter`, torch imported first and not
counted; the median and range of `--repeat` fresh interpreters, and the zeroshard modules loaded):
`import zeroshard` (what a user of `zeroshard.shard` pays), the DeepSpeed surface on its first use
(`zeroshard.initialize`, which brings the config layer and pydantic), and two torch modules zeroshard
imports only when a feature needs them (`torch.distributed.tensor`, `torch.distributed.checkpoint`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

PROBES = {
    "import zeroshard": "import zeroshard",
    "zeroshard.initialize, first use (after import zeroshard)": "zeroshard.initialize",
    "import torch.distributed.tensor": "import torch.distributed.tensor",
    "import torch.distributed.checkpoint": "import torch.distributed.checkpoint",
}
# The setup outside the timed region, per probe: torch (and zeroshard, for its first-use probe).
SETUP = {"zeroshard.initialize, first use (after import zeroshard)": "import zeroshard"}

TEMPLATE = """
import sys, time, json
import torch
{setup}
t = time.perf_counter()
{probe}
seconds = time.perf_counter() - t
print(json.dumps({{"seconds": seconds, "modules": sum(m.startswith("zeroshard") for m in sys.modules)}}))
"""


def measure(probe: str, setup: str) -> dict:
    code = TEMPLATE.format(setup=setup, probe=probe)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7, help="fresh interpreters per probe (default 7)")
    parser.add_argument("--out", type=Path, help="also write the record here")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: at least 1")
    import torch

    lines = [
        f"# import time, {datetime.date.today()}",
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}",
        f"python {platform.python_version()}, torch {torch.__version__}",
        f"command: python benchmarks/import_time.py --repeat {args.repeat}"
        + (f" --out {args.out}" if args.out else ""),
        "",
        f"{'probe':58} {'median s':>9} {'min s':>7} {'max s':>7} {'zeroshard modules':>18}",
    ]
    raw = {}
    for name, probe in PROBES.items():
        runs = [measure(probe, SETUP.get(name, "")) for _ in range(args.repeat)]
        seconds = [r["seconds"] for r in runs]
        raw[name] = runs
        lines.append(
            f"{name:58} {statistics.median(seconds):9.3f} {min(seconds):7.3f} {max(seconds):7.3f} {runs[-1]['modules']:18d}"
        )
    lines += ["", "raw (seconds, zeroshard modules loaded after the probe):", json.dumps(raw, indent=1)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
