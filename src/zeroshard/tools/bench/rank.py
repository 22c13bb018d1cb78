"""What every torchrun worker of `bench`, `train` and `advise` does around its own work.

The parent (`launch.py`) hands a run directory holding `spec.json`; rank 0 appends one JSON object per
line to `progress.jsonl` while it works and writes `result.json` at the end (atomically: temporary file,
then rename); a rank that fails writes `error.rank<r>.txt` with its traceback.

Why `os._exit`: with torch 2.13 and gloo a process can abort in C++ static destructors after all its
work is done ("terminate called without an active exception", see tests/harness.py). The result is
written before teardown and the process leaves without running those destructors, so the parent judges
a run by its files, not by an exit code that teardown may have spoiled.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from zeroshard.compat.api import init_distributed

log = logging.getLogger(__name__)


class RankContext:
    """This rank's place in the group, its device, and the files it shares with the parent."""

    def __init__(self, run_dir: Path):
        init_distributed()
        self.run_dir = run_dir
        self.spec = json.loads((run_dir / "spec.json").read_text())
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        )
        self._progress = open(run_dir / "progress.jsonl", "a") if self.rank == 0 else None

    def progress(self, **fields) -> None:
        """One line for the parent's progress bar (rank 0 only; the others return at once)."""
        if self._progress is not None:
            self._progress.write(json.dumps({"time": time.time(), **fields}) + "\n")
            self._progress.flush()

    def close(self) -> None:
        """Close the progress file, for a process that goes on after this work (a test's kept rank)."""
        if self._progress is not None:
            self._progress.close()
            self._progress = None

    def write_result(self, result: dict) -> None:
        if self.rank != 0:
            return
        tmp = self.run_dir / "result.json.tmp"
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(self.run_dir / "result.json")


def run_rank(work: Callable[[RankContext], dict]) -> None:
    """Entry point of a worker module: `python -m zeroshard.tools.bench.worker RUN_DIR` under torchrun."""
    logging.basicConfig(
        level=logging.WARNING, format=f"rank {os.environ.get('RANK', '?')} %(levelname)s %(name)s: %(message)s"
    )
    if len(sys.argv) != 2:
        sys.stderr.write(f"usage: torchrun ... -m {work.__module__} RUN_DIR\n")
        os._exit(2)
    run_dir = Path(sys.argv[1])
    code = 0
    try:
        ctx = RankContext(run_dir)
        ctx.write_result(work(ctx))
    except BaseException:  # noqa: BLE001 - report anything, KeyboardInterrupt included, then leave
        rank = os.environ.get("RANK", "0")
        (run_dir / f"error.rank{rank}.txt").write_text(traceback.format_exc())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0 and dist.is_initialized():
        dist.destroy_process_group()
    os._exit(code)
