"""Which ranks are gone, so that an error can name them.

[Note: naming the missing ranks]
A collective that fails because a peer died says only which connection broke (gloo names an address
and port) or that a wait ran out of time (start-up waits name a store key). To name the ranks, every
process listens on a TCP socket of its own and publishes its address in the rendezvous store under
its global rank. The kernel completes a connection to a listening socket without the process taking
part (no thread), so a probe of a rank's address tells (a rank that connects is probed once more
SETTLE_S later: a failure is seen as soon as the first process of a machine dies, the others a
moment later):
  * connected: the rank's process lives (it may hang, or be stopped);
  * refused: the process is gone, its machine is up (the kernel answered for it);
  * no answer within PROBE_S: the machine is unreachable (powered off, cut off);
  * no address published: the rank never got as far as publishing one (its process died or had not
    started before torch.distributed was initialised).
Under torchrun the address goes to the launcher's store before init_process_group (the store is up
before any worker starts), so a rank that never reached init_process_group is named too; otherwise
it is published once the process group exists. The socket belongs to the process, not to a group:
it says whether the process lives, whatever groups it is in. Reading the store and probing run in a
helper thread joined within DIAGNOSE_S, so naming the ranks adds at most that to an error's path,
even when the store itself is unreachable.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import itertools
import os
import selectors
import socket
import threading
import time
from datetime import timedelta
from typing import cast

import torch.distributed as dist

PROBE_S = 1.0  # a machine that does not answer a connection within this is called unreachable
SETTLE_S = 0.5  # then probe the ranks that answered once more: the first probe may beat their death
DIAGNOSE_S = 3.0  # the whole diagnosis, store reads included
GATE_PROBE_S = 1.0  # a rank waiting at the start-up gate probes the late ranks this often
_KEY = "zeroshard/alive"


class _Listener:
    """This process's liveness socket, the store its address went to, and under which ranks."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.launcher: dist.PrefixStore | None = None  # torchrun's store, once connected
        self.published: set[tuple[int, int]] = set()  # (id of the store, rank)
        self.lock = threading.Lock()

    def address(self) -> str:
        if self.sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("0.0.0.0", 0))
            sock.listen(socket.SOMAXCONN)  # never accepted: the kernel's queue answers probes
            atexit.register(sock.close)  # it lives as long as the process, and closes with it
            self.sock = sock
        return f"{_reachable_ip()}:{self.sock.getsockname()[1]}"

    def store(self, timeout_s: float):
        """torchrun's store where launched by torchrun, else the default process group's, else None."""
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in os.environ:
            if self.launcher is None:
                client = dist.TCPStore(
                    os.environ["MASTER_ADDR"],
                    int(os.environ["MASTER_PORT"]),
                    is_master=False,
                    timeout=timedelta(seconds=timeout_s),
                )
                scope = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
                self.launcher = dist.PrefixStore(f"{_KEY}/{scope}/", client)  # one launch attempt's keys
            return self.launcher
        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):  # torch keeps the default store private
                return dist.PrefixStore(f"{_KEY}/", dist.distributed_c10d._get_default_store())
        return None


_LISTENER = _Listener()  # per process: see the Note above


def _reachable_ip() -> str:
    """The address of the interface this host reaches the rendezvous store through (MASTER_ADDR):
    the one the other ranks reach it through too. No packet is sent (a UDP socket only routes)."""
    with contextlib.suppress(OSError, ValueError):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as route:
            route.connect((os.environ.get("MASTER_ADDR") or socket.gethostname(), 9))
            return route.getsockname()[0]
    return "127.0.0.1"


def announce(rank: int, timeout_s: float) -> None:
    """Publish this process's liveness address under its global `rank` (once per store). Naming the
    missing ranks is a diagnosis: a store that fails here is left to fail the start-up itself."""
    with _LISTENER.lock:
        with contextlib.suppress(Exception):
            store = _LISTENER.store(timeout_s)
            if store is not None and (id(store), rank) not in _LISTENER.published:
                store.set(str(rank), _LISTENER.address())
                _LISTENER.published.add((id(store), rank))


def describe_missing(ranks: list[int], me: int, timeout_s: float) -> str:
    """A sentence naming which of `ranks` (global) are gone, unreachable or never started, from the
    probes of [Note: naming the missing ranks]; returns within DIAGNOSE_S."""
    result: list[str] = []

    def diagnose() -> None:
        try:
            result.append(_diagnose(_LISTENER.store(timeout_s), ranks, me))
        except Exception as error:  # noqa: BLE001 - the store's host may be the machine that is gone
            result.append(f"could not tell which ranks are missing: {error}")

    worker = threading.Thread(target=diagnose, daemon=True)
    worker.start()
    worker.join(DIAGNOSE_S)
    return result[0] if result else f"could not tell which ranks are missing (no answer within {DIAGNOSE_S:g} s)"


def _diagnose(store, ranks: list[int], me: int) -> str:
    if store is None:
        return "could not tell which ranks are missing: no rendezvous store"
    addresses = {r: store.get(str(r)).decode() for r in ranks if r != me and store.check([str(r)])}
    states = probe(addresses)
    if any(s == "alive" for s in states.values()):  # a machine's processes die one after another
        time.sleep(SETTLE_S)
        states.update(probe({r: a for r, a in addresses.items() if states[r] == "alive"}))
    never = [r for r in ranks if r != me and r not in addresses]
    gone = [r for r, s in states.items() if s == "gone"]
    unreachable = [r for r, s in states.items() if s == "unreachable"]
    parts = []
    if gone:
        parts.append(f"{_ranks(gone)} gone (process dead: {_hosts(gone, addresses)} refused the connection)")
    if unreachable:
        parts.append(
            f"{_ranks(unreachable)} unreachable ({_hosts(unreachable, addresses)}: no answer in {PROBE_S:g} s)"
        )
    if never:
        parts.append(f"{_ranks(never)} never reached zeroshard's start-up (no liveness address published)")
    if not parts:
        return "missing ranks: none, every other rank's process is alive (one may hang or have taken another path)"
    return "missing ranks: " + "; ".join(parts)


def probe(addresses: dict[int, str]) -> dict[int, str]:
    """rank -> "alive" / "gone" / "unreachable": connect to every address at once, wait PROBE_S."""
    states, selector = {}, selectors.DefaultSelector()
    deadline = time.monotonic() + PROBE_S
    try:
        for rank, address in addresses.items():
            host, port = address.rsplit(":", 1)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            code = sock.connect_ex((host, int(port)))
            if code in (0, errno.EINPROGRESS):
                selector.register(sock, selectors.EVENT_WRITE, rank)
            else:
                states[rank] = _state(code)
                sock.close()
        while selector.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                conn = cast(socket.socket, key.fileobj)
                states[key.data] = _state(conn.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
                selector.unregister(conn)
                conn.close()
    finally:
        for key in list(selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        selector.close()
    return {rank: states.get(rank, "unreachable") for rank in addresses}


def _state(code: int) -> str:
    return "alive" if code == 0 else "gone" if code == errno.ECONNREFUSED else "unreachable"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


def _hosts(ranks: list[int], addresses: dict[int, str]) -> str:
    return ", ".join(sorted({addresses[r].rsplit(":", 1)[0] for r in ranks}))


# [Note: start-up skew]
# Ranks reach zeroshard's start-up (the engine's own process group) at different times: one loads a
# larger file, a node is busy, a machine joined the rendezvous last. torch bounds a group's creation by
# the timeout given to it, and comm_timeout_s is chosen for collectives, where a few seconds of silence
# means a fault; as the bound of the start-up it would fail every run whose ranks arrive further apart.
# So the ranks first meet at a gate in the rendezvous store, and a late rank is waited for as long as
# its process lives: every GATE_PROBE_S the waiting ranks probe the late ones' liveness sockets (the
# Note above). A late rank that is gone or unreachable fails the start-up at once, naming it; one that
# never published an address is given comm_timeout_s (it may still be importing); one that lives is
# given the default process group's timeout (the launcher's init timeout, the one bound the user set
# for a start-up). Once every rank is at the gate, the group is created within comm_timeout_s.
class GateError(RuntimeError):
    """The ranks did not all reach a start-up gate; the message names the ones missing."""


# The gates this process has reached, counted: the same sequence on every rank, as each engine's
# start-up is collective, so the count names the gate.
_GATE_COUNT = itertools.count(1)


def meet_at_start(ranks: list[int], me: int, patience_s: float) -> None:
    """Wait until every one of `ranks` (global) has reached this gate: [Note: start-up skew].
    `patience_s` bounds the wait for a rank that never published a liveness address; without a
    rendezvous store the gate is passed at once (torch's own bound then applies)."""
    gate = f"gate/{next(_GATE_COUNT)}/"
    store = _LISTENER.store(patience_s)
    if store is None or len(ranks) < 2:
        return
    store.set(f"{gate}{me}", "1")
    if store.add(f"{gate}arrived", 1) == len(ranks):
        store.set(f"{gate}all", "1")
        return
    bound_s = max(patience_s, _default_timeout_s())
    started = time.monotonic()
    probe_at, pause = started + GATE_PROBE_S, 0.005
    # Polled with check(), not wait(): a store wait that runs out logs a warning in torch's C++ layer.
    while not store.check([f"{gate}all"]):
        time.sleep(pause)
        pause = min(2 * pause, 0.2)  # a prompt pass for ranks that arrive together, little load later
        if time.monotonic() >= probe_at:
            _check_late(store, gate, ranks, me, time.monotonic() - started, patience_s, bound_s)
            probe_at = time.monotonic() + GATE_PROBE_S


def _check_late(store, gate: str, ranks: list[int], me: int, waited: float, patience_s: float, bound_s: float) -> None:
    """Raise GateError when a late rank is gone, or late beyond its bound (see the Note)."""
    late = [r for r in ranks if r != me and not store.check([f"{gate}{r}"])]
    if not late:
        return  # the last one is arriving
    addresses = {r: store.get(str(r)).decode() for r in late if store.check([str(r)])}
    lost = [r for r, state in probe(addresses).items() if state != "alive"]
    never = [r for r in late if r not in addresses]
    if lost or (never and waited > patience_s) or waited > bound_s:
        raise GateError(
            f"{_ranks(late)} did not reach the start-up gate within {waited:.1f}s (a live rank is "
            f"waited for {bound_s:g}s, the default process group's timeout; one without a liveness "
            f"address {patience_s:g}s)"
        )


def _default_timeout_s() -> float:
    """The default process group's timeout (its store's: init_process_group gives both the same)."""
    with contextlib.suppress(Exception):  # torch keeps the default store private
        timeout: timedelta = getattr(dist.distributed_c10d._get_default_store(), "timeout")  # noqa: B009 - untyped
        return timeout.total_seconds()
    return 0.0
