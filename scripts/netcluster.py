#!/usr/bin/env python3
"""A local cluster of "machines": network namespaces joined by rate-limited veth links, one torchrun each.

    sudo python scripts/netcluster.py --nodes 2 --nproc-per-node 2 --rate 1gbit -- -m tests.multinode_job ...

Topology. Every node is a network namespace `zsnc<pid>x<k>-n<i>` with one interface, `zs0`, at
10.213.0.<i+1>/24 and its loopback up. Two nodes are joined by one veth pair; more hang off a bridge
that lives in a namespace of its own (`...-hub`), so nothing is ever created in, or routed through,
the host's network namespace: traffic flows only between the namespaces this script made. The file
system and the CPUs stay shared; only the network is split.

Link rate. `tc qdisc ... tbf` (token bucket; this kernel has no netem) limits what leaves each node's
`zs0` and, with a bridge, what the bridge sends to that node, so every node has a full-duplex port of
`rate`, like a server's NIC on a switch. Traffic between two ranks of one node goes over loopback and is
not limited (it stands in for NVLink / shared memory).

Launch. One `torchrun` (`python -m torch.distributed.run`) per namespace with the c10d rendezvous
hosted by node 0's agent (`is_host` set explicitly: every namespace shares the host's hostname, so
torch's guess from the hostname would be wrong) and `--local-addr` set to the node's address (torch
would otherwise advertise the hostname, which resolves to the host's real interface). Gloo and
TensorPipe are pinned to `zs0` (GLOO_SOCKET_IFNAME, TP_SOCKET_IFNAME).

Teardown, also on failure, Ctrl-C, SIGTERM and SIGHUP: every process whose network namespace is one of
ours is SIGKILLed (torchrun starts its workers in sessions of their own, so a process group would miss
them; the namespace does not), then the namespaces are deleted, which deletes their veths and bridge.
Namespaces of our prefix whose creating pid is dead (a run that was SIGKILLed) are removed at start,
once they are a minute old (netns.clean_stale says why).
Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for `ip netns`); `capability_problem()` says what is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # netns, beside this file
from netns import (
    IFNAME,
    IP_TIMEOUT_S,
    PREFIX,
    ClusterError,
    capability_problem,
    clean_stale,
    kill_namespace,
    list_namespaces,
    namespace_pids,
    our_namespaces,
    parse_rate,
    run_ip,
    tbf_argv,
)

SUBNET = "10.213.0"  # a private /24 that exists only inside our namespaces
RDZV_PORT = 29400  # on node 0's address, inside its namespace: cannot collide with the host's ports
_counter = itertools.count()


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
    return value


def rate_argument(text: str) -> int | None:
    """parse_rate for argparse, whose own message would hide ours."""
    try:
        return parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


@dataclasses.dataclass
class NodeResult:
    """How one node's torchrun ended: `returncode` (None: still running when killed), its output."""

    node: int
    returncode: int | None
    output: str
    killed: bool = False  # by kill_node() or by wait()
    why: str = ""  # why it was killed


@dataclasses.dataclass
class NetCluster:
    """N namespaces and their links. Use as a context manager: `with NetCluster(2, rate_bps=10**9) as c`."""

    nodes: int
    rate_bps: int | None = None  # None: no tbf
    latency_ms: float = 50.0  # tbf queue bound: packets waiting longer are dropped
    burst_bytes: int | None = None  # None: 4 ms worth of rate, at least one GSO packet
    log_dir: Path | None = None  # where node<i>.log go; None: a temporary directory
    base: str = dataclasses.field(init=False)
    procs: dict = dataclasses.field(init=False, default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.nodes, int) or not 2 <= self.nodes <= 64:
            raise ValueError(f"nodes={self.nodes!r}: allowed 2 to 64")
        if self.rate_bps is not None and not 10**5 <= self.rate_bps <= 4 * 10**10:
            raise ValueError(f"rate_bps={self.rate_bps!r}: allowed 1e5 (100kbit) to 4e10 (40gbit), or None")
        if not self.latency_ms > 0 or (self.burst_bytes is not None and self.burst_bytes < 1500):
            raise ValueError(
                f"latency_ms={self.latency_ms!r} must be > 0 and burst_bytes={self.burst_bytes!r}"
                " at least one packet (1500)"
            )
        self.base = f"{PREFIX}{os.getpid()}x{next(_counter)}"
        self._killed: set[int] = set()
        self._why, self._why_node = "", {}
        self._own_log_dir = self.log_dir is None
        self.log_dir = Path(tempfile.mkdtemp(prefix="netcluster-")) if self.log_dir is None else Path(self.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._saved_handlers: dict = {}
        self._stop_signal: int | None = None  # a signal that arrived, acted on between polls

    # -- names --------------------------------------------------------------------------------------
    def namespace(self, node: int) -> str:
        return f"{self.base}-n{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    @property
    def hub(self) -> str:
        return f"{self.base}-hub"

    def namespaces(self) -> list[str]:
        return [self.namespace(i) for i in range(self.nodes)] + ([self.hub] if self.nodes > 2 else [])

    # -- lifecycle ------------------------------------------------------------------------------------
    def __enter__(self) -> NetCluster:
        self._trap_signals()
        try:
            self.up()
            self._check_stop()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        clean_stale()
        for name in self.namespaces():
            run_ip("ip", "netns", "add", name)
        if self.nodes == 2:
            run_ip(
                "ip",
                "-n",
                self.namespace(0),
                "link",
                "add",
                IFNAME,
                "type",
                "veth",
                "peer",
                "name",
                IFNAME,
                "netns",
                self.namespace(1),
            )
        else:
            run_ip("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            run_ip("ip", "-n", self.hub, "link", "set", "br0", "up")
            for i in range(self.nodes):
                port = f"p{i}"  # the node's switch port, in the hub namespace
                run_ip(
                    "ip",
                    "-n",
                    self.hub,
                    "link",
                    "add",
                    port,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    IFNAME,
                    "netns",
                    self.namespace(i),
                )
                run_ip("ip", "-n", self.hub, "link", "set", port, "master", "br0")
                run_ip("ip", "-n", self.hub, "link", "set", port, "up")
                self._limit(self.hub, port)
        for i in range(self.nodes):
            ns = self.namespace(i)
            run_ip("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFNAME)
            run_ip("ip", "-n", ns, "link", "set", IFNAME, "up")
            run_ip("ip", "-n", ns, "link", "set", "lo", "up")
            self._limit(ns, IFNAME)

    def _limit(self, ns: str, dev: str) -> None:
        if self.rate_bps is not None:
            run_ip("ip", "netns", "exec", ns, *tbf_argv(dev, self.rate_bps, self.latency_ms, self.burst_bytes))

    def set_rate(self, rate_bps: int | None) -> None:
        """Change every link's limit (None: none) on a running cluster of two nodes; a bridge's
        switch ports are limited only at start."""
        if self.nodes != 2:
            raise ValueError(f"set_rate on {self.nodes} nodes: only two nodes (one veth pair) change rate")
        if rate_bps == self.rate_bps:
            return
        for i in range(self.nodes):
            run_ip(
                "ip", "netns", "exec", self.namespace(i), *tbf_argv(IFNAME, rate_bps, self.latency_ms, self.burst_bytes)
            )
        self.rate_bps = rate_bps

    def qdiscs(self, node: int) -> str:
        """`tc qdisc show` inside a node, to check the limit is in place."""
        return run_ip("ip", "netns", "exec", self.namespace(node), "tc", "qdisc", "show", "dev", IFNAME).stdout

    def link_bytes(self, node: int) -> dict[str, int]:
        """{'tx': ..., 'rx': ...}: bytes the kernel moved through the node's interface so far."""
        out = run_ip("ip", "-n", self.namespace(node), "-j", "-s", "link", "show", "dev", IFNAME).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}

    def run_in(self, node: int, cmd: list[str], **popen) -> subprocess.Popen:
        """Start `cmd` inside a node's namespace; teardown kills it if it still runs."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespace(node), *cmd], start_new_session=True, **popen)

    def throughput(self, src: int, dst: int, nbytes: int = 4_000_000, port: int = 5001) -> float:
        """Bytes per second one TCP stream moves from node `src` to node `dst` (python sockets)."""
        receive = (
            f"import socket;s=socket.create_server(('0.0.0.0',{port}));c,_=s.accept();n=0\n"
            "while (b:=c.recv(1<<16)): n+=len(b)\nprint(n)"
        )
        send = (
            f"import socket,time;s=socket.create_connection(({self.address(dst)!r},{port}),timeout=60)\n"
            f"t=time.monotonic();s.sendall(bytes({nbytes}));s.shutdown(socket.SHUT_WR);s.recv(1)\n"
            "print(time.monotonic()-t)"
        )
        server = self.run_in(dst, [sys.executable, "-c", receive], stdout=subprocess.PIPE, text=True)
        try:
            for _ in range(40):  # until the server listens; bounded
                client = self.run_in(
                    src, [sys.executable, "-c", send], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
                out, err = client.communicate(timeout=120)
                if client.returncode == 0:
                    break
                time.sleep(0.25)
            else:
                raise ClusterError(f"throughput probe {src} -> {dst} failed: {err.strip()[-500:]}")
            received = int(server.communicate(timeout=60)[0])
        finally:
            with contextlib.suppress(ProcessLookupError):
                server.kill()
            server.wait(timeout=IP_TIMEOUT_S)
        if received != nbytes:
            raise ClusterError(f"throughput probe {src} -> {dst}: {received} of {nbytes} bytes arrived")
        return nbytes / float(out)

    def down(self) -> None:
        """Kill everything in our namespaces, delete them; raises ClusterError if any remain.

        Every step is tried whatever the earlier ones did: a namespace that cannot be emptied is still
        deleted (its processes lose their network, it goes when they do)."""
        problems = []
        try:
            for name in self.namespaces():
                try:
                    kill_namespace(name)
                except Exception as e:  # noqa: BLE001  (report it, go on tearing down)
                    problems.append(f"killing {name}: {e}")
            for proc in self.procs.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=IP_TIMEOUT_S)  # reap; SIGKILLed above
            present = set(list_namespaces())
            for name in (n for n in self.namespaces() if n in present):
                if (done := run_ip("ip", "netns", "del", name, check=False)).returncode != 0:
                    problems.append(f"`ip netns del {name}`: {done.stderr.strip()}")
            if left := [n for n in our_namespaces() if n.startswith(self.base + "-")]:
                problems.append(f"namespaces left after teardown: {left}")
        finally:
            self._restore_signals()
            if self._own_log_dir:
                shutil.rmtree(self.log_dir, ignore_errors=True)
        if problems:
            raise ClusterError("; ".join(problems))

    def _trap_signals(self) -> None:
        """SIGTERM / SIGHUP / SIGINT are noted, and acted on at the next safe point (`_check_stop`):
        an exception raised from the handler could land inside `Popen.poll()` between taking and
        releasing its internal lock, and every later `wait()` of that process would then block
        until its timeout — teardown took over a minute that way under load."""
        if threading.current_thread() is not threading.main_thread():
            return

        def note(signum, _frame):
            self._stop_signal = signum

        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            self._saved_handlers[sig] = signal.signal(sig, note)

    def _check_stop(self) -> None:
        """Leave (so that `finally` tears down) if a signal arrived: Ctrl-C as KeyboardInterrupt, the
        others as SystemExit with the shell's status for a death by that signal."""
        signum = self._stop_signal
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        if signum is not None:
            raise SystemExit(128 + signum)

    def _restore_signals(self) -> None:
        for sig, handler in self._saved_handlers.items():
            signal.signal(sig, handler)
        self._saved_handlers.clear()

    # -- jobs -----------------------------------------------------------------------------------------
    def torchrun_command(
        self,
        node: int,
        job: list[str],
        nproc_per_node: int,
        *,
        module: bool = False,
        monitor_interval_s: float = 0.1,
        join_timeout_s: float = 300.0,
        min_nodes: int | None = None,
        max_restarts: int = 0,
        rdzv_conf: str = "",
    ) -> list[str]:
        """`min_nodes` (elastic: `--nnodes MIN:MAX`) with `max_restarts`: torchrun restarts the
        workers of the nodes still up, at the world size they make, after one fails; `rdzv_conf`:
        more `--rdzv-conf` entries (`last_call_timeout=2,...`)."""
        is_host = int(node == 0)
        nnodes = str(self.nodes) if min_nodes is None else f"{min_nodes}:{self.nodes}"
        conf = f"is_host={is_host},join_timeout={join_timeout_s:g}" + (f",{rdzv_conf}" if rdzv_conf else "")
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",  # = torchrun, with this interpreter
            "--nnodes",
            nnodes,
            "--node_rank",
            str(node),
            "--nproc_per_node",
            str(nproc_per_node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{self.address(0)}:{RDZV_PORT}",
            "--rdzv-id",
            self.base,
            "--rdzv-conf",
            conf,
            "--local-addr",
            self.address(node),
            "--max-restarts",
            str(max_restarts),
            "--monitor-interval",
            f"{monitor_interval_s:g}",
            *(["--module"] if module else []),
            *job,
        ]

    def launch(
        self,
        job: list[str],
        nproc_per_node: int,
        *,
        module: bool = False,
        env: dict | None = None,
        cwd: str | None = None,
        nodes: list[int] | None = None,
        **torchrun,
    ) -> None:
        """Start one torchrun per node running `job` (a script and its arguments; `module`: python -m);
        `nodes`: only on these (the others' machines are up but never join)."""
        if not job:
            raise ValueError("launch(job=[]): give a script (or, with module=True, a module) to run")
        if not 1 <= nproc_per_node <= 64:
            raise ValueError(f"nproc_per_node={nproc_per_node}: allowed 1 to 64")
        node_env = {
            **os.environ,
            "GLOO_SOCKET_IFNAME": IFNAME,
            "TP_SOCKET_IFNAME": IFNAME,
            "OMP_NUM_THREADS": "1",
            **{k: str(v) for k, v in (env or {}).items()},
        }
        for i in range(self.nodes) if nodes is None else nodes:
            cmd = [
                "ip",
                "netns",
                "exec",
                self.namespace(i),
                *self.torchrun_command(i, job, nproc_per_node, module=module, **torchrun),
            ]
            where = {"NETCLUSTER_NODE": str(i), "NETCLUSTER_ADDR": self.address(i)}  # for the job's reports
            with open(self.log_dir / f"node{i}.log", "wb") as log:
                self.procs[i] = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**node_env, **where},
                    cwd=cwd,
                    start_new_session=True,
                )  # Ctrl-C: us, not them

    def kill_node(self, node: int) -> None:
        """SIGKILL the whole node: its torchrun agent and every worker (all of its namespace)."""
        self._killed.add(node)
        kill_namespace(self.namespace(node))

    def freeze_node(self, node: int) -> None:
        """SIGSTOP every process of a node: a machine that hangs with its connections open."""
        for pid in namespace_pids(self.namespace(node)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def running(self) -> list[int]:
        return [i for i, p in self.procs.items() if p.poll() is None]

    def wait(self, timeout_s: float, fail_grace_s: float = 30.0) -> list[NodeResult]:
        """Wait for every node's torchrun; results in node order. What still runs at the deadline is
        killed, and so is every node still running `fail_grace_s` after one failed: a node whose
        workers succeeded waits in torchrun's exit barrier for the others and would sit out its
        timeout (a scheduler's kill-on-bad-exit does the same)."""
        deadline = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < deadline:
            self._check_stop()
            failed = [i for i, p in self.procs.items() if p.poll() not in (None, 0)]
            if failed and not self._why:
                deadline = min(deadline, time.monotonic() + fail_grace_s)
                self._why = f"still running {fail_grace_s:g} s after node {failed[0]} failed"
            time.sleep(0.1)
        for i in self.running():
            self._why_node[i] = self._why or f"still running at the {timeout_s:g} s deadline"
            self.kill_node(i)
        for proc in self.procs.values():
            proc.wait(timeout=IP_TIMEOUT_S)
        return [self.result(i) for i in sorted(self.procs)]

    def result(self, node: int) -> NodeResult:
        proc = self.procs[node]
        output = (self.log_dir / f"node{node}.log").read_text(errors="replace")
        return NodeResult(
            node,
            proc.returncode,
            output,
            killed=node in self._killed,
            why=self._why_node.get(node, "killed by kill_node()" if node in self._killed else ""),
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=2, help="network namespaces (machines), 2 to 64")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node")
    parser.add_argument(
        "--rate",
        type=rate_argument,
        default=None,
        help="each node's link rate, e.g. 1gbit, 100mbit (default: unlimited)",
    )
    parser.add_argument("--latency-ms", type=_positive, default=50.0, help="tbf queue bound")
    parser.add_argument("--timeout", type=_positive, default=600.0, help="seconds before every node is killed")
    parser.add_argument(
        "--fail-grace",
        type=_positive,
        default=30.0,
        help="seconds the other nodes get after one fails, then they are killed",
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="keep node<i>.log here")
    parser.add_argument("--module", "-m", action="store_true", help="the job is a module (python -m)")
    parser.add_argument("job", nargs=argparse.REMAINDER, help="script (or module) and its arguments")
    args = parser.parse_args(argv)
    job = args.job[1:] if args.job[:1] == ["--"] else args.job
    if not job:
        parser.error("give the job to run: a script and its arguments (or --module and a module)")
    if problem := capability_problem():
        print(f"netcluster: cannot build namespaces: {problem}", file=sys.stderr)
        return 2
    if not 1 <= args.nproc_per_node <= 64:
        parser.error(f"--nproc-per-node {args.nproc_per_node}: allowed 1 to 64")
    try:
        cluster = NetCluster(args.nodes, rate_bps=args.rate, latency_ms=args.latency_ms, log_dir=args.log_dir)
    except ValueError as e:
        parser.error(str(e))
    with cluster:
        cluster.launch(job, args.nproc_per_node, module=args.module)
        results = cluster.wait(args.timeout, args.fail_grace)
        for r in results:
            status = f"killed: {r.why}" if r.killed else f"exit {r.returncode}"
            print(f"--- node {r.node} ({cluster.address(r.node)}): {status}\n{r.output[-4000:]}")
    return 0 if all(r.returncode == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
