"""Network-namespace primitives for scripts/netcluster.py: list, kill, clean up, check we may create them.

Every namespace of ours is named PREFIX<pid>x<k>-<role> (pid: the creating process), so parallel runs
never collide and a dead run's leftovers can be recognised. All `ip` / `tc` calls have a timeout.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import time

PREFIX = "zsnc"  # every namespace we create is named PREFIX<pid>x<k>-...
IFNAME = "zs0"  # each node's interface, inside its namespace
IP_TIMEOUT_S = 20.0  # one `ip` / `tc` command
_STALE_AFTER_S = 60.0  # see clean_stale(); NETCLUSTER_STALE_AFTER_S overrides it
# Kill, look again (a dying agent may still fork), until none is left or this many seconds have
# passed: a SIGKILLed process is listed until the kernel has torn it down, which on a loaded 2-core
# box (two other test workers computing) took more than a second for a torch process, and more than
# ten for two ranks of the 218M GPT, which free gigabytes each while the survivors compute.
_KILL_WAIT_S = 30.0
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_counter = itertools.count()


class ClusterError(RuntimeError):
    """Setting up or tearing down the namespaces failed; the message names the command."""


def parse_rate(text: str) -> int | None:
    """'1gbit', '100mbit', '0.5gbit', '2000kbit' -> bits per second; 'none' -> None (unlimited)."""
    if text.strip().lower() in ("none", "unlimited"):
        return None
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", text.lower())
    if not match or match.group(2) not in _RATE_UNITS:
        raise ValueError(
            f"link rate {text!r}: expected a number and one of {list(_RATE_UNITS)} (e.g. '1gbit', '100mbit') or 'none'"
        )
    bits = float(match.group(1)) * _RATE_UNITS[match.group(2)]
    if not 10**5 <= bits <= 4 * 10**10:
        raise ValueError(f"link rate {text!r}: allowed 100kbit to 40gbit")
    return int(bits)


MIN_BURST_BYTES = 64 * 1024  # >= one GSO super-packet, so tbf never has to drop one whole


def tbf_argv(dev: str, rate_bps: int | None, latency_ms: float = 50.0, burst_bytes: int | None = None) -> list[str]:
    """`tc` arguments that put (`replace`) a token bucket of `rate_bps` on `dev`'s egress, or, for
    None, take it off (`del`; fails if there is none). Burst: 4 ms of the rate, at least MIN_BURST_BYTES."""
    if rate_bps is None:
        return ["tc", "qdisc", "del", "dev", dev, "root"]
    burst = burst_bytes or max(MIN_BURST_BYTES, rate_bps // 8 // 250)
    return [
        "tc",
        "qdisc",
        "replace",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        f"{rate_bps}bit",
        "burst",
        str(burst),
        "latency",
        f"{latency_ms:g}ms",
    ]


def run_ip(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"`{' '.join(cmd)}` did not finish within {IP_TIMEOUT_S:g} s") from e
    if check and done.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


def list_namespaces() -> list[str]:
    """Names of every network namespace (`ip netns list` prints 'name (id: N)')."""
    out = run_ip("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def our_namespaces() -> list[str]:
    return [n for n in list_namespaces() if n.startswith(PREFIX)]


def namespace_pids(name: str) -> list[int]:
    done = run_ip("ip", "netns", "pids", name, check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def kill_namespace(name: str) -> None:
    """SIGKILL every process in `name`: a machine losing power. Bounded; raises if some survive."""
    deadline = time.monotonic() + _KILL_WAIT_S
    while time.monotonic() < deadline:
        pids = namespace_pids(name)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    raise ClusterError(f"processes {namespace_pids(name)} in namespace {name} survived SIGKILL for {_KILL_WAIT_S:g} s")


def _stale_after_s() -> float:
    text = os.environ.get("NETCLUSTER_STALE_AFTER_S", str(_STALE_AFTER_S))
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(f"NETCLUSTER_STALE_AFTER_S={text!r}: seconds, a number >= 0")
    return value


def _age_s(name: str) -> float:
    try:
        return time.time() - os.stat(f"/run/netns/{name}").st_mtime
    except OSError:
        return float("inf")  # not where iproute2 keeps it: judge by the pid alone


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale() -> list[str]:
    """Remove our prefix's namespaces whose creating process is dead; returns their names.

    Only those older than _STALE_AFTER_S: a run in another PID namespace (another container sharing
    /run/netns) has pids we cannot see, and its namespaces must survive their first seconds unharmed."""
    stale, after_s = [], _stale_after_s()
    for name in our_namespaces():
        match = re.match(rf"{PREFIX}(\d+)x", name)
        if match and not _pid_alive(int(match.group(1))) and _age_s(name) > after_s:
            kill_namespace(name)
            run_ip("ip", "netns", "del", name, check=False)
            stale.append(name)
    return stale


def capability_problem() -> str | None:
    """None when this process can build a cluster; otherwise why not, for a test's skip message."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "`ip` / `tc` (iproute2) not found on PATH"
    if os.geteuid() != 0:
        return f"not root (euid {os.geteuid()})"
    probe = f"{PREFIX}{os.getpid()}x{next(_counter)}-probe"
    try:
        run_ip("ip", "netns", "add", probe)
        run_ip("ip", "-n", probe, "link", "add", IFNAME, "type", "veth", "peer", "name", "zs1")
        run_ip("ip", "-n", probe, "link", "set", IFNAME, "up")
        run_ip(
            "ip",
            "netns",
            "exec",
            probe,
            "tc",
            "qdisc",
            "add",
            "dev",
            IFNAME,
            "root",
            "tbf",
            "rate",
            "1gbit",
            "burst",
            "256kb",
            "latency",
            "50ms",
        )
    except ClusterError as e:
        return str(e)
    finally:
        run_ip("ip", "netns", "del", probe, check=False)
    return None
