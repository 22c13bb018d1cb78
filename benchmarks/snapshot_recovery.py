"""A machine killed at a chosen moment on network-namespace machines (scripts/netcluster.py), and
what the survivors do: where they resume from, how many steps they redo, how long from the kill to
their first step, and whether their losses are those of a run resumed from the disk checkpoint of
the same step ([Note: snapshots on a buddy] in checkpoint/snapshot.py). Needs root.

    sudo python benchmarks/snapshot_recovery.py --out docs/bench/snapshot_recovery.txt

Each case is one elastic run (`torchrun --nnodes 1:M --max-restarts 3`, M machines of 2 ranks,
benchmarks/recovery_job.py: the GPT at ZeRO stage 3, a disk checkpoint after every step and, with
`--recover snapshot`, a snapshot in host memory in every step) in which the last machine is killed
(SIGKILL of its whole namespace) and its host memory removed:
  * `step`: during the step after step `--kill-after`, at a random fraction of a step's time after
    that step's update (`--seed`);
  * `snapshot`: while the last machine's snapshot of a step is still being written (its
    `.partial-` directory exists), after step `--kill-after`;
  * `recovery` (3 machines): machine 1 killed during a step (as `step`), then machine 2 while the
    survivors' restarted workers recover (their report says "recovering");
and, for comparison, `step` with `--recover disk`: the restarted workers load the newest disk
checkpoint instead. Per case: the step the survivors resumed at and from what (snapshot or disk,
and why), the steps redone (the last step completed before the kill, plus one, less the step
resumed at), the time from the kill to the restarted workers' engine, to their resume, and to the end
of their first step; then a direct run from the disk checkpoint of the resumed step at the
survivors' world size must give the same losses, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))  # netcluster, not a package
import netcluster  # noqa: E402

RANKS_PER_MACHINE = 2
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # a store per rendezvous round (test_multinode.py)
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"


def _reports(out: Path, restart: int) -> list[dict]:
    found = []
    for path in sorted(out.glob(f"rank*.restart{restart}.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (json.JSONDecodeError, FileNotFoundError):
            continue
    return found


def _steps_done(out: Path) -> dict[int, float]:
    """step -> the latest end time over the ranks of restart 0 that reported it."""
    done: dict[int, float] = {}
    for report in _reports(out, 0):
        for step, entry in report.get("steps", {}).items():
            done[int(step)] = max(done.get(int(step), 0.0), entry["t_end"])
    return done


def _wait(condition, what: str, cluster, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        if not cluster.running():
            logs = "\n".join(f"--- node {r.node}: exit {r.returncode}\n{r.output[-3000:]}" for r in cluster.wait(1.0))
            raise RuntimeError(f"the job ended before {what}\n{logs}")
        time.sleep(0.01)
    raise RuntimeError(f"no {what} within {timeout_s:g} s")


def run_case(args, case: str, recover: str, scratch: Path, memory: Path) -> dict:
    """One kill: `scratch` on disk (the reports, the disk checkpoints), `memory` in /dev/shm (each
    machine's host memory, a directory per machine)."""
    machines = 3 if case == "recovery" else args.machines
    out, ckpt = scratch / "out", scratch / "ckpt"
    job = [str(REPO / "benchmarks" / "recovery_job.py"), "--out", str(out), "--ckpt", str(ckpt)]
    job += ["--snapshots", str(memory), "--recover", recover, "--steps", str(args.steps)]
    job += ["--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch)]
    victims = [1, 2] if case == "recovery" else [machines - 1]
    fraction = args.random.random()  # how far into the next step the kill comes (step and recovery cases)
    with netcluster.NetCluster(machines, log_dir=scratch / "logs") as cluster:
        cluster.launch(
            job,
            RANKS_PER_MACHINE,
            cwd=str(REPO),
            min_nodes=1,
            max_restarts=3,
            env=ELASTIC_ENV,
            rdzv_conf=RDZV_CONF,
        )
        _wait(lambda: args.kill_after in _steps_done(out), f"step {args.kill_after}", cluster, args.timeout)
        done = _steps_done(out)
        step_s = done[args.kill_after] - done.get(args.kill_after - 1, done[args.kill_after])
        if case == "snapshot":
            partial = memory / f"node{victims[0]}"
            _wait(
                lambda: any(p.name.startswith(".partial-") for p in partial.glob(".partial-*")),
                "a snapshot being written",
                cluster,
                args.timeout,
            )
        else:
            time.sleep(step_s * fraction)
        killed_at = time.time()
        cluster.kill_node(victims[0])
        shutil.rmtree(memory / f"node{victims[0]}", ignore_errors=True)
        if case == "recovery":  # the second machine while the restarted workers recover
            _wait(
                lambda: any(
                    r.get("phase") == "recovering" and r.get("node") == str(victims[1]) for r in _reports(out, 1)
                ),
                "recovery on the restarted workers",
                cluster,
                args.timeout,
            )
            cluster.kill_node(victims[1])
            shutil.rmtree(memory / f"node{victims[1]}", ignore_errors=True)
        results = cluster.wait(args.timeout, fail_grace_s=args.timeout)
    if results[0].returncode != 0:
        raise RuntimeError(f"{case}: machine 0 exit {results[0].returncode}\n{results[0].output[-4000:]}")
    before = {s: t for s, t in _steps_done(out).items() if t <= killed_at}
    last_restart = max(int(p.name.split(".restart")[1].split(".")[0]) for p in out.glob("rank0.restart*.json"))
    final = sorted(_reports(out, last_restart), key=lambda r: r["rank"])
    resumed = final[0]["resumed"]
    first_end = min(r["steps"][str(resumed)]["t_end"] for r in final)
    row = {
        "case": case,
        "recover": recover,
        "machines": machines,
        "survivors": final[0]["world"],
        "restarts": last_restart,
        "killed_after_step": max(before, default=-1),
        "resumed_at": resumed,
        "source": final[0]["source"],
        "reason": final[0]["reason"],
        "steps_redone": max(before, default=-1) + 1 - resumed,
        "step_s": step_s,
        "kill_into_step": None if case == "snapshot" else fraction,
        "to_engine_s": max(r["t_engine"] for r in final) - killed_at,
        "to_resumed_s": max(r["t_recovered"] for r in final) - killed_at,
        "resume_s": max(r["t_recovered"] - r["t_engine"] for r in final),
        "to_first_step_s": first_end - killed_at,
    }
    direct = scratch / "direct"
    argv = [*job, "--tag", f"global_step{resumed}", "--no-save"]
    argv[argv.index("--out") + 1] = str(direct)
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(row["survivors"]),
    ]
    result = subprocess.run(
        [*torchrun, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=args.timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if result.returncode != 0:
        raise RuntimeError(f"{case}: the direct run exit {result.returncode}\n{result.stderr[-4000:]}")
    theirs = sorted(_reports(direct, 0), key=lambda r: r["rank"])
    row["same_losses"] = all(
        {s: e["loss"] for s, e in mine["steps"].items()} == {s: e["loss"] for s, e in other["steps"].items()}
        for mine, other in zip(final, theirs)
    )
    return row


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(rows: list[dict]) -> str:
    head = (
        f"{'case':<9} {'from':<9} {'machines':>8} {'kill after':>10} {'resumed':>7} {'source':<10} {'redone':>6} "
        f"{'step s':>6} {'into':>4} {'->engine s':>10} {'->resumed s':>11} {'resume s':>8} {'->1st step s':>12} {'same losses':>11}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['case']:<9} {r['recover']:<9} {r['machines']:>4} -> {r['survivors'] // RANKS_PER_MACHINE:<1} "
            f"{r['killed_after_step']:>10} {r['resumed_at']:>7} {r['source']:<10} {r['steps_redone']:>6} "
            f"{r['step_s']:>6.2f} {_fraction(r['kill_into_step']):>4} {r['to_engine_s']:>10.2f} {r['to_resumed_s']:>11.2f} {r['resume_s']:>8.2f} "
            f"{r['to_first_step_s']:>12.2f} {str(r['same_losses']):>11}"
        )
    lines += [f"{r['case']} ({r['recover']}): {r['reason']}" for r in rows if r["reason"]]
    return "\n".join(lines)


CASES = {"step": "snapshot", "snapshot": "snapshot", "recovery": "snapshot", "step-disk": "disk"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"a comma-separated list of {', '.join(CASES)}")
    parser.add_argument("--machines", type=int, default=2, help="machines of 2 ranks (the recovery case: 3)")
    parser.add_argument("--layers", type=int, default=8, help="GPT layers (8 x 512 wide: 33.7M parameters)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=24, help="train_batch_size: divisible by 2, 4 and 6 ranks x 2")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill-after", type=int, default=2, help="the step after which the kill comes")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    parser.add_argument("--seed", type=int, default=0, help="where in a step the kills come")
    parser.add_argument("--disk", type=Path, default=None, help="where the disk checkpoints go (default: the temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--out", type=Path, default=None, help="also write the command and the table here")
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    if bad := [c for c in cases if c not in CASES]:
        parser.error(f"--cases {bad}: allowed {', '.join(CASES)}")
    args.random = random.Random(args.seed)
    if problem := netcluster.capability_problem():
        parser.error(f"needs root and network namespaces: {problem}")
    rows = []
    for case in cases:
        with (
            tempfile.TemporaryDirectory(prefix="zeroshard-recovery-", dir=args.disk) as scratch,
            tempfile.TemporaryDirectory(prefix="zeroshard-recovery-", dir="/dev/shm") as memory,
        ):
            started = time.monotonic()
            row = run_case(args, case.removesuffix("-disk"), CASES[case], Path(scratch), Path(memory))
            row["wall_s"] = time.monotonic() - started
            rows.append(row)
            print(json.dumps(row), flush=True)
    text = table(rows)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.out is not None:
        import torch

        header = f"# {time.strftime('%Y-%m-%d')}, torch {torch.__version__}\n"
        args.out.write_text(f"{header}$ python benchmarks/snapshot_recovery.py {' '.join(sys.argv[1:])}\n{text}\n")


if __name__ == "__main__":
    main()
