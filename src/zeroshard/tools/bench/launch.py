"""Parent side of every multi-rank command: spawn the ranks with torchrun, follow their progress, read
their result. zeroshard brings no launcher of its own (DESIGN.md): this is
`python -m torch.distributed.run --standalone --nproc_per_node N -m <worker> RUN_DIR`, and the protocol
of RUN_DIR (spec.json, progress.jsonl, result.json, error.rank<r>.txt) is described in `rank.py`.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import zeroshard.version
from zeroshard.tools.commands import CommandError

log = logging.getLogger(__name__)

_POLL_S = 0.1
_LOG_TAIL = 3000  # characters of the ranks' output quoted in an error


def child_env(threads_per_rank: int | None) -> dict:
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # see [Note: measuring peak memory] in bench/measure.py
    if threads_per_rank:
        env["OMP_NUM_THREADS"] = str(threads_per_rank)
    source_root = str(Path(zeroshard.version.__file__).resolve().parent.parent)  # works uninstalled, from src/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH")) if p)
    return env


def default_threads(ranks: int) -> int:
    return max(1, (os.cpu_count() or 1) // ranks)


def torchrun_command(module: str, ranks: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
            "-m", module, str(run_dir)]


def launch(module: str, spec: dict, ranks: int, on_progress: Callable[[dict], None] = lambda event: None,
           timeout_s: float = 3600.0, threads_per_rank: int | None = None) -> dict:
    """Run `module` on `ranks` local ranks with `spec`; returns rank 0's result (raises CommandError)."""
    if ranks < 1:
        raise CommandError(f"--ranks must be >= 1, got {ranks}")
    run_dir = Path(tempfile.mkdtemp(prefix="zeroshard-run-"))
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=2))
    command = torchrun_command(module, ranks, run_dir)
    log.debug("launching: %s", " ".join(command))
    with open(run_dir / "ranks.log", "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=child_env(threads_per_rank or default_threads(ranks)))
        try:
            _follow(process, run_dir / "progress.jsonl", on_progress, timeout_s)
        except BaseException:
            _stop(process)
            raise
    result_path = run_dir / "result.json"
    if not result_path.is_file():
        raise CommandError(_failure(run_dir, process.returncode))
    result = json.loads(result_path.read_text())
    if process.returncode:  # see rank.py: a teardown abort after the result was written
        log.debug("torchrun exited with %s after writing the result", process.returncode)
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def _follow(process: subprocess.Popen, progress: Path, on_progress, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    offset = 0
    while True:
        finished = process.poll() is not None
        offset = _read_progress(progress, offset, on_progress)
        if finished:
            return
        if time.monotonic() > deadline:
            _stop(process)
            raise CommandError(f"the ranks did not finish within {timeout_s:.0f} s and were stopped")
        time.sleep(_POLL_S)


def _read_progress(path: Path, offset: int, on_progress) -> int:
    if not path.is_file():
        return offset
    with open(path, "rb") as lines:
        lines.seek(offset)
        for line in iter(lines.readline, b""):
            if not line.endswith(b"\n"):  # a line still being written: read it next time
                break
            offset += len(line)
            on_progress(json.loads(line))
    return offset


def _stop(process: subprocess.Popen) -> None:
    """Stop torchrun and its ranks (they share the session started for them)."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def _failure(run_dir: Path, returncode: int | None) -> str:
    errors = sorted(run_dir.glob("error.rank*.txt"))
    if errors:
        lines = errors[0].read_text().strip().splitlines()
        rank = errors[0].stem.split(".")[-1].replace("rank", "rank ")
        return f"{rank} failed: {lines[-1] if lines else '?'}\n(traceback in {errors[0]}; output of every " \
               f"rank in {run_dir / 'ranks.log'})"
    tail = (run_dir / "ranks.log").read_text(errors="replace")[-_LOG_TAIL:]
    return f"torchrun exited with code {returncode} before any rank reported a result:\n{tail}\n" \
           f"(full logs in {run_dir})"
