"""Multi-process test harness: spawn a group of gloo ranks once, run many sub-cases inside it.

A worker is a module-level function of an importable test module (spawn pickles it by name):

    def _worker(rank, world_size, *, steps):            # in tests/test_x.py
        return subtests(grid(stage=[0, 1, 2, 3], accum=[1, 2]), lambda stage, accum: ...)

    def test_x():
        per_rank = run_distributed(_worker, 2, steps=3)  # return values (tensors by value), rank order

`tests/` is a package, so pytest names modules `tests.test_*` and puts the repository root on sys.path;
spawn copies sys.path into each child, which prepends the root again before unpickling `fn`.

Reports, not exit codes: torch 2.13 + gloo may abort a process at interpreter teardown ("terminate
called without an active exception") after all work is done. So a rank sends its report through a Pipe
first (plain pickle: multiprocessing's reducer would share tensor storage with a process about to exit),
then destroys its process group and leaves with os._exit(0).

Timeouts: `timeout` starts once every rank has initialised its process group (imports on a loaded
machine are slow). At the deadline, unreported ranks dump their Python stacks (faulthandler, SIGUSR1;
quoted in the error), then every rank's process tree is SIGKILLed. A rank also exits if its parent dies.
The process group timeout is `timeout`, so a stuck collective raises instead of waiting 30 min.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import itertools
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing import connection, get_context
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
_STARTUP_TIMEOUT_S = 120.0  # spawn + imports + rendezvous: slow on a loaded 2-core machine
_FAILURE_GRACE_S = 5.0  # after one rank fails, how long run_distributed waits for the others' reports
_STACK_DUMP_WAIT_S = 1.0  # how long the parent waits for a hung rank to dump its stacks (SIGUSR1)
_BACKSTOP_S = 10.0  # a rank whose parent is stuck exits on its own this long after the parent's deadline
_REPORT_TAIL_CHARS = 4000  # of each rank's stack dump, quoted in an error


@dataclasses.dataclass
class RankReport:
    """What one rank did: returned `value`, raised (`exc_type`, `message`, `traceback`), or neither."""

    rank: int
    pid: int | None
    ok: bool = False
    value: object = None
    exc_type: str | None = None
    message: str = ""
    traceback: str = ""
    started: bool = False  # the process group was initialised
    reported: bool = False  # False: timed out or died before reporting; `message` says which
    notes: list[str] = dataclasses.field(default_factory=list)  # sent early, e.g. by subtests()

    def describe(self) -> str:
        head = (
            f"returned {self.value!r:.200}"
            if self.ok
            else self.message
            if not self.exc_type
            else f"raised {self.exc_type}"
            if self.traceback
            else f"{self.exc_type}: {self.message}"
        )
        notes = [] if self.reported else self.notes  # a final report repeats what its notes said
        return "\n".join(p for p in [f"rank {self.rank}: {head}", *notes, self.traceback] if p).rstrip()


def run_distributed(fn, world_size: int, *, timeout: float = 120.0, env: dict | None = None, **kwargs) -> list:
    """Run fn(rank, world_size, **kwargs) on `world_size` gloo ranks; return the values in rank order.

    `timeout` counts from when every rank has initialised its process group (starting has its own
    allowance, _STARTUP_TIMEOUT_S); `env` is added to each rank's environment at process start.
    Raises AssertionError quoting every failing rank's traceback, and which ranks did not report."""
    reports = _run(fn, world_size, timeout, env, kwargs, fail_fast=True)
    if failed := [r for r in reports if not r.ok]:
        details = "\n\n".join(r.describe() for r in failed)
        raise AssertionError(f"ranks {[r.rank for r in failed]} of {world_size} failed:\n\n{details}")
    return [r.value for r in reports]


def run_distributed_expect_failure(
    fn, world_size: int, timeout: float = 60.0, *, env: dict | None = None, **kwargs
) -> list[RankReport]:
    """Every rank's RankReport, never raising for a rank's failure. Waits for every rank (up to
    `timeout`), so a test that expects failures can assert that *all* ranks detected the problem."""
    return _run(fn, world_size, timeout, env, kwargs, fail_fast=False)


def _run(fn, world_size, timeout, env, kwargs, *, fail_fast) -> list[RankReport]:
    try:
        payload = pickle.dumps((fn, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"{fn!r} and its kwargs must be picklable: define the worker at module level "
            f"of an importable module (e.g. tests.test_x) and pass picklable kwargs ({e})"
        ) from e
    # The parent hosts the rendezvous store: binding port 0 cannot race another test for a "free" port.
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=_STARTUP_TIMEOUT_S),
    )
    ctx, procs, conns = get_context("spawn"), [], []
    with tempfile.TemporaryDirectory(prefix="zeroshard-ranks-") as tmp:
        stack_files = [os.path.join(tmp, f"rank{rank}.stacks") for rank in range(world_size)]
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=False)
                args = (rank, world_size, store.port, timeout, stack_files[rank], payload, child_end)
                procs.append(ctx.Process(target=_child_main, args=args, name=f"zeroshard-rank{rank}"))
                conns.append(parent_end)
                with _rank_environ(rank, world_size, store.port, env):
                    procs[-1].start()
                child_end.close()  # so the parent sees EOF when the child dies
            reports = _collect(procs, conns, timeout, fail_fast)
            _dump_stacks(procs, reports, stack_files)
        finally:
            _kill_trees(procs)
            for c in conns:
                c.close()
    return reports


@contextlib.contextmanager
def _rank_environ(rank, world_size, port, extra):
    """One rank's environment, set around its start so that what is read then (MALLOC_*, OMP_*) counts."""
    saved = dict(os.environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    os.environ.update({k: str(v) for k, v in (extra or {}).items()})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _collect(procs, conns, timeout, fail_fast) -> list[RankReport]:
    """Read reports until all ranks are done; deadline: _STARTUP_TIMEOUT_S until all started, then `timeout`."""
    reports = [RankReport(rank=r, pid=p.pid) for r, p in enumerate(procs)]
    open_conns = dict(zip(conns, reports))
    deadline, running = time.time() + _STARTUP_TIMEOUT_S, False
    why = f"did not start (spawn, imports, rendezvous) within {_STARTUP_TIMEOUT_S:.0f} s"
    while open_conns and time.time() < deadline:
        for conn in connection.wait(list(open_conns), timeout=min(0.5, max(0.0, deadline - time.time()))):
            if _receive(conn, open_conns[conn], procs):
                del open_conns[conn]
        if not running and all(r.started or r not in open_conns.values() for r in reports):
            deadline, running = time.time() + timeout, True
            why = f"did not report within the {timeout:g} s timeout"
        failed = [r.rank for r in reports if r.reported and not r.ok]
        if fail_fast and failed and time.time() + _FAILURE_GRACE_S < deadline:
            deadline = time.time() + _FAILURE_GRACE_S  # the others are likely stuck in a collective
            why = f"did not report within {_FAILURE_GRACE_S:g} s after rank {failed[0]} failed"
    for report in open_conns.values():
        report.message = f"{why} (pid {report.pid}); killed"
    return reports


def _receive(conn, report: RankReport, procs) -> bool:
    """Read one message into `report`; True when this rank is done (final report or pipe closed)."""
    try:
        kind, body = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        procs[report.rank].join(timeout=1.0)
        report.message = f"exited with code {procs[report.rank].exitcode} before reporting (see its stderr)"
        return True
    if kind in ("started", "note"):
        report.started = True
        report.notes += [body] if kind == "note" else []
        return False
    report.reported = True
    if kind == "ok":
        report.ok, report.value = True, body
    else:
        report.exc_type, report.message, report.traceback = body
    return True


def _dump_stacks(procs, reports, stack_files) -> None:
    """Have every started rank that has not reported write its Python stacks; quote them."""
    hung = [r for r in reports if r.started and not r.reported and procs[r.rank].is_alive()]
    for r in hung:
        with contextlib.suppress(ProcessLookupError):
            os.kill(r.pid, signal.SIGUSR1)  # faulthandler, registered by _arm_guards
    time.sleep(_STACK_DUMP_WAIT_S if hung else 0)
    for r in hung:
        dump = Path(stack_files[r.rank]).read_text(errors="replace").strip()
        r.traceback = f"its Python stacks when killed:\n{dump[-_REPORT_TAIL_CHARS:]}"


def _kill_trees(procs) -> None:
    """SIGKILL every rank and everything it started (DataLoader workers, ...); reap them."""
    victims = []
    for proc in (p for p in procs if p.pid is not None and p.is_alive()):
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(proc.pid)
            victims += [*root.children(recursive=True), root]
    for v in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            v.kill()
    psutil.wait_procs(victims, timeout=5.0)
    for proc in (p for p in procs if p.pid is not None):  # None: never started
        proc.join(timeout=5.0)


# ---------------------------------------------------------------- child side

_channel = None  # this rank's Pipe end to the parent; only ever set inside a spawned rank


def send_note(text: str) -> None:
    """From inside a rank: tell the parent something now (kept even if the rank later hangs)."""
    if _channel is not None:
        _channel.send_bytes(pickle.dumps(("note", text)))


def _child_main(rank, world_size, port, timeout, stack_file, payload, conn) -> None:
    global _channel
    _channel = conn
    _arm_guards(_STARTUP_TIMEOUT_S + timeout + _BACKSTOP_S, stack_file)
    sys.path.insert(0, _REPO_ROOT)  # harmless when already there
    torch.set_num_threads(1)  # ranks share few cores; oversubscription makes CPU tests crawl
    try:
        fn, kwargs = pickle.loads(payload)
        store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=False, timeout=datetime.timedelta(seconds=_STARTUP_TIMEOUT_S)
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
        )
        conn.send_bytes(pickle.dumps(("started", None)))
        message = ("ok", fn(rank, world_size, **kwargs))
    except BaseException as e:  # noqa: BLE001 - every failure, KeyboardInterrupt included, is reported
        message = ("error", (type(e).__name__, str(e), traceback.format_exc()))
    try:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001
        data = pickle.dumps(("error", (type(e).__name__, f"return value is not picklable: {e}", "")))
    conn.send_bytes(data)
    with contextlib.suppress(Exception):  # raises when init failed: then there is nothing to destroy
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    _save_coverage()
    os._exit(0)  # see the module docstring: the report is sent, skip the teardown that may abort


def _save_coverage() -> None:
    """Under `coverage run` (concurrency "multiprocessing" starts it in each rank), write this rank's
    data: os._exit skips the atexit hook that would."""
    coverage = sys.modules.get("coverage")
    current = coverage.Coverage.current() if coverage is not None else None
    if current is not None:
        current.stop()
        current.save()


def _arm_guards(backstop_s: float, stack_file: str) -> None:
    """Dump stacks on the parent's request (SIGUSR1); exit if the parent dies or is stuck too long."""
    stacks = open(stack_file, "w")  # kept open for faulthandler for the process lifetime
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    parent, backstop = os.getppid(), time.time() + backstop_s

    def watch_parent() -> None:
        while os.getppid() == parent and time.time() < backstop:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch_parent, name="parent-watchdog", daemon=True).start()


# ---------------------------------------------------------------- sub-cases inside one rank group


def grid(**axes) -> list[dict]:
    """Every combination: grid(stage=[0, 1], accum=[1, 2]) -> 4 case dicts."""
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def subtests(cases: list[dict], fn) -> list:
    """Run fn(**case) for every case in this rank (like FSDP's run_subtests); results in case order.

    After each case the ranks agree (all_reduce of flags) on who failed it, so all record the same
    failures and stay in step. A rank failing between collectives can still desynchronise later cases
    (they then hang to the timeout), so each failure also goes to the parent at once as a note.
    Raises AssertionError naming every failing case's parameters, with this rank's tracebacks."""
    results, failures = [], []
    for case in cases:
        error = None
        try:
            results.append(fn(**case))
        except Exception:  # noqa: BLE001 - collected and re-raised below with the case attached
            results.append(None)
            error = traceback.format_exc()
            send_note(f"sub-case {case} failed:\n{error}")
        if failed_ranks := _ranks_that_failed(error is not None):
            failures.append(f"sub-case {case} failed on ranks {failed_ranks}:\n{error or '(passed on this rank)'}")
    if failures:
        raise AssertionError(f"{len(failures)} of {len(cases)} sub-cases failed:\n\n" + "\n".join(failures))
    return results


def _ranks_that_failed(failed_here: bool) -> list[int]:
    if not dist.is_initialized():
        return [0] if failed_here else []
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32)  # 1-D, one flag per rank
    flags[dist.get_rank()] = int(failed_here)
    dist.all_reduce(flags)
    return flags.nonzero().flatten().tolist()
