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
and leaves with os._exit(0) when it is done, without destroying its process group.

Rank groups are kept: the ranks of a run_distributed call stay alive, their process group
initialised, and take the next call with the same world size and `env` (starting 2 ranks costs ~1.5 s
of the 2 cores, 4 ranks ~3 s, and the suite makes hundreds of calls). Between calls a rank puts back
what a worker may have changed in the process (environment, cwd, sys.path, default dtype, grad mode,
threads, RNG states, warnings filters); a worker that leaves the default process group changed, or a
call in which any rank failed, retires the group, and the next call starts a fresh one. `fresh=True`
(and run_distributed_expect_failure, whose ranks are meant to die or hang) start ranks for the call
alone; ZS_TEST_FRESH_RANKS=1 makes every call do so, to rule out a leak between workers.

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
import functools
import gc
import itertools
import os
import pickle
import random
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from multiprocessing import connection, forkserver, get_context, popen_forkserver
from multiprocessing.context import ForkServerProcess
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
# What torch 2.13 + gloo may print when it aborts a process at interpreter teardown, after all work is
# done (module docstring): a test that runs a script in a process of its own accepts that exit.
TEARDOWN_ABORT = "terminate called without an active exception"


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
    retire: str = ""  # why this rank's process cannot take another call ("" when it can)

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


def run_distributed(
    fn, world_size: int, *, timeout: float = 120.0, env: dict | None = None, fresh: bool = False, **kwargs
) -> list:
    """Run fn(rank, world_size, **kwargs) on `world_size` gloo ranks; return the values in rank order.

    `timeout` counts from when every rank has initialised its process group (starting has its own
    allowance, _STARTUP_TIMEOUT_S); `env` is added to each rank's environment at process start.
    `fresh`: ranks started for this call alone (a worker that measures the process's own memory from
    its start, or changes what cannot be put back). Raises AssertionError quoting every failing
    rank's traceback, and which ranks did not report."""
    reports = _run(fn, world_size, timeout, env, kwargs, fail_fast=True, fresh=fresh)
    if failed := [r for r in reports if not r.ok]:
        details = "\n\n".join(r.describe() for r in failed)
        raise AssertionError(f"ranks {[r.rank for r in failed]} of {world_size} failed:\n\n{details}")
    return [r.value for r in reports]


def run_distributed_expect_failure(
    fn, world_size: int, timeout: float = 60.0, *, env: dict | None = None, **kwargs
) -> list[RankReport]:
    """Every rank's RankReport, never raising for a rank's failure. Waits for every rank (up to
    `timeout`), so a test that expects failures can assert that *all* ranks detected the problem.
    Always on ranks of its own: they are expected to die or hang."""
    return _run(fn, world_size, timeout, env, kwargs, fail_fast=False, fresh=True)


def run_script(script, *args, world_size: int = 2, cwd, timeout: float = 300.0, env: dict | None = None) -> list[str]:
    """Run `python script args...` on `world_size` ranks as torchrun would start it, in kept ranks:
    `__main__` is the script, sys.argv[0] its path, its directory first on sys.path, RANK /
    LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, the default process group already
    initialised (zeroshard.init_distributed and deepspeed.init_distributed keep it). Returns each
    rank's stdout; a script that fails raises AssertionError with its traceback and its output so far.
    A launch under torchrun itself costs its agent's start, the rendezvous and fresh ranks (~5 s of
    the 2 cores here); tests/test_example.py keeps one such launch."""
    return run_distributed(
        _script_worker,
        world_size,
        timeout=timeout,
        env=env,
        script=str(script),
        argv=[str(a) for a in args],
        cwd=str(cwd),
    )


def write_titled_blocks(page: Path, directory: Path) -> None:
    """Write the fenced blocks of a guide page that carry a title (```python title="x.py") into
    `directory` as files of that name: the page's scripts, as a reader copies them."""
    import re

    for name, body in re.findall(r'```\w+ title="([^"]+)"\n(.*?)```', page.read_text(), re.S):
        (directory / name).write_text(body)


def _script_worker(rank: int, world_size: int, *, script: str, argv: list[str], cwd: str) -> str:
    import io
    import runpy

    saved_argv, output = sys.argv, io.StringIO()
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).resolve().parent))
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(output):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise AssertionError(
                f"{script} exited with {stop.code!r}; its output:\n{output.getvalue()[-3000:]}"
            ) from None
    except BaseException as error:
        raise AssertionError(f"{script} raised {error!r}; its output:\n{output.getvalue()[-3000:]}") from error
    finally:
        sys.argv = saved_argv  # sys.path and cwd: put back by the harness
    return output.getvalue()


def run_at_once(calls: dict, max_groups: int = 4) -> dict:
    """Run independent calls that start ranks of their own (run_distributed_expect_failure, or
    run_distributed with fresh=True) side by side, at most `max_groups` at a time: {key: what
    calls[key]() returned, or the exception it raised}. For failure cases that mostly wait on a
    timeout; the kept groups are not used from threads."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max_workers=max_groups) as pool:
        futures = {key: pool.submit(call) for key, call in calls.items()}
        return {key: future.exception() or future.result() for key, future in futures.items()}


def outcome(outcomes: dict, key):
    """What run_at_once's call `key` returned; raises what it raised, in the test that asks."""
    if isinstance(outcomes[key], BaseException):
        raise outcomes[key]
    return outcomes[key]


def kept_rank_pids() -> list[int]:
    """Process ids of the ranks kept alive for later calls."""
    return [p.pid for group in _KEPT.values() for p in group.procs if p.is_alive()]


def close_kept_groups() -> None:
    """Stop every kept group of ranks (they save their coverage data and exit)."""
    while _KEPT:
        _KEPT.popitem()[1].close()


def _run(fn, world_size, timeout, env, kwargs, *, fail_fast, fresh) -> list[RankReport]:
    try:
        payload = pickle.dumps((fn, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"{fn!r} and its kwargs must be picklable: define the worker at module level "
            f"of an importable module (e.g. tests.test_x) and pass picklable kwargs ({e})"
        ) from e
    if fresh or os.environ.get("ZS_TEST_FRESH_RANKS") == "1":
        group, reports = _RankGroup(world_size, env, timeout, one_call=True), None
        try:
            reports = group.run(payload, timeout, fail_fast)
            return reports
        finally:
            group.close(reports)
    key = (world_size, tuple(sorted((k, str(v)) for k, v in (env or {}).items())))
    group = _KEPT.pop(key, None) or _RankGroup(world_size, env, timeout)
    reports = group.run(payload, timeout, fail_fast)
    if all(r.ok and not r.retire for r in reports):
        _KEPT[key] = group  # most recently used last
        while len(_KEPT) > _MAX_KEPT_GROUPS:
            _KEPT.pop(next(iter(_KEPT))).close()
    else:
        group.close(reports)
    return reports


_START_LOCK = threading.Lock()
_MAX_KEPT_GROUPS = 3  # each rank holds ~300 MB; three groups of at most 4 ranks fit beside the suite
_KEPT: dict = {}  # (world_size, env items) -> _RankGroup, least recently used first


class _RankGroup:
    """`world_size` spawned ranks with their gloo process group, taking calls until closed."""

    def __init__(self, world_size: int, env: dict | None, pg_timeout: float, one_call: bool = False) -> None:
        # The parent hosts the rendezvous store: binding port 0 cannot race another test for a "free" port.
        self.store = dist.TCPStore(
            "127.0.0.1",
            0,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=_STARTUP_TIMEOUT_S),
        )
        self.tmp = tempfile.TemporaryDirectory(prefix="zeroshard-ranks-")
        self.stack_files = [os.path.join(self.tmp.name, f"rank{rank}.stacks") for rank in range(world_size)]
        (ctx, process), self.procs, self.conns = _context(env), [], []
        try:
            with _START_LOCK:  # os.environ is set around each start (run_at_once calls from threads)
                self._start(ctx, process, world_size, env, pg_timeout, one_call)
        except BaseException:
            self.close()
            raise

    def _start(self, ctx, process, world_size: int, env: dict | None, pg_timeout: float, one_call: bool) -> None:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            with _rank_environ(rank, world_size, self.store.port, env):
                environ = dict(os.environ)
                args = (rank, world_size, self.store.port, pg_timeout, self.stack_files[rank], child_end, one_call)
                self.procs.append(process(target=_child_main, args=(*args, environ), name=f"zeroshard-rank{rank}"))
                self.procs[-1].start()
            self.conns.append(parent_end)
            child_end.close()  # so the parent sees EOF when the child dies

    def run(self, payload: bytes, timeout: float, fail_fast: bool) -> list[RankReport]:
        message = pickle.dumps(("run", (payload, timeout)), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a rank that died: _collect reports it
                conn.send_bytes(message)
        reports = _collect(self.procs, self.conns, timeout, fail_fast)
        _dump_stacks(self.procs, reports, self.stack_files)
        return reports

    def close(self, reports: list[RankReport] | None = None) -> None:
        """Ask every rank to leave (saving its coverage data), then kill what is left. After a call in
        which a rank failed, the others may be stuck in a collective: only a moment is given."""
        quit_message = pickle.dumps(("quit", None))
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(quit_message)
        failed = reports is not None and not all(r.ok for r in reports)
        deadline = time.time() + (_QUIT_AFTER_FAILURE_S if failed else _QUIT_WAIT_S)
        for proc, report in zip(self.procs, reports or [None] * len(self.procs)):
            if report is None or report.reported:  # the others never read the quit message
                proc.join(timeout=max(0.0, deadline - time.time()))
        _kill_trees(self.procs)
        for conn in self.conns:
            conn.close()
        self.tmp.cleanup()


# [Note: ranks forked from a server that has imported torch]
# A spawned rank imports torch and zeroshard anew: ~2.7 s of a core each, and the suite starts about a
# hundred ranks (failure cases retire theirs on purpose). multiprocessing's forkserver imports them
# once, in a server process that runs nothing else (no threads, no OpenMP pool, no process group), and
# forks each rank from it. What a process reads only at its start (glibc's MALLOC_*, the OpenMP
# runtime's OMP_* / KMP_* / GOMP_*) would then be the server's, so a group whose `env` sets such a
# variable is spawned, except for the two the memory tests set: MALLOC_MMAP_THRESHOLD_, which a
# forked rank sets itself with glibc's mallopt (the same setting, dynamic threshold off included),
# and OMP_NUM_THREADS=1, every rank's value. The rest of the environment is the rank's own, set first
# thing in the child (_child_main). ZS_TEST_SPAWN_RANKS=1 spawns every rank.
# The server also imports what nearly every worker would import on its first call: torch._dynamo,
# which the first torch.optim.Optimizer() of a process imports (~1 s of a core, sympy included), and
# the test helpers workers live in. transformers is left out of it: few workers use it, and every
# forked rank's memory would count its pages (the groups that use it have a server of their own, note
# below).
# Each rank freezes what it starts with (gc.freeze(): the imports), so that a collection in it,
# automatic or a test's gc.collect(), walks only what its calls created, and a forked rank does not
# copy the server's pages by writing their objects' collector headers.
_READ_AT_START = ("MALLOC_", "OMP_", "KMP_", "GOMP_")
_MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"  # a forked rank sets it with mallopt (_set_mmap_threshold)
_FORKABLE = {("OMP_NUM_THREADS", "1")}  # what every rank has
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "psutil",
    "pytest",
    "zeroshard",
    "zeroshard.compat.engine",
    "tests.harness",
    "tests.reference",
    "tests.zs_common",
    "tests.hard_models",
    "tests.checkpoint_helpers",
]


def _context(env: dict | None):
    """(multiprocessing context, Process class) for a group's ranks; see the note above."""
    set_at_start = [
        k
        for k, v in (env or {}).items()
        if k.startswith(_READ_AT_START) and k != _MMAP_THRESHOLD and (k, str(v)) not in _FORKABLE
    ]
    if os.environ.get("ZS_TEST_SPAWN_RANKS") == "1" or set_at_start:
        ctx = get_context("spawn")
        return ctx, ctx.Process
    ctx = get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    # Started here, in the suite's own environment: started by a group's first rank, the server would
    # read that group's MALLOC_* at its start and hand it to every rank forked after.
    forkserver.ensure_running()
    if not (extra := tuple(m for m in (env or {}).get(PRELOAD_VAR, "").split(",") if m)):
        return ctx, ctx.Process
    if extra not in _SERVERS:
        _SERVERS[extra] = forkserver.ForkServer()
        _SERVERS[extra].set_forkserver_preload([*_PRELOAD, *extra])
        _SERVERS[extra].ensure_running()
    return ctx, functools.partial(_PreloadedProcess, extra)


# [Note: a fork server per preload list]
# The libraries that only some groups use (transformers, peft and the bitsandbytes it imports; their
# cost per rank: docs/bench/test_suite.txt) are imported by a fork server of their own, one per list
# named in a group's PRELOAD_VAR, so that the other ranks neither pay for them nor hold their pages.
# multiprocessing keeps
# one fork server per process (multiprocessing.forkserver._forkserver); a second one is a
# forkserver.ForkServer of its own, and _PreloadedPopen hands its connection to the standard launch
# while a rank starts (under _START_LOCK, so no other start sees it). A forked child reaches its server
# through the module's global, which the server sets in every child it forks.
PRELOAD_VAR = "ZS_TEST_PRELOAD"  # in a group's env: comma-separated modules its ranks are forked with
_SERVERS: dict = {}  # preload list beyond _PRELOAD -> its running forkserver.ForkServer


class _PreloadedPopen(popen_forkserver.Popen):
    def _launch(self, process_obj):
        standard = forkserver.connect_to_new_process
        forkserver.connect_to_new_process = _SERVERS[process_obj.preload].connect_to_new_process
        try:
            super()._launch(process_obj)
        finally:
            forkserver.connect_to_new_process = standard


class _PreloadedProcess(ForkServerProcess):
    """A rank forked from the server that imported `preload` too."""

    def __init__(self, preload: tuple, **kwargs) -> None:
        super().__init__(**kwargs)
        self.preload = preload

    @staticmethod
    def _Popen(process_obj):
        return _PreloadedPopen(process_obj)


_QUIT_WAIT_S = 10.0  # for ranks asked to leave, before they are killed
_QUIT_AFTER_FAILURE_S = 1.0  # enough to write coverage data


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
    if kind == "retire":
        report.retire = body
        return False
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


def _set_mmap_threshold(value: str | None) -> None:
    """MALLOC_MMAP_THRESHOLD_ as glibc would have read it at the start of a spawned process (a no-op
    there): a forked rank's allocator was set up by the fork server."""
    if value is None:
        return
    import ctypes

    if ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, int(value)) != 1:
        raise OSError(f"mallopt(M_MMAP_THRESHOLD, {value}) failed")


def _child_main(rank, world_size, port, pg_timeout, stack_file, conn, one_call, environ) -> None:
    global _channel
    os.environ.clear()  # a forked rank starts with the fork server's (note above)
    os.environ.update(environ)
    _set_mmap_threshold(environ.get(_MMAP_THRESHOLD))
    gc.freeze()  # the imports, out of every collection (note above)
    _channel = conn
    stacks = _arm_guards(stack_file)
    sys.path.insert(0, _REPO_ROOT)  # harmless when already there
    torch.set_num_threads(1)  # ranks share few cores; oversubscription makes CPU tests crawl
    start_error = None
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=False, timeout=datetime.timedelta(seconds=_STARTUP_TIMEOUT_S)
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout)
        )
    except BaseException as e:  # noqa: BLE001 - reported to the first call
        start_error = ("error", (type(e).__name__, str(e), traceback.format_exc()))
    world = dist.group.WORLD if start_error is None else None
    process_state = _ProcessState()
    while True:
        try:
            kind, body = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the parent is gone
        if kind == "quit":
            break
        payload, timeout = body
        stacks.seek(0)
        stacks.truncate()
        _job_deadline[0] = time.time() + _STARTUP_TIMEOUT_S + timeout + _BACKSTOP_S
        message = start_error or _run_job(rank, world_size, payload, conn)
        _job_deadline[0] = None
        if reason := process_state.restore(world):
            conn.send_bytes(pickle.dumps(("retire", reason)))
        try:
            data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001
            data = pickle.dumps(("error", (type(e).__name__, f"return value is not picklable: {e}", "")))
        conn.send_bytes(data)
        if one_call or message[0] == "error":  # leave at once, as a process of its own would: peers
            break  # in a collective with it see the connection close (the group is retired anyway)
    sys.stdout.flush()
    sys.stderr.flush()
    _save_coverage()
    # No destroy_process_group: after a failed call it can wait on a peer that is gone, and os._exit
    # skips the teardown that may abort (module docstring); the kernel closes the sockets.
    os._exit(0)


def _run_job(rank, world_size, payload, conn) -> tuple:
    try:
        conn.send_bytes(pickle.dumps(("started", None)))
        fn, kwargs = pickle.loads(payload)
        return ("ok", fn(rank, world_size, **kwargs))
    except BaseException as e:  # noqa: BLE001 - every failure, KeyboardInterrupt included, is reported
        return ("error", (type(e).__name__, str(e), traceback.format_exc()))


class _ProcessState:
    """What a worker may change in its process and the next worker must not see; taken at start."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.dtype = torch.get_default_dtype()
        self.grad = torch.is_grad_enabled()
        self.threads = torch.get_num_threads()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.torch_rng = torch.get_rng_state()
        self.python_rng = random.getstate()
        self.filters = list(warnings.filters)

    def restore(self, world) -> str:
        """Put it back; the reason this process cannot be reused, or ""."""
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(self.grad)
        torch.set_num_threads(self.threads)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        warnings.filters[:] = self.filters
        warnings._filters_mutated()  # type: ignore[attr-defined]  # forget "once" registries keyed to old filters
        if world is None or not dist.is_initialized() or dist.group.WORLD is not world:
            return "the worker destroyed or replaced the default process group"
        return ""


def _save_coverage() -> None:
    """Under `coverage run` (concurrency "multiprocessing" starts it in each rank), write this rank's
    data: os._exit skips the atexit hook that would."""
    coverage = sys.modules.get("coverage")
    current = coverage.Coverage.current() if coverage is not None else None
    if current is not None:
        current.stop()
        current.save()


_job_deadline: list = [None]  # when the running call's rank gives up on its parent (None: idle)


def _arm_guards(stack_file: str):
    """Dump stacks on the parent's request (SIGUSR1); exit if the parent dies or a call runs far past
    its deadline (the parent is stuck). Returns the stack file, emptied before each call."""
    stacks = open(stack_file, "w")  # kept open for faulthandler for the process lifetime
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent and (_job_deadline[0] is None or time.time() < _job_deadline[0]):
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch_parent, name="parent-watchdog", daemon=True).start()
    return stacks


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
