"""Where a training step's time goes: DDP and zeroshard stages 0-2, phase by phase, side by side.

    PYTHONPATH=src .venv/bin/python benchmarks/profile_phases.py [--steps 8] [--doc docs/performance.md]

Launches 2 local ranks (torchrun, gloo, 1 thread each, fp32) once. Every rank builds each system over
the same GPT (default: 8 layers, width 512, untied vocabulary 8192: 33.7M parameters), with torch's
fused AdamW, and the systems then take their steps *interleaved* (step i of every system, then step
i + 1 of every system), on the same batches, so that the machine's load drifts over all of them alike.
Every system computes the same update: zeroshard clips the global gradient norm at 1.0 unless told
otherwise (DeepSpeed's default `gradient_clipping`), so local, ddp and fsdp2 call torch's
`clip_grad_norm_` with the same bound (`--clip`, 0 for no clipping anywhere):

  * `local`: the bare model, no data parallelism: the compute floor of forward, backward and the step;
  * `ddp`: `DistributedDataParallel(gradient_as_bucket_view=True)`;
  * `stage 0/1/2/3`: `zeroshard.initialize` with the config `zeroshard bench` uses: the defaults a user
    gets (overlap_comm on, the collective check off), except that stage 3 shards every
    parameter (`stage3_param_persistence_threshold: 0`, as the bench does for its 3Psi volume);
  * `stage 1/2 step-gather` (not run unless named in --systems): the same with
    `zeroshard.overlap_param_gather: false`, step() waiting for the all-gather of updated parameters
    `stage 1/2 overlap` names the default explicitly;
  * `stage 0-3 copy` (not run unless named): the same with `zeroshard.transactional_step: "copy"`,
    to price the opt-in copy that undoes a step failing half-way (the default takes none,
    [Note: failed optimizer steps] in core/optim/rollback.py);
  * `stage 0-2 no-overlap` (not run unless named): the same with `overlap_comm: false`;
  * `stage 0-3 check` (not run unless named): the same with `zeroshard.check_collectives: true`,
    to price the debug mode's per-collective check;
  * `stage 3 persist`: stage 3 with the default `stage3_param_persistence_threshold` (1e5);
    `stage 2/3 2-in-flight`: two reductions in flight in backward instead of the default one (a what-if).

Each phase is timed as wall time and as the CPU time of the rank's main thread (`time.thread_time`;
gloo's own threads are not in it), which the machine's load distorts much less than wall time. The
phases inside zeroshard's backward and step are timed by wrapping, in this process only, the methods
that do them (`Lifecycle._on_grad`, `FlatGroup.add_grad`, `Unit.reduce_grads`, `Handle.wait`, ...);
`local`'s phases are the compute every system shares, so `ddp - local` is DDP's own overhead. A
table of exclusive times (a phase minus the phases timed inside it), medians over the timed steps,
averaged over the ranks, goes to stdout and, with `--doc`, between the markers of that file.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- profile_phases:begin -->", "<!-- profile_phases:end -->"
SYSTEMS = (
    "local",
    "ddp",
    "stage 0",
    "stage 1",
    "stage 2",
    "stage 1 overlap",
    "stage 2 overlap",
    "stage 3",
    "fsdp2",
    "stage 1 step-gather",
    "stage 2 step-gather",
    "stage 0 no-overlap",
    "stage 1 no-overlap",
    "stage 2 no-overlap",
    "stage 3 persist",
    "stage 2 2-in-flight",
    "stage 3 2-in-flight",
    "stage 0 copy",
    "stage 1 copy",
    "stage 2 copy",
    "stage 3 copy",
    "stage 0 check",
    "stage 1 check",
    "stage 2 check",
    "stage 3 check",
)
DEFAULT_SYSTEMS = SYSTEMS[:5]
# (label, path in the span tree) in display order; a path's exclusive time excludes its timed children.
ROWS = [
    ("forward", "forward"),
    ("backward: autograd compute", "backward"),
    ("backward: hook overhead (Python)", "backward/hook"),
    ("backward: gradient copy into flat buffer", "backward/hook/add_grad"),
    ("backward: pre-divide + issue reduction", "backward/hook/reduce_issue"),
    ("backward: waits inside backward", "backward/hook/wait"),
    ("backward: end_backward (rest)", "backward/end"),
    ("backward: end_backward waits", "backward/end/wait"),
    ("step: gradient norm (+ flags all-reduce)", "step/norm"),
    ("step: clip_grad_norm_ (torch)", "step/clip"),
    ('step: copy for a failed update ("copy")', "step/snapshot"),
    ("step: optimizer (fused AdamW)", "step/optimizer"),
    ("step: copy for a failed update, group by group", "step/optimizer/snapshot"),
    ("step: parameter all-gather (issue, copy)", "step/gather"),
    ("step: parameter all-gather waits", "step/gather/wait"),
    ("step: zero gradients", "step/zero_grad"),
    ("stage 3 forward: pre-forward hook", "forward/pre_forward"),
    ("stage 3 forward: all-gather issue", "forward/pre_forward/unshard"),
    ("stage 3 forward: prefetch issue", "forward/pre_forward/prefetch/unshard"),
    ("stage 3 forward: all-gather wait + point params", "forward/pre_forward/wait_unshard"),
    ("stage 3 forward: all-gather waits", "forward/pre_forward/wait_unshard/wait"),
    ("stage 3 forward: post-forward hook", "forward/post_forward"),
    ("stage 3 forward: free gathered", "forward/post_forward/reshard"),
    ("stage 3 backward: pre-backward hook", "backward/pre_backward"),
    ("stage 3 backward: all-gather issue", "backward/pre_backward/unshard"),
    ("stage 3 backward: prefetch issue", "backward/pre_backward/prefetch/unshard"),
    ("stage 3 backward: all-gather wait + point params", "backward/pre_backward/wait_unshard"),
    ("stage 3 backward: all-gather waits", "backward/pre_backward/wait_unshard/wait"),
    ("stage 3 backward: free gathered", "backward/hook/reshard"),
    ("step: rest", "step"),
    ("zero_grad (torch)", "zero_grad"),
]


class Spans:
    """Nested wall / thread-CPU timers; totals per path of the current step."""

    def __init__(self):
        self.stack: list[str] = []
        self.totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])

    @contextlib.contextmanager
    def span(self, name: str):
        path = "/".join([*self.stack, name]) if self.stack else name
        # A wait inside a wait, a hook inside a hook: count the outer one only.
        if self.stack and self.stack[-1].split("/")[-1] == name:
            yield
            return
        self.stack.append(name)
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.stack.pop()
            entry = self.totals[path]
            entry[0] += time.perf_counter() - wall
            entry[1] += time.thread_time() - cpu

    def take(self) -> dict[str, list[float]]:
        out, self.totals = dict(self.totals), defaultdict(lambda: [0.0, 0.0])
        return out


SPANS = Spans()


def _timed(cls, method: str, name: str) -> None:
    """Time `cls.method` as span `name` (this benchmark's process only)."""
    original = getattr(cls, method)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        with SPANS.span(name):
            return original(*args, **kwargs)

    setattr(cls, method, wrapper)


def instrument() -> None:
    from zeroshard.core import comm, group, lifecycle, unit
    from zeroshard.core.optim import optimizer, rollback

    _timed(lifecycle.Lifecycle, "_on_grad", "hook")
    _timed(lifecycle.Lifecycle, "end_backward", "end")
    _timed(group.FlatGroup, "add_grad", "add_grad")
    _timed(unit.Unit, "reduce_grads", "reduce_issue")
    _timed(comm.Handle, "wait", "wait")
    _timed(optimizer.ZeroOptimizer, "_norm_and_seen", "norm")
    _timed(rollback.Snapshot, "__init__", "snapshot")
    _timed(rollback.Snapshot, "keep", "snapshot")  # group by group, inside the update
    _timed(optimizer.ZeroOptimizer, "_apply", "optimizer")
    _timed(optimizer.ZeroOptimizer, "refresh_parameters", "gather")
    _timed(group.FlatGroup, "zero_grads", "zero_grad")
    # Stage 3's gather path ([Note: unit states]).
    _timed(lifecycle.Lifecycle, "_pre_forward", "pre_forward")
    _timed(lifecycle.Lifecycle, "_post_forward", "post_forward")
    _timed(lifecycle.Lifecycle, "_pre_backward", "pre_backward")
    _timed(lifecycle.Lifecycle, "_prefetch", "prefetch")
    _timed(unit.Unit, "unshard", "unshard")
    _timed(unit.Unit, "wait_unshard", "wait_unshard")
    _timed(unit.Unit, "reshard", "reshard")


# -- the ranks ------------------------------------------------------------------------------------------
def _system(kind: str, args, make_model, make_optimizer):
    """(forward, backward, step, zero_grad) callables of one system, over its own model."""
    import torch

    model = make_model()

    def torch_step(opt):  # the clipping zeroshard's config applies, as a torch script writes it
        from torch.nn.utils import clip_grad_norm_

        def step():
            if args.clip > 0:
                with SPANS.span("clip"):
                    clip_grad_norm_(model.parameters(), args.clip)
            opt.step()

        return step

    if kind == "local":
        opt = make_optimizer(model.parameters())
        return (
            lambda x, y: model(x, y)[1],
            lambda loss: loss.backward(),
            torch_step(opt),
            lambda: opt.zero_grad(set_to_none=True),
        )
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = make_optimizer(ddp.parameters())
        return (
            lambda x, y: ddp(x, y)[1],
            lambda loss: loss.backward(),
            torch_step(opt),
            lambda: opt.zero_grad(set_to_none=True),
        )
    if kind == "fsdp2":  # torch's stage 3, as `zeroshard bench --peers` builds it
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = make_optimizer(model.parameters())
        return (
            lambda x, y: model(x, y)[1],
            lambda loss: loss.backward(),
            torch_step(opt),
            lambda: opt.zero_grad(set_to_none=True),
        )
    import zeroshard

    stage = int(kind.split()[1])
    variant = kind.split()[2] if len(kind.split()) > 2 else ""
    zero = {"stage": stage}
    if variant == "no-overlap":  # each unit's reduction waited for before backward goes on
        zero["overlap_comm"] = False
    if stage == 3 and variant != "persist":  # as `zeroshard bench`: every parameter sharded (3 Psi)
        zero["stage3_param_persistence_threshold"] = 0
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": args.clip,
        "zero_optimization": zero,
        "bf16": {"enabled": False},
    }
    if variant in ("overlap", "step-gather"):  # [Note: deferred parameter gather]
        config["zeroshard"] = {"overlap_param_gather": variant == "overlap"}
    if variant == "copy":  # what the opt-in copy costs ([Note: failed optimizer steps])
        config["zeroshard"] = {"transactional_step": "copy"}
    if variant == "check":  # what the debug check costs ([Note: asynchronous collective check])
        config["zeroshard"] = {"check_collectives": True}
    engine, *_ = zeroshard.initialize(model=model, optimizer=make_optimizer(model.parameters()), config=config)
    if variant == "2-in-flight":  # a what-if, not a config key (as benchmarks/stage3_memory.py)
        engine.lifecycle.max_inflight = 2
    del torch
    return (lambda x, y: engine(x, y)[1], engine.backward, engine.step, lambda: None)


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    from zeroshard.tools.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    instrument()
    shape = GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq_len,
        n_layer=args.layers,
        n_head=args.width // 64,
        n_embd=args.width,
        tie_weights=False,
    )

    def make_model():
        torch.manual_seed(0)
        return GPT(shape)

    make_optimizer = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.0, fused=True)
    systems = {kind: _system(kind, args, make_model, make_optimizer) for kind in args.systems}
    generator = torch.Generator().manual_seed(1000 + rank)
    records: dict[str, list] = {kind: [] for kind in systems}
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=generator)
        x, y = tokens[:, :-1], tokens[:, 1:]
        for kind, (forward, backward, opt_step, zero_grad) in systems.items():
            dist.barrier()
            SPANS.take()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            wall, cpu, process = time.perf_counter(), time.thread_time(), time.process_time()
            with SPANS.span("forward"):
                loss = forward(x, y)
            with SPANS.span("backward"):
                backward(loss)
            with SPANS.span("step"):
                opt_step()
            with SPANS.span("zero_grad"):
                zero_grad()
            total = [time.perf_counter() - wall, time.thread_time() - cpu, time.process_time() - process]
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            if step >= args.warmup:
                records[kind].append({"total": total, "spans": SPANS.take(), "loss": loss.item(), "faults": faults})
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, records)
    if rank == 0:
        print("RESULT " + json.dumps(everyone), flush=True)
    dist.destroy_process_group()


# -- the parent -----------------------------------------------------------------------------------------
def _exclusive(spans: dict[str, list[float]], path: str, which: int) -> float:
    inclusive = spans.get(path, [0.0, 0.0])[which]
    depth = path.count("/") + 1
    children = sum(v[which] for p, v in spans.items() if p.startswith(path + "/") and p.count("/") == depth)
    return inclusive - children


def summarise(per_rank: list[dict]) -> dict:
    """Per system: median step (per step the slowest rank's wall time), and per row the median over
    steps of each rank's exclusive time, averaged over ranks; wall and CPU."""
    out = {}
    for kind in per_rank[0]:
        steps = len(per_rank[0][kind])
        slowest = [max(r[kind][i]["total"][0] for r in per_rank) for i in range(steps)]
        rows = {}
        for label, path in ROWS:
            rows[label] = [
                statistics.mean(
                    statistics.median(_exclusive(s["spans"], path, which) for s in r[kind]) for r in per_rank
                )
                for which in (0, 1)
            ]
        out[kind] = {
            "step_wall_s": statistics.median(slowest),
            "step_cpu_s": statistics.mean(statistics.median(s["total"][1] for s in r[kind]) for r in per_rank),
            "process_cpu_s": statistics.mean(statistics.median(s["total"][2] for s in r[kind]) for r in per_rank),
            "faults": statistics.mean(statistics.median(s["faults"] for s in r[kind]) for r in per_rank),
            "rows": rows,
            "losses": [s["loss"] for s in per_rank[0][kind]],
        }
    return out


def table(summary: dict) -> str:
    kinds = list(summary)
    head = "| phase (ms, wall / main-thread CPU) | " + " | ".join(kinds) + " |"
    lines = [head, "|---" * (len(kinds) + 1) + "|"]
    for label, _ in ROWS:
        cells = [summary[k]["rows"][label] for k in kinds]
        if all(abs(w) < 5e-4 and abs(c) < 5e-4 for w, c in cells):
            continue
        lines.append(f"| {label} | " + " | ".join(f"{w * 1e3:.0f} / {c * 1e3:.0f}" for w, c in cells) + " |")
    lines.append(
        "| **step, wall (slowest rank, median)** | "
        + " | ".join(f"**{summary[k]['step_wall_s'] * 1e3:.0f}**" for k in kinds)
        + " |"
    )
    lines.append(
        "| step, main-thread CPU | " + " | ".join(f"{summary[k]['step_cpu_s'] * 1e3:.0f}" for k in kinds) + " |"
    )
    lines.append(
        "| step, process CPU (all threads) | "
        + " | ".join(f"{summary[k]['process_cpu_s'] * 1e3:.0f}" for k in kinds)
        + " |"
    )
    # Minor faults, process-wide: first touches of fresh memory, which this VM makes expensive.
    lines.append(
        "| step, minor page faults (thousands, all threads) | "
        + " | ".join(f"{summary[k]['faults'] / 1e3:.1f}" for k in kinds)
        + " |"
    )
    if "ddp" in summary:
        ddp = summary["ddp"]["step_wall_s"]
        lines.append("| wall / DDP | " + " | ".join(f"{summary[k]['step_wall_s'] / ddp:.3f}" for k in kinds) + " |")
    return "\n".join(lines)


def tree(per_rank: list[dict]) -> str:
    """Every timed path (not only ROWS), exclusive ms wall / CPU, median over steps, mean over ranks."""
    lines = []
    for kind in per_rank[0]:
        paths = sorted({p for r in per_rank for s in r[kind] for p in s["spans"]})
        lines.append(f"{kind}:")
        for path in paths:
            cells = [
                statistics.mean(
                    statistics.median(_exclusive(s["spans"], path, which) for s in r[kind]) for r in per_rank
                )
                for which in (0, 1)
            ]
            lines.append(f"  {path:60s} {cells[0] * 1e3:8.0f} / {cells[1] * 1e3:6.0f}")
    return "\n".join(lines)


def compare(args, versions: list[tuple[str, str]]) -> str:
    """Launch each version (a source tree on PYTHONPATH) in turn, `--rounds` times, A B A B: DDP runs in
    every launch, so each version's ratio is taken against the DDP of its own launch."""
    runs: dict[str, list[dict]] = {name: [] for name, _ in versions}
    for _ in range(args.rounds):
        for name, src in versions:
            runs[name].append(summarise(_launch(args, {"PYTHONPATH": os.path.abspath(src)})))
    kinds = [k for k in args.systems if k != "local"]
    lines = [
        "| version | "
        + " | ".join(f"{k} s/step (x DDP)" for k in kinds)
        + " | main-thread CPU s/step, "
        + ", ".join(kinds)
        + " |",
        "|---" * (len(kinds) + 2) + "|",
    ]
    for name, _ in versions:
        cells = []
        for kind in kinds:
            wall = statistics.median(r[kind]["step_wall_s"] for r in runs[name])
            ratio = statistics.median(r[kind]["step_wall_s"] / r["ddp"]["step_wall_s"] for r in runs[name])
            cells.append(f"{wall:.2f} ({ratio:.2f}x)")
        cpu = ", ".join(f"{statistics.median(r[k]['step_cpu_s'] for r in runs[name]):.2f}" for k in kinds)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {cpu} |")
    return "\n".join(lines)


def _launch(args, env_extra: dict) -> list[dict]:
    if args.link_rate:
        return _launch_on_netcluster(args, env_extra)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        __file__,
        "--rank",
        *_rank_args(args),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    return _result(done.stdout, f"the ranks failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def _result(output: str, failure: str) -> list[dict]:
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise SystemExit(failure)
    return json.loads(lines[-1][len("RESULT ") :])


def _launch_on_netcluster(args, env_extra: dict) -> list[dict]:
    """The two ranks on two "machines": network namespaces joined by a link of --link-rate
    (scripts/netcluster.py, docs/multinode.md; needs root)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import netcluster

    if problem := netcluster.capability_problem():
        raise SystemExit(f"--link-rate needs network namespaces: {problem}")
    with netcluster.NetCluster(2, rate_bps=netcluster.rate_argument(args.link_rate)) as cluster:
        cluster.launch([__file__, "--rank", *_rank_args(args)], 1, cwd=str(REPO), env=env_extra)
        results = cluster.wait(3600)
    return _result(results[0].output, "a node failed:\n" + "\n".join(r.output[-3000:] for r in results))


def _rank_args(args) -> list[str]:
    return [
        "--layers",
        str(args.layers),
        "--width",
        str(args.width),
        "--vocab",
        str(args.vocab),
        "--seq-len",
        str(args.seq_len),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--clip",
        str(args.clip),
        "--systems",
        ",".join(args.systems),
    ]


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="micro batch per rank")
    parser.add_argument(
        "--clip",
        type=float,
        default=1.0,
        help="gradient clipping for every system: zeroshard's `gradient_clipping` (its default "
        "1.0, DeepSpeed's), torch's clip_grad_norm_ for local, ddp and fsdp2; 0: none",
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated, of: {', '.join(SYSTEMS)}"
    )
    parser.add_argument("--doc", type=Path, help="rewrite the table between the markers of this file")
    parser.add_argument("--tree", action="store_true", help="also print every timed path's exclusive time")
    parser.add_argument("--json", type=Path, help="write the raw per-rank, per-step figures here")
    parser.add_argument(
        "--compare",
        help="NAME=SRC,NAME=SRC: source trees to launch in turn, A B A B "
        "(e.g. before=/path/to/main/src,after=src); prints a step-time table",
    )
    parser.add_argument("--rounds", type=int, default=2, help="with --compare: launches per version")
    parser.add_argument(
        "--link-rate",
        help="run the ranks on two network namespaces joined by a link of this "
        "rate (e.g. 1gbit; scripts/netcluster.py, root only)",
    )
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"--systems: unknown {unknown}; allowed: {', '.join(SYSTEMS)}")
    if args.rank:
        rank_main(args)
        return
    load_before = _load()
    if args.compare:
        versions = [tuple(item.split("=", 1)) for item in args.compare.split(",")]
        if any(len(v) != 2 or not Path(v[1]).is_dir() for v in versions):
            parser.error(f"--compare {args.compare!r}: expected NAME=SRC_DIR,NAME=SRC_DIR with existing directories")
        text = compare(args, versions)
        print(
            text + f"\n\nload average before: {load_before}, after: {_load()}; {args.rounds} launches per version, "
            f"A B A B; medians over launches of each launch's median step"
        )
        return
    per_rank = _launch(args, {})
    summary = summarise(per_rank)
    text = table(summary)
    where = (
        f"2 network namespaces joined by a {args.link_rate} link (tbf), one rank each" if args.link_rate else "2 ranks"
    )
    machine = (
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.machine()}, "
        f"{os.cpu_count()} CPUs (shared with other jobs), torch gloo, {where} x 1 thread; load average "
        f"(1, 5, 15 min) before: {load_before}, after: {_load()}. Command: `python benchmarks/profile_phases.py "
        f"{shlex.join(sys.argv[1:])}`. Model: GPT {args.layers} layers x {args.width}, vocabulary {args.vocab} "
        f"untied, seq {args.seq_len}, micro batch {args.batch}/rank, fp32, fused AdamW, "
        f"{f'gradients clipped at {args.clip:g} by every system' if args.clip > 0 else 'no clipping'}; {args.steps} timed "
        f"steps after {args.warmup}, interleaved."
    )
    print(text + "\n\n" + machine)
    if args.tree:
        print(tree(per_rank))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "per_rank": per_rank}, indent=1))
    if args.doc:
        doc = args.doc.read_text()
        if BEGIN not in doc or END not in doc:
            raise SystemExit(f"{args.doc} has no {BEGIN} ... {END} markers")
        head, rest = doc.split(BEGIN, 1)
        args.doc.write_text(head + BEGIN + "\n" + text + "\n\n" + machine + "\n" + END + rest.split(END, 1)[1])


if __name__ == "__main__":
    main()
