"""Parent side of every multi-rank command: spawn the ranks with torchrun, follow their progress, read
their result. zeroshard brings no launcher of its own (DESIGN.md): this is
`python -m torch.distributed.run --standalone --nproc_per_node N -m <worker> RUN_DIR`, and the protocol
of RUN_DIR (spec.json, progress.jsonl, result.json, error.rank<r>.txt) is described in `rank.py`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zeroshard.version
from zeroshard.tools.commands import CommandError

log = logging.getLogger(__name__)

_POLL_S = 0.1
_LOG_TAIL = 3000  # characters of the ranks' output quoted in an error


def child_env(threads_per_rank: int | None, fixed_mmap_threshold: bool = True) -> dict:
    """The ranks' environment. `fixed_mmap_threshold`: glibc's mmap threshold fixed at 64 KiB from the
    start, for runs that measure memory only ([Note: measuring peak memory] in bench/measure.py);
    without, the ranks start with glibc's defaults (what the user's environment says)."""
    env = dict(os.environ)
    if fixed_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    if threads_per_rank:
        env["OMP_NUM_THREADS"] = str(threads_per_rank)
    source_root = str(Path(zeroshard.version.__file__).resolve().parent.parent)  # works uninstalled, from src/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH")) if p)
    return env


def default_threads(ranks: int) -> int:
    return max(1, (os.cpu_count() or 1) // ranks)


def torchrun_command(module: str, ranks: int, run_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "-m",
        module,
        str(run_dir),
    ]


@dataclass
class Outcome:
    """How a launch ended: rank 0's result, or what the ranks left behind when there is none."""

    result: dict | None
    returncode: int | None
    errors: dict[str, str] = field(default_factory=dict)  # "rank r" -> traceback written by that rank
    log_tail: str = ""  # the end of every rank's combined output
    log: str = ""  # all of it
    run_dir: Path | None = None  # kept when there is no result, for the user to read

    def signals(self) -> list[str]:
        """Ranks that torchrun saw die by a signal, e.g. ['SIGSEGV']."""
        return re.findall(r"exitcode\s*:\s*-\d+ \(pid: \d+\)\s*\((SIG[A-Z]+)\)", self.log)


def run_ranks(
    module: str,
    spec: dict,
    ranks: int,
    on_progress: Callable[[dict], None] = lambda event: None,
    timeout_s: float = 3600.0,
    threads_per_rank: int | None = None,
    keep_failed: bool = True,
    fixed_mmap_threshold: bool = True,
) -> Outcome:
    """Run `module` on `ranks` local ranks with `spec` and say how it ended (raises CommandError only
    for a bad rank count or a timeout). `keep_failed=False` removes the run directory of a failed run too,
    for callers that expect failures and keep what they need from the Outcome. `fixed_mmap_threshold`:
    see `child_env`."""
    if ranks < 1:
        raise CommandError(f"--ranks must be >= 1, got {ranks}")
    run_dir = Path(tempfile.mkdtemp(prefix="zeroshard-run-"))
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=2))
    command = torchrun_command(module, ranks, run_dir)
    log.debug("launching: %s", " ".join(command))
    with open(run_dir / "ranks.log", "wb") as output:
        process = subprocess.Popen(
            command,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=child_env(threads_per_rank or default_threads(ranks), fixed_mmap_threshold),
        )
        try:
            _follow(process, run_dir / "progress.jsonl", on_progress, timeout_s)
        except BaseException:
            _stop(process)
            raise
    result_path = run_dir / "result.json"
    if result_path.is_file():
        if process.returncode:  # see rank.py: a teardown abort after the result was written
            log.debug("torchrun exited with %s after writing the result", process.returncode)
        outcome = Outcome(json.loads(result_path.read_text()), process.returncode)
        shutil.rmtree(run_dir, ignore_errors=True)
        return outcome
    errors = {
        path.stem.split(".")[-1].replace("rank", "rank "): path.read_text()
        for path in sorted(run_dir.glob("error.rank*.txt"))
    }
    text = (run_dir / "ranks.log").read_text(errors="replace")
    outcome = Outcome(None, process.returncode, errors, text[-_LOG_TAIL:], text, run_dir if keep_failed else None)
    if not keep_failed:
        shutil.rmtree(run_dir, ignore_errors=True)
    return outcome


def launch(
    module: str,
    spec: dict,
    ranks: int,
    on_progress: Callable[[dict], None] = lambda event: None,
    timeout_s: float = 3600.0,
    threads_per_rank: int | None = None,
    fixed_mmap_threshold: bool = True,
) -> dict:
    """Run `module` on `ranks` local ranks with `spec`; returns rank 0's result (raises CommandError)."""
    outcome = run_ranks(
        module, spec, ranks, on_progress, timeout_s, threads_per_rank, fixed_mmap_threshold=fixed_mmap_threshold
    )
    if outcome.result is None:
        raise CommandError(failure_message(outcome))
    return outcome.result


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
    """Stop torchrun and its ranks: they share the process group (setsid) started for them."""
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


def failure_message(outcome: Outcome) -> str:
    where = f" ({outcome.run_dir})" if outcome.run_dir else ""
    if outcome.errors:
        rank, text = next(iter(outcome.errors.items()))
        lines = text.strip().splitlines()
        return (
            f"{rank} failed: {lines[-1] if lines else '?'}\n(traceback and the output of every rank in "
            f"the run directory{where})"
        )
    return (
        f"torchrun exited with code {outcome.returncode} before any rank reported a result:\n"
        f"{outcome.log_tail}\n(full logs in the run directory{where})"
    )
