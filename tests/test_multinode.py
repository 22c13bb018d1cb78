"""Across "machines": network namespaces joined by rate-limited veth links (scripts/netcluster.py).

Each case is one cluster run of tests/multinode_job.py (every stage inside one job), checked against
the same job on one node (4 kept test ranks). Needs root and `ip netns`; skipped otherwise.
After every test no namespace of this process's prefix may remain (the cleanup is part of the contract).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import run_distributed

REPO = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 240.0  # one launch: imports and rendezvous of 4 ranks on a loaded 2-core box
COMM_TIMEOUT_S = 8.0  # zeroshard.comm_timeout_s in the fault cases (start-up gets RUN_TIMEOUT_S)
EXIT_SLACK_S = 20.0  # after the error: the job writes its report, torchrun notices and stops its workers


sys.path.insert(0, str(REPO / "scripts"))  # scripts/ is not a package: netcluster and its netns
import netcluster  # noqa: E402


@pytest.fixture(scope="module")
def capability():
    if problem := netcluster.capability_problem():
        pytest.skip(f"needs root and network namespaces (ip netns): {problem}")


@pytest.fixture
def cluster_env(capability, tmp_path):
    """Yields a tmp dir; afterwards asserts that no namespace this process created is left."""
    yield tmp_path
    mine = f"{netcluster.PREFIX}{os.getpid()}x"
    assert [n for n in netcluster.our_namespaces() if n.startswith(mine)] == []


def _job(out: Path, *args) -> list[str]:
    return ["tests.multinode_job", "--out", str(out), *map(str, args)]


def _reports(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _standalone(out: Path, *args) -> list[dict]:
    """The same job on one node: 4 ranks in the host's network namespace (kept test ranks, started
    as torchrun starts them; the cluster runs above launch torchrun itself)."""
    run_distributed(_one_node_worker, 4, timeout=RUN_TIMEOUT_S, argv=_job(out, *args)[1:])
    return _reports(out, 4)


def _one_node_worker(rank: int, world_size: int, *, argv: list[str]) -> None:
    import tests.multinode_job as job

    job.main(argv, leave=False)


def _assert_ok(results) -> None:
    for r in results:
        assert r.returncode == 0 and not r.killed, f"node {r.node}: exit {r.returncode}\n{r.output[-4000:]}"


def _wait_for_steps(
    out: Path, stage: int, steps: int, world: int, proc_alive, timeout_s: float, outputs=lambda: ""
) -> None:
    """Until every rank's report has `steps` losses at `stage`; `outputs()` says what the job printed
    when it ended first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = []
        for r in range(world):
            try:
                done.append(len(json.loads((out / f"rank{r}.json").read_text())["stages"][str(stage)]["losses"]))
            except (FileNotFoundError, KeyError, json.JSONDecodeError):
                done.append(0)
        if min(done) >= steps:
            return
        assert proc_alive(), f"the job ended before every rank reached step {steps}: {done}\n{outputs()}"
        time.sleep(0.2)
    raise AssertionError(f"ranks did not reach step {steps} within {timeout_s:g} s")


def test_link_rate_and_bridge(cluster_env):
    """3 nodes on a bridge: nodes reach each other through it, and tbf holds each link to its rate."""
    payload, rate = 2_000_000, 40 * 10**6  # 16 Mbit at 40 Mbit/s: >= 0.4 s, minus one burst
    with netcluster.NetCluster(3, rate_bps=rate) as cluster:
        seen = [cluster.throughput(src, dst, payload) * 8 for src, dst in ((0, 2), (2, 1))]
    assert all(bits <= rate * 1.6 for bits in seen), f"{seen} bit/s over a {rate} bit/s link: no limit"


@pytest.mark.slow
def test_cli_tears_down_on_sigterm_and_failure(cluster_env):
    """The command line: a failing job reports its exit status; SIGTERM/Ctrl-C mid-run removes everything."""
    stale = f"{netcluster.PREFIX}{_dead_pid()}x0-n0"  # left by a run that was SIGKILLed
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=20)
    sleeper = cluster_env / "sleep.py"
    sleeper.write_text("import time\ntime.sleep(300)\n")
    failing = cluster_env / "fail.py"
    failing.write_text("import os, sys\nsys.exit(3 if os.environ['NETCLUSTER_NODE'] == '1' else 0)\n")
    cli = [
        sys.executable,
        str(REPO / "scripts" / "netcluster.py"),
        "--nodes",
        "2",
        "--timeout",
        "120",
        "--fail-grace",
        "3",
        "--",
    ]
    try:
        done = subprocess.run(
            [*cli, str(failing)],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            env={**os.environ, "NETCLUSTER_STALE_AFTER_S": "0"},
        )  # it is seconds old
        cleaned = stale not in netcluster.list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, timeout=20)  # if it is left
    assert (
        done.returncode == 1
        and "node 1 (10.213.0.2): exit 1" in done.stdout
        and "node 0 (10.213.0.1): killed: still running 3 s after node 1 failed" in done.stdout
    ), done.stdout + done.stderr
    assert cleaned, "a dead run's namespace was not cleaned at start"
    for sig in (signal.SIGTERM, signal.SIGINT):
        proc = subprocess.Popen([*cli, str(sleeper)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        prefix = f"{netcluster.PREFIX}{proc.pid}x"
        ours = _wait_for_workers(prefix, proc)
        proc.send_signal(sig)
        proc.communicate(timeout=60)
        assert proc.returncode != 0
        assert [n for n in netcluster.our_namespaces() if n.startswith(prefix)] == []
        survivors = [p for p in ours if _alive(p)]
        assert survivors == [], f"processes of the cluster survived {sig.name}: {survivors}"


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _wait_for_workers(prefix: str, proc, timeout_s: float = 120.0) -> list[int]:
    """Pids in the CLI's namespaces once each node runs its agent and its worker (the sleeper)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        names = [n for n in netcluster.our_namespaces() if n.startswith(prefix)]
        pids = {n: netcluster.namespace_pids(n) for n in names}
        if len(names) == 2 and all(len(p) >= 2 for p in pids.values()):
            return sum(pids.values(), [])
        time.sleep(0.2)
    raise AssertionError(f"the cluster's workers did not start (exit {proc.poll()})")


def _fault_run(tmp: Path, fault: str, victim: int, stage: int, save_at: int, first_stages: tuple[int, ...] = ()):
    """Train on 2 x 2 ranks over a 1 Gbit/s link (after `first_stages`, 3 steps each), saving a
    checkpoint after `save_at` steps of `stage`; a few steps later apply `fault` ("kill_node" or
    "freeze_node") to node `victim`. Returns (the reports, seconds until the other node's torchrun
    exited, the errors its ranks reported, the bytes that crossed node 0's link before the fault)."""
    survivor = 1 - victim
    out = tmp / "faulted"
    job = _job(
        out,
        "--stages",
        stage,
        "--steps",
        100_000,
        "--save-at",
        save_at,
        "--ckpt",
        tmp / "ckpt",
        "--progress",
        "--comm-timeout-s",
        COMM_TIMEOUT_S,
        "--init-timeout-s",
        RUN_TIMEOUT_S,
        "--max-seconds",
        180,
    )
    if first_stages:
        job += ["--first-stages", ",".join(map(str, first_stages))]
    with netcluster.NetCluster(2, rate_bps=10**9) as cluster:
        assert "tbf" in cluster.qdiscs(0) and "rate 1Gbit" in cluster.qdiscs(1), cluster.qdiscs(0)
        for node in (0, 1):  # gloo's ranks on one node talk over loopback: it must be up
            lo = subprocess.run(
                ["ip", "-n", cluster.namespace(node), "link", "show", "lo"], capture_output=True, text=True, timeout=20
            ).stdout
            assert ",UP," in lo or "<LOOPBACK,UP" in lo, lo
        # Monitor every 1 s: torchrun stops a node's other workers once one fails; give each the time
        # to report its own error first.
        cluster.launch(job, 2, module=True, cwd=REPO, monitor_interval_s=1.0)
        _wait_for_steps(
            out,
            stage,
            save_at + 3,
            4,
            lambda: len(cluster.running()) == 2,
            RUN_TIMEOUT_S,
            lambda: "\n".join(f"node {r.node}: exit {r.returncode}\n{r.output[-3000:]}" for r in cluster.wait(10)),
        )
        crossed = cluster.link_bytes(0)
        faulted_at = time.monotonic()
        getattr(cluster, fault)(victim)
        limit = faulted_at + COMM_TIMEOUT_S + EXIT_SLACK_S
        while cluster.procs[survivor].poll() is None and time.monotonic() < limit:
            time.sleep(0.1)
        exit_s = time.monotonic() - faulted_at
        result = cluster.wait(0)[survivor]
    assert result.returncode not in (0, None) and not result.killed, result.output[-3000:]
    reports = _reports(out, 4)
    missing = [
        r["rank"] for r in reports if r["node"] == survivor and not (out / f"rank{r['rank']}.error.json").exists()
    ]
    # A rank without a report: quote what the survivor node printed (torchrun's and the ranks' output).
    assert not missing, f"ranks {missing} wrote no error report; node {survivor}'s output:\n{result.output[-4000:]}"
    errors = [json.loads((out / f"rank{r['rank']}.error.json").read_text()) for r in reports if r["node"] == survivor]
    assert len(errors) == 2 and all(e["type"] == "CollectiveError" for e in errors), errors
    return reports, exit_s, errors, crossed


@pytest.mark.slow
def test_two_nodes_match_one_node_then_a_killed_node_resumes_elsewhere(cluster_env):
    """2 nodes x 2 ranks over a 1 Gbit/s link == 1 node x 4 ranks, bit for bit, stages 0-3; then
    node 0, which also hosts the rendezvous store, is SIGKILLed mid-run at stage 3: the other node's
    ranks raise CollectiveError (the first at once: the kernel resets the dead node's connections; a
    rank waiting on it within its comm_timeout_s) and its torchrun exits; the checkpoint saved before
    the kill resumes on 4 other ranks (one machine, the host's) and continues with the losses the
    killed run had.

    Exact across machines because the collective algorithms are the same: gloo runs the same ring
    over ranks 0-3 whichever machine a rank is on, so every sum is added in the same order."""
    stage, save_at, first_stages = 3, 2, (0, 1, 2)
    before, exit_s, errors, crossed = _fault_run(cluster_env, "kill_node", 0, stage, save_at, first_stages)
    assert sorted(r["node"] for r in before) == [0, 0, 1, 1], "2 ranks on each node"
    assert min(crossed.values()) > 100_000, f"gradients did not cross the veth link: {crossed}"
    ref = _standalone(cluster_env / "one", "--stages", "0,1,2,3", "--steps", 3)
    for mine, theirs in zip(before, ref):
        for s in map(str, first_stages):
            a, b = mine["stages"][s], theirs["stages"][s]
            assert a["losses"] == b["losses"], (mine["rank"], s, a["losses"], b["losses"])
            assert a["params_sha256"] == b["params_sha256"], f"rank {mine['rank']} stage {s} params"
        a, b = mine["stages"][str(stage)]["losses"][:3], theirs["stages"][str(stage)]["losses"]
        assert a == b, (mine["rank"], stage, a, b)
    assert exit_s < COMM_TIMEOUT_S + EXIT_SLACK_S
    # The first survivor fails at once (a reset); one that was waiting on that survivor instead of
    # the dead node sees no reset and fails when its own comm_timeout_s runs out.
    waits = sorted(e["since_last_step_s"] for e in errors)
    assert waits[0] < COMM_TIMEOUT_S and waits[-1] < 2 * COMM_TIMEOUT_S, errors
    resumed = _standalone(
        cluster_env / "resumed", "--stages", stage, "--steps", 3, "--resume", "--ckpt", cluster_env / "ckpt"
    )
    for old, new in zip(before, resumed):
        resumed_stage = new["stages"][str(stage)]
        assert resumed_stage["first_step"] == save_at and len(resumed_stage["losses"]) == 3
        assert resumed_stage["losses"] == old["stages"][str(stage)]["losses"][save_at : save_at + 3], old["rank"]


@pytest.mark.slow
@pytest.mark.serial
def test_frozen_node_times_out_within_comm_timeout(cluster_env):
    """A node that hangs (node 1, SIGSTOP: connections stay open, nothing arrives): node 0's ranks
    raise CollectiveError when comm_timeout_s runs out, not after torch's 30 minutes."""
    _, exit_s, errors, _ = _fault_run(cluster_env, "freeze_node", 1, stage=1, save_at=1)
    assert all("timeout" in e["message"].lower() or "timed out" in e["message"].lower() for e in errors)
    assert all(COMM_TIMEOUT_S - 1 <= e["since_last_step_s"] <= COMM_TIMEOUT_S + 5 for e in errors), errors
    assert exit_s < COMM_TIMEOUT_S + EXIT_SLACK_S


def test_sweep_table_regenerates_from_its_json(tmp_path):
    """docs/multinode.md's sweep table is what scripts/bandwidth_sweep.py makes of the recorded JSON."""
    doc = tmp_path / "multinode.md"
    committed = (REPO / "docs" / "multinode.md").read_text()
    begin, end = "<!-- bandwidth_sweep:begin -->", "<!-- bandwidth_sweep:end -->"
    doc.write_text(committed.split(begin)[0] + begin + "\nstale\n" + end + committed.split(end)[1])
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "bandwidth_sweep.py"),
            "--from-json",
            "--json",
            str(REPO / "docs" / "bench" / "multinode_sweep.json"),
            "--doc",
            str(doc),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert doc.read_text() == committed


START_UP_TIMEOUT_S = 6.0  # comm_timeout_s and torchrun's join_timeout in the start-up cases
# After the kill, beyond the timeout: a survivor's own start-up work between its marker and its first
# wait on the dead machine, naming the missing ranks (at most liveness.DIAGNOSE_S, well under 1 s here)
# and writing its report. Under a full suite on 2 cores, while the next cluster imports torch, the
# start-up work alone can take 4.5 s; torch's own bound would be 30 minutes, so 10 s tells them apart.
START_UP_MARGIN_S = 10.0


class _StartUpKill:
    """One cluster of 2 nodes x `per_node` ranks whose node 1 stops at `point` and is SIGKILLed there.

    The job's ranks write a marker on reaching the point, and node 1's stay there
    (tests/multinode_job.py --markers, --hold-at); once every rank has marked it, node 1 is killed.
    At "rendezvous" node 1's machine never starts its torchrun, and the point is reached once node 0's
    agent has entered the rendezvous."""

    def __init__(self, stack, tmp: Path, point: str, per_node: int, after: _StartUpKill | None = None):
        self.point, self.out, self.after, self.per_node = point, tmp / point, after, per_node
        self.cluster = stack.enter_context(netcluster.NetCluster(2, rate_bps=10**9))
        self.launched = False
        self.killed_at: float | None = None  # time.time(): the job's reports use the wall clock
        self.exit_s: float | None = None  # node 0's torchrun, after the kill

    def launch(self) -> None:
        job = _job(self.out, "--stages", 3, "--steps", 3, "--comm-timeout-s", START_UP_TIMEOUT_S)
        job += ["--markers", str(self.out / "markers"), "--hold-node", "1"]
        job += [] if self.point == "rendezvous" else ["--hold-at", self.point]
        rendezvous = self.point == "rendezvous"
        self.cluster.launch(
            job,
            self.per_node,
            module=True,
            cwd=REPO,
            monitor_interval_s=1.0,
            env={"LOGLEVEL": "INFO"} if rendezvous else None,
            nodes=[0] if rendezvous else None,
            join_timeout_s=START_UP_TIMEOUT_S if rendezvous else RUN_TIMEOUT_S,
        )
        self.launched = True

    def reached(self) -> bool:
        if self.point == "rendezvous":  # torchrun's agent logs this as it enters the rendezvous
            return "Rendezvous'ing worker group" in (self.cluster.log_dir / "node0.log").read_text(errors="replace")
        return len(list((self.out / "markers").glob(f"{self.point}.rank*"))) == 2 * self.per_node

    def poll(self) -> bool:
        """Launch once `after` has killed its node, kill node 1 once the point is reached; True once
        node 0's torchrun has exited."""
        if not self.launched:
            if self.after is not None and self.after.killed_at is None:
                return False
            self.launch()
        if self.killed_at is None:
            assert self.cluster.procs[0].poll() is None, f"{self.point}: node 0 ended before the kill"
            if not self.reached():
                return False
            if self.point != "rendezvous":
                self.cluster.kill_node(1)
            self.killed_at, self._killed_mono = time.time(), time.monotonic()
        if self.exit_s is None and self.cluster.procs[0].poll() is not None:
            self.exit_s = time.monotonic() - self._killed_mono
        return self.exit_s is not None


@pytest.mark.slow
@pytest.mark.serial
def test_machine_killed_during_start_up_survivors_exit_within_the_timeout(cluster_env):
    """Node 1 SIGKILLed during torchrun's rendezvous, init_process_group, initialize's first collectives
    and training (four clusters, two at a time: each second one starts once the first has killed its
    node, so that no survivor's timeout runs while two others import torch): node 0 exits within the
    timeout plus a margin after the kill, its ranks with a CollectiveError naming node 1's ranks. The
    rendezvous is bounded by torchrun's join_timeout (no ranks exist yet: torchrun raises
    RendezvousTimeoutError); init_process_group by its timeout, which zeroshard.init_distributed takes;
    the rest by comm_timeout_s. The start-up points run one rank per node (what they test is between
    machines), training two (a node's other worker is stopped by torchrun as well)."""
    with contextlib.ExitStack() as stack:
        first = [_StartUpKill(stack, cluster_env, point, 1) for point in ("init_process_group", "initialize")]
        runs = [
            *first,
            *(_StartUpKill(stack, cluster_env, p, 2, after) for p, after in zip(("rendezvous", "training"), first)),
        ]
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not all([run.poll() for run in runs]):  # every run polled each round
            assert time.monotonic() < deadline, [(r.point, r.killed_at, r.exit_s) for r in runs]
            time.sleep(0.05)
        results = {run.point: run.cluster.wait(0)[0] for run in runs}
    problems = [problem for run in runs for problem in _start_up_problems(run, results[run.point])]
    assert not problems, "\n".join(problems)


def _start_up_problems(run: _StartUpKill, result) -> list[str]:
    """What node 0 did wrong after node 1 was killed at `run.point`; [] when nothing."""
    bound, tail = START_UP_TIMEOUT_S + START_UP_MARGIN_S, result.output[-3000:]
    if result.returncode in (0, None) or run.exit_s >= bound + EXIT_SLACK_S:
        return [f"{run.point}: node 0 exit {result.returncode} {run.exit_s:.1f} s after the kill\n{tail}"]
    if run.point == "rendezvous":  # the survivor is node 0's agent itself
        if "RendezvousTimeoutError" not in result.output or run.exit_s >= bound:
            return [f"rendezvous: node 0's torchrun exited after {run.exit_s:.1f} s, bound {bound:g}\n{tail}"]
        return []
    reports = {r: run.out / f"rank{r}.error.json" for r in range(2 * run.per_node)}
    errors = {r: json.loads(path.read_text()) for r, path in reports.items() if path.exists()}
    if len(errors) != run.per_node:  # node 0's ranks, and only they
        return [f"{run.point}: error reports from ranks {sorted(errors)}\n{tail}"]
    lost = [r for r in range(2 * run.per_node) if r not in errors]  # the rendezvous chose node 1's
    return [
        f"{run.point}: rank {rank} after {error['at'] - run.killed_at:.1f} s: {error['type']}: {error['message']}"
        for rank, error in errors.items()
        if error["type"] != "CollectiveError"
        or not _names_lost_ranks(error["message"], lost)
        or error["at"] - run.killed_at >= bound
    ]


def _names_lost_ranks(message: str, lost: list[int]) -> bool:
    """The error names every lost rank: together ("ranks 2, 3 gone") or one by one when their
    probes found them differently ("rank 2 gone (...); rank 3 unreachable (...)"), which depends on
    how far the killed machine's teardown got when the survivor asked."""
    if f"ranks {', '.join(map(str, lost))} " in message:
        return True
    missing = message.split("missing ranks:", 1)
    return len(missing) == 2 and all(re.search(rf"\brank {r}\b", missing[1]) for r in lost)


# -- elastic: torchrun --nnodes 1:2 --max-restarts 3 ----------------------------------------------------
ELASTIC_STEPS = 12
# torchrun's agent on the rendezvous host keeps one TCPStore for every round, so the keys of the round
# before a restart are still there and the new workers' gloo may read a dead peer's address ("Connection
# refused", in some runs); a store per round is torchrun's opt-out.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _elastic_direct(rank: int, world_size: int, *, argv: list[str]) -> None:
    import tests.elastic_job as job

    job.main(argv, leave=False)


def _wait_for_checkpoint(ckpt: Path, step: int, cluster, timeout_s: float = RUN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, ValueError):
            if int((ckpt / "latest").read_text().removeprefix("global_step")) >= step:
                return
        assert cluster.running(), "the job ended before the checkpoint"
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint of step {step} within {timeout_s:g} s")


def _wait_for_snapshot(directory: Path, step: int, cluster, timeout_s: float = RUN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            if any(int(p.name.removeprefix("snapshot")) >= step for p in directory.glob("snapshot*")):
                return
        assert cluster.running(), "the job ended before the snapshot"
        time.sleep(0.1)
    raise AssertionError(f"no snapshot of step {step} in {directory} within {timeout_s:g} s")


@pytest.mark.slow
@pytest.mark.serial
def test_losing_a_machine_keeps_training_at_the_smaller_world_size(cluster_env):
    """Two machines of 2 ranks under torchrun's elastic mode; machine 1 is killed once the step-3
    checkpoint exists, and its host memory with it. Machine 0's agent restarts its workers at 2
    ranks; the job's own `engine.recover()` resumes the newest snapshot from machine 0's memory (its
    ranks' files and machine 1's buddy copies; [Note: snapshots on a buddy] in
    checkpoint/snapshot.py), `train_batch_size` stays 16 (the accumulation steps go from 2 to 4), and
    the run finishes with the losses of a run that resumed the disk checkpoint of the same step at 2
    ranks directly."""
    out, ckpt, memory = cluster_env / "elastic", cluster_env / "ckpt", cluster_env / "shm"
    job = ["tests.elastic_job", "--out", str(out), "--ckpt", str(ckpt), "--steps", str(ELASTIC_STEPS)]
    job += ["--snapshots", str(memory)]
    with netcluster.NetCluster(2) as cluster:
        cluster.launch(
            [*job, "--first-run-step-s", "1.0"],
            2,
            module=True,
            cwd=REPO,
            min_nodes=1,
            max_restarts=3,
            env=ELASTIC_ENV,
            rdzv_conf="last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2",
        )
        _wait_for_checkpoint(ckpt, 3, cluster)
        _wait_for_snapshot(memory / "node0", 3, cluster)  # written by the writer's thread after the checkpoint
        cluster.kill_node(1)
        shutil.rmtree(memory / "node1", ignore_errors=True)  # its host memory went with it
        results = cluster.wait(RUN_TIMEOUT_S, fail_grace_s=RUN_TIMEOUT_S)  # node 0 goes on alone
    assert results[0].returncode == 0, f"machine 0: exit {results[0].returncode}\n{results[0].output[-4000:]}"
    first = [json.loads((out / f"rank{r}.restart0.json").read_text()) for r in range(4)]
    assert all(r["world"] == 4 and r["gas"] == 2 for r in first), first
    restarts = sorted(int(p.name.split(".restart")[1].split(".")[0]) for p in out.glob("rank0.restart*.json"))
    last = [json.loads((out / f"rank{r}.restart{restarts[-1]}.json").read_text()) for r in range(2)]
    assert restarts[-1] >= 1 and all(r["world"] == 2 and r["gas"] == 4 for r in last), last
    tag = last[0]["resumed"]
    resumed_at = int(tag.removeprefix("global_step"))
    assert 3 <= resumed_at < ELASTIC_STEPS and all(r["resumed"] == tag for r in last), last
    assert all(r["source"] == "snapshot" for r in last), "recovered from machine 0's memory, not the disk"
    assert sorted(map(int, last[0]["losses"])) == list(range(resumed_at, ELASTIC_STEPS)), last[0]["losses"]
    direct = cluster_env / "direct"
    argv = [*job[1:-2], "--tag", tag, "--no-save"]  # from the disk checkpoint of that step
    argv[argv.index("--out") + 1] = str(direct)
    run_distributed(_elastic_direct, 2, timeout=RUN_TIMEOUT_S, argv=argv)
    for rank in range(2):
        theirs = json.loads((direct / f"rank{rank}.restart0.json").read_text())
        assert theirs["gas"] == 4 and last[rank]["losses"] == theirs["losses"], (rank, last[rank], theirs)


def test_a_global_batch_that_a_world_size_cannot_keep_is_an_error_naming_the_numbers():
    import zeroshard

    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 3}
    with pytest.raises(zeroshard.ConfigError, match=r"16.*3.*2|16.*2.*3"):
        zeroshard.load_config(config, world_size=2)
