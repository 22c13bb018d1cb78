"""The job the multi-node tests launch under torchrun: train the tiny GPT, report per-rank losses as JSON.

    torchrun ... -m tests.multinode_job --out DIR --stages 0,1,2,3 --steps 3
    torchrun ... -m tests.multinode_job --out DIR --stages 1 --steps 500 --save-at 2 --ckpt CK --progress
    torchrun ... -m tests.multinode_job --out DIR --stages 1 --steps 3 --resume CK
    torchrun ... -m tests.multinode_job --out DIR --first-stages 0,1,2 --stages 3 --steps 500 --save-at 2 ...

Each rank writes DIR/rank<R>.json: {"rank", "world", "node", "stages": {"<stage>": {"losses": [...],
"params_sha256": ...}}}, and on failure DIR/rank<R>.error.json: {"type", "message", "since_last_step_s"}
(the exception's class name is what the fault test checks). With --progress the report is rewritten after
every step, so a rank killed mid-run leaves the losses of the steps it finished.

Data is a fixed function of (step, rank) (tests.reference.gpt_batches), so any launch with the same world
size — one node, two nodes, a resumed run — sees the same batches at the same global rank and step.
Runs on the repository root's sys.path: launch with `-m` from the repository root.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

import zeroshard
from tests.reference import gpt_batches, gpt_loss
from tests.zs_common import adamw, full_params, gpt_model_fn, make_config
from zeroshard.tools.models.gpt import tiny_gpt_config

POINTS = ("init_process_group", "initialize", "training")  # where --markers marks, in order
TERM_GRACE_S = 8.0  # after torchrun's SIGTERM: time to meet this rank's own error and report it


def _report_before_leaving_on_sigterm() -> None:
    """Once one worker of a node fails, torchrun SIGTERMs the others. On a loaded box a rank may still be
    computing when its node-mate's error lands, and would die with no report of its own; instead it
    keeps going for up to TERM_GRACE_S, meets its own CollectiveError and reports it (main's handler),
    or leaves with SIGTERM's status when the grace runs out (a thread: the main thread may be inside
    a collective's wait, where a Python handler cannot run)."""

    def leave_later(signum, frame):
        threading.Timer(TERM_GRACE_S, os._exit, (128 + signal.SIGTERM,)).start()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends it at once

    signal.signal(signal.SIGTERM, leave_later)


def _stages(text: str) -> list[int]:
    try:
        stages = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        stages = []
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise argparse.ArgumentTypeError(f"--stages {text!r}: a comma-separated list of 0, 1, 2, 3")
    return stages


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for rank<R>.json")
    parser.add_argument("--stages", type=_stages, default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per stage")
    parser.add_argument(
        "--first-stages", type=_stages, default=[], help="stages trained for FIRST_STEPS steps each before --stages"
    )
    parser.add_argument("--first-steps", type=int, default=3, help="optimizer steps per --first-stages stage")
    parser.add_argument("--comm-timeout-s", type=float, default=60.0, help="zeroshard.comm_timeout_s")
    parser.add_argument(
        "--init-timeout-s", type=float, default=None, help="init_process_group's timeout (default: --comm-timeout-s)"
    )
    parser.add_argument("--save-at", type=int, default=None, help="save a checkpoint after this many steps")
    parser.add_argument("--ckpt", type=Path, default=None, help="checkpoint directory (--save-at, --resume)")
    parser.add_argument("--resume", action="store_true", help="load --ckpt first, continue from its step")
    parser.add_argument("--progress", action="store_true", help="rewrite the report after every step")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="stop training after this long")
    parser.add_argument("--markers", type=Path, default=None, help="write <point>.rank<R> here at each start-up point")
    parser.add_argument("--hold-at", choices=POINTS, default=None, help="with --hold-node: where its ranks stop")
    parser.add_argument("--hold-node", type=int, default=None, help="this node's ranks sleep at --hold-at")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.first_steps < 1:
        parser.error(f"--steps {args.steps}, --first-steps {args.first_steps}: at least 1")
    if set(args.first_stages) & set(args.stages):
        parser.error(f"--first-stages {args.first_stages} and --stages {args.stages} share a stage")
    if (args.save_at is not None or args.resume) and (args.ckpt is None or len(args.stages) != 1):
        parser.error("--save-at / --resume need --ckpt and exactly one stage in --stages")
    return args


def params_sha256(engine) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(full_params(engine).items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


class Reporter:
    """This rank's JSON report, written atomically (a reader never sees half a file)."""

    def __init__(self, out: Path, rank: int, world: int):
        self.path, self.last_step = out / f"rank{rank}.json", time.monotonic()
        self.body = {
            "rank": rank,
            "world": world,
            "node": int(os.environ.get("NETCLUSTER_NODE", 0)),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "stages": {},
            "done": False,
        }

    def write(self, path: Path | None = None, body: dict | None = None) -> None:
        path = path or self.path
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body if body is not None else self.body))
        os.replace(tmp, path)

    def error(self, exc: BaseException) -> None:
        self.write(
            self.path.with_suffix(".error.json"),
            {
                "type": type(exc).__name__,
                "message": str(exc),
                "since_last_step_s": time.monotonic() - self.last_step,
                "at": time.time(),  # wall clock, to compare with when a test killed a node
            },
        )


def train_stage(stage: int, args, report: Reporter, deadline: float, *, first: bool = False) -> None:
    """Train `stage` for --steps steps (--first-steps for one of --first-stages, which neither save nor
    resume)."""
    steps = args.first_steps if first else args.steps
    batches = gpt_batches(tiny_gpt_config(), batch_size=4)
    config = make_config(stage)
    config["zeroshard"] = {"comm_timeout_s": args.comm_timeout_s}
    model = gpt_model_fn()()
    reach("initialize", args)
    engine, _, _, _ = zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config=config)
    start = 0
    if args.resume and not first:
        _, client_state = engine.load_checkpoint(args.ckpt)
        start = client_state["step"]
    record = report.body["stages"].setdefault(str(stage), {"first_step": start, "losses": []})
    for step in range(start, start + steps):
        if time.monotonic() > deadline:
            break
        inputs, targets = batches(step, 0, engine.global_rank)
        loss = gpt_loss(engine, inputs, targets)
        engine.backward(loss)
        engine.step()
        record["losses"].append(loss.item())
        report.last_step = time.monotonic()
        if step == start:
            reach("training", args)
        if args.save_at is not None and step + 1 == args.save_at and not first:
            engine.save_checkpoint(args.ckpt, client_state={"step": step + 1})
            record["saved_at"] = step + 1
        if args.progress:
            report.write()
    record["params_sha256"] = params_sha256(engine)
    record["comm"] = engine.comm_report()
    engine.destroy()


def reach(point: str, args) -> None:
    """Mark that this rank reached `point` (--markers); on --hold-node, stay there until killed."""
    if args.markers is None:
        return
    rank = int(os.environ["RANK"])
    args.markers.mkdir(parents=True, exist_ok=True)
    (args.markers / f"{point}.rank{rank}").write_text(str(time.time()))
    if point == args.hold_at and int(os.environ.get("NETCLUSTER_NODE", 0)) == args.hold_node:
        while True:  # a machine that stopped here; the test kills it
            time.sleep(60)


def main(argv=None, *, leave: bool = True) -> None:
    """Run the job. `leave`: end the process with os._exit once the report is written, as under
    torchrun; False, for a test's kept ranks (tests.harness): return, or raise after reporting."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # torchrun's
    report = Reporter(args.out, rank, world)
    if leave:
        _report_before_leaving_on_sigterm()
    torch.set_num_threads(1)
    try:
        reach("init_process_group", args)
        # Nothing may wait longer than that; the fault runs give start-up (4 ranks importing torch) more.
        zeroshard.init_distributed(timeout_s=args.init_timeout_s or args.comm_timeout_s)
        deadline = time.monotonic() + args.max_seconds
        for stage in args.first_stages:
            train_stage(stage, args, report, deadline, first=True)
        for stage in args.stages:
            train_stage(stage, args, report, deadline)
    except Exception as exc:  # reported, then re-raised or left without gloo's teardown
        report.error(exc)
        if not leave:
            raise
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    report.body["done"] = True
    report.write()
    if not leave:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # torch 2.13 + gloo may abort at interpreter teardown after all work is done (tests/harness.py):
    # the report is written, so leave without it.
    os._exit(0)


if __name__ == "__main__":
    main()
