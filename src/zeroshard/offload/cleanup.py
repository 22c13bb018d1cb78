"""Swap files never outlive their process for long: removal on SIGTERM, reclaim after SIGKILL.

[Note: swap files of dead processes]
Each NVMe store writes under `nvme_path/zeroshard-<pid>-rank<r>-<nonce>/`. `destroy()` and the
atexit hook remove that directory, but neither runs when the process is killed: torchrun stops
the workers of a failed job with SIGTERM, an out-of-memory killer or a scheduler with SIGKILL. So:
  * SIGTERM: while a store is alive, and only if the process had the default SIGTERM disposition
    (the user installed no handler of their own), a handler removes every live store's directory
    and then does what the previous disposition would have done (for the default: restore it and
    re-raise the signal, so the process still dies by SIGTERM with the usual exit status). A user
    handler is left alone: it normally exits through sys.exit, and the atexit hook cleans up.
  * SIGKILL cannot be caught. Instead each directory holds `.lock`, a file on which the owner holds
    an exclusive `fcntl.flock` for its whole life; the kernel drops the lock when the process dies,
    however it dies. A new store first tries to take the lock of every `zeroshard-*` directory
    under its path: one whose lock it can take belongs to a process that no longer exists and is
    removed; one whose lock is held is a live process's and is never touched. The lock file is
    created under a temporary name, locked, then renamed into place, so `.lock` is never seen
    unlocked while its owner lives; a directory without `.lock` (being created, or written by an
    older zeroshard) is never reclaimed. Names carry a random nonce, so a reused pid never meets a
    dead process's directory. flock works between the processes of one machine; on a network file
    system shared by several machines it depends on the server, so give each machine its own path.

Why the handler holds state: a signal handler is process-wide and receives only (signum, frame),
so the set of directories to remove must be reachable from the handler itself. It lives in the
handler object installed with `signal.signal` (a `functools.partial` over the set and the previous
disposition): the signal module is where the state is held, not a module global of ours. Later
stores find it with `signal.getsignal` and add their directory to it.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import shutil
import signal
import threading
import uuid
from pathlib import Path
from typing import TypeGuard

log = logging.getLogger(__name__)

LOCK = ".lock"
PREFIX = "zeroshard-"


# -- the lock that marks a directory alive ---------------------------------------------------------
def create_locked_dir(base: Path, stem: str) -> tuple[Path, int]:
    """A new directory `base/<stem>-<nonce>` holding `.lock`, locked by this process; returns it and
    the lock's descriptor (keep it open: closing it, or dying, releases the directory)."""
    root = base / f"{stem}-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    temporary = root / f"{LOCK}.tmp"
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.rename(temporary, root / LOCK)  # visible only once locked
    except OSError:
        os.close(fd)
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root, fd


def release_root(root: Path, lock: int) -> None:
    """Remove the directory, then let go of its lock (in this order: nobody reclaims it meanwhile)."""
    shutil.rmtree(root, ignore_errors=True)
    try:
        os.close(lock)
    except OSError:  # already closed (destroy() and then the atexit hook)
        pass


def reclaim_dead(base: Path) -> list[Path]:
    """Remove the store directories under `base` whose owner no longer runs; returns them."""
    reclaimed = []
    for entry in sorted(base.glob(f"{PREFIX}*")):
        if entry.is_dir() and _owner_is_gone(entry):
            reclaimed.append(entry)
    return reclaimed


def _owner_is_gone(entry: Path) -> bool:
    try:
        fd = os.open(entry / LOCK, os.O_RDWR)
    except OSError:  # no lock file: being created, or not ours to judge
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # held: a live process's
        size = _tree_bytes(entry)
        shutil.rmtree(entry, ignore_errors=True)  # while holding the lock
        log.warning(
            "zeroshard: removed %s (%.3f GB of NVMe swap files) left by process %s, which no longer runs",
            entry,
            size / 1e9,
            _pid_of(entry),
        )
        return True
    finally:
        os.close(fd)


PASSING_MARK = "-slices"  # in the name of a passing store's directory (offload/store.py)


def describe_others(base: Path) -> str:
    """A sentence on the other store directories still under `base` (for a free-space error); those
    of passing stores are not listed: the free-space check counts them as free."""
    others = [
        (entry, _tree_bytes(entry))
        for entry in sorted(base.glob(f"{PREFIX}*"))
        if entry.is_dir() and f"{PASSING_MARK}-" not in entry.name
    ]
    others = [(entry, size) for entry, size in others if size > 0]
    if not others:
        return ""
    listed = ", ".join(f"{entry.name} ({size / 1e9:.2f} GB)" for entry, size in others[:4])
    return (
        f"; swap directories of live processes (or without a lock file, from an older zeroshard) hold "
        f"space there: {listed}"
    )


def _tree_bytes(root: Path) -> int:
    total = 0
    for path in root.rglob("*"):
        try:
            total += path.stat().st_blocks * 512  # allocated, as posix_fallocate reserved it
        except OSError:
            pass
    return total


def _pid_of(entry: Path) -> str:
    parts = entry.name[len(PREFIX) :].split("-")
    return parts[0] if parts and parts[0].isdigit() else "?"


# -- SIGTERM ----------------------------------------------------------------------------------------
def remove_on_sigterm(root: Path) -> None:
    """Remove `root` if the process receives SIGTERM (see the note for when a handler is installed)."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal.signal works in the main thread only; atexit and reclaim still apply
    current = signal.getsignal(signal.SIGTERM)
    if _is_ours(current):
        current.args[0].add(root)
    elif current is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, functools.partial(_on_sigterm, {root}, current))


def keep_on_sigterm(root: Path) -> None:
    """`root` is gone already (destroy()); when no store is left, restore the previous disposition."""
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if _is_ours(current):
        roots, previous = current.args
        roots.discard(root)
        if not roots:
            signal.signal(signal.SIGTERM, previous)


def _is_ours(handler) -> TypeGuard[functools.partial]:
    return isinstance(handler, functools.partial) and handler.func is _on_sigterm


def _on_sigterm(roots: set, previous, signum, frame) -> None:
    for root in list(roots):
        shutil.rmtree(root, ignore_errors=True)
    roots.clear()
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, previous)  # the default action: terminate, by this very signal
    os.kill(os.getpid(), signum)
