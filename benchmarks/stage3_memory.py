"""Where stage 3's peak memory per rank comes from, phase by phase (forward, backward, optimizer step),
on the bench's GPT family member (default k=16: 16 layers, width 1024, ~202M parameters), for several
`zero_optimization` settings and torch's FSDP2 side by side.

    python benchmarks/stage3_memory.py --out docs/bench/stage3_memory
    python benchmarks/stage3_memory.py --stage 2 --variants default,default+copy

`--stage N` runs the zeroshard variants at stage N (0-3; the gradient shard's lifetime is the same code at 2 and 3).

Each setting runs in its own 2-rank gloo launch (1 torch thread per rank, fp32, torch's AdamW, fused
unless `--optimizer plain`, random tokens of a 256-token vocabulary, micro-batch --batch x --seq-len):
one warm-up step (records the unit orders), then one measured step; with `--first-step` the first step
itself is measured, the one that creates the optimizer state, as a user's run and the shared peers
harness count it. Memory is the kernel's RSS high-water mark (VmHWM) with
MALLOC_MMAP_THRESHOLD_=65536, as `zeroshard bench` measures it ([Note: measuring peak memory] in
tools/bench/measure.py), reset through /proc/self/clear_refs at the start of each phase, so each
phase's figure is its own peak; `peak` is the largest of them, the bench's figure. `rss` is the
resident memory at the end of a phase, `grads` the bytes of gradients held at the start of the forward
and at the end of the backward (zeroshard's flat gradient shards and full gradients; FSDP2's
`param.grad`), `snapshot` what the opt-in `zeroshard.transactional_step: "copy"` copied (0 by default,
which takes no copy: [Note: failed optimizer steps] in core/optim/rollback.py). `live` is the most parameter elements the units had gathered at once during that
forward and backward ([Note: bounded gathering] in core/gathered.py). Memory does not depend on
machine load: one measured step is enough.
"""

from __future__ import annotations

import argparse
import json
import os
import queue as queue_module
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# name -> (zero_optimization keys, "zeroshard" keys, reductions in flight in backward or None for the
# default): zeroshard at --stage, or None: FSDP2 (torch.distributed.fsdp.fully_shard on every block and
# the root, as tools/bench/peers.py runs it). The in-flight count is a what-if of this script (the
# engine's Lifecycle.max_inflight, 1 with overlap_comm by default, 2 to compare), not a config key.
VARIANTS = {
    "default": ({}, {}, None),
    "deepspeed-values": (
        {
            "stage3_prefetch_bucket_size": 50_000_000,
            "stage3_max_live_parameters": 10**9,
            "stage3_max_reuse_distance": 10**9,
        },
        {},
        None,
    ),
    "default+copy": ({}, {"transactional_step": "copy"}, None),  # the opt-in copy of a failed step's state
    "default+1-in-flight": ({}, {}, 1),  # the default, named for comparisons with 2 in flight
    "default+2-in-flight": ({}, {}, 2),
    "fsdp2": None,
}
VOCAB = 256


def _grad_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None and t.untyped_storage().size())


def _zeroshard(args: dict, model, optimizer, zero: dict, extras: dict, inflight: int | None):
    """(forward, backward, step, grad bytes held, snapshot bytes, live count, model states) of a
    zeroshard engine at stage args["stage"]."""
    import zeroshard

    config = {
        "train_micro_batch_size_per_gpu": args["batch"],
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": args["stage"],
            "overlap_comm": True,
            "stage3_param_persistence_threshold": 0,
            **zero,
        },
        "zeroshard": extras,
    }
    engine, *_ = zeroshard.initialize(model=model, optimizer=optimizer, config=config)
    if inflight is not None:
        engine.lifecycle.max_inflight = inflight
    groups = engine.groups

    def grads() -> int:
        return _grad_bytes([t for g in groups for t in (g.grad_shard, g.full_grad)])

    return (
        engine,
        engine.backward,
        engine.step,
        grads,
        lambda: getattr(engine.optimizer, "snapshot_peak_bytes", None),
        engine.lifecycle.live,
        lambda: engine.memory_report()["total"],
    )


def _fsdp2(model, optimizer_of):
    """The same for torch's FSDP2, as `zeroshard bench --peers` runs it (tools/bench/peers.py)."""
    from torch.distributed.fsdp import fully_shard

    from zeroshard.tools.bench import measure

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = optimizer_of(model.parameters())

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def grads() -> int:
        return measure.tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)

    def states() -> int:  # parameter shards, their gradient shards (allocated in backward), AdamW's state
        return 2 * measure.tensor_bytes(model.parameters()) + measure.optimizer_state_bytes(optimizer)

    return model, lambda loss: loss.backward(), step, grads, lambda: 0, None, states


def _rank(rank: int, world: int, port: int, args: dict, name: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from zeroshard.tools.bench import family, measure
    from zeroshard.tools.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**family.gpt_shape(args["size"], VOCAB, args["seq_len"])))

    def optimizer_of(params):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, fused=args["optimizer"] == "fused")

    if VARIANTS[name] is None:
        forward, backward, step, grads, snapshot, live, states = _fsdp2(model, optimizer_of)
    else:
        forward, backward, step, grads, snapshot, live, states = _zeroshard(
            args, model, optimizer_of(model.parameters()), *VARIANTS[name]
        )
        del model
    generator = torch.Generator().manual_seed(rank)
    meter = measure.PeakMemory(torch.device("cpu"))

    def loss():
        tokens = torch.randint(VOCAB, (args["batch"], args["seq_len"] + 1), generator=generator)
        logits = forward(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    if not args["first_step"]:
        backward(loss())
        step()
    measure.trim()
    if live is not None:
        live.reset_peak()
    report = {"rank": rank, "start": meter.current(), "grads_at_forward": grads(), "method": meter.method}
    meter.reset()
    out = loss()
    report.update(forward_peak=meter.peak(), forward_rss=meter.current())
    meter.reset()
    backward(out)
    del out
    report.update(backward_peak=meter.peak(), backward_rss=meter.current(), grads_after_backward=grads())
    meter.reset()
    step()
    report.update(
        step_peak=meter.peak(),
        step_rss=meter.current(),
        snapshot=snapshot(),
        live_peak_numel=live.peak if live is not None else 0,
        model_states=states(),
    )
    report["peak"] = max(report["forward_peak"], report["backward_peak"], report["step_peak"])
    queue.put(report)
    dist.barrier()
    # put() hands the report to a feeder thread; os._exit would not wait for it to reach the pipe
    # (a launch once hung with both ranks exited and no report), so flush it first.
    queue.close()
    queue.join_thread()
    os._exit(0)  # see tests/harness.py: gloo may abort at interpreter teardown


def _rank_reporting(rank: int, world: int, port: int, args: dict, name: str, queue) -> None:
    """`_rank`, and a report of its failure (the parent stops waiting at once instead of at its timeout)."""
    try:
        _rank(rank, world, port, args, name, queue)
    except BaseException as error:  # noqa: BLE001 - every failure is reported
        queue.put({"rank": rank, "error": f"{type(error).__name__}: {error}"})
        queue.close()
        queue.join_thread()
        os._exit(1)


def run_variant(args: dict, name: str, port: int, timeout_s: float) -> list[dict]:
    """Both ranks' reports; raises (and stops the ranks) when a rank fails, dies without a report
    or the variant runs past `timeout_s`."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_rank_reporting, args=(r, 2, port, args, name, queue)) for r in range(2)]
    for p in procs:
        p.start()
    reports, deadline = [], time.monotonic() + timeout_s
    try:
        while len(reports) < len(procs):
            # Whether a rank is dead is read before the queue, so a report sent just before its
            # rank exited is still found there.
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            try:
                report = queue.get(timeout=1.0)
            except queue_module.Empty:
                if dead:
                    raise RuntimeError(f"variant {name!r}: a rank exited with {dead[0]} without a report") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"variant {name!r}: no report within {timeout_s:.0f} s") from None
                continue
            if "error" in report:
                raise RuntimeError(f"variant {name!r}: rank {report['rank']} failed: {report['error']}")
            reports.append(report)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return sorted(reports, key=lambda r: r["rank"])


COLUMNS = [
    ("start", "start"),
    ("grads_at_forward", "grads@fwd"),
    ("forward_peak", "fwd peak"),
    ("forward_rss", "fwd rss"),
    ("backward_peak", "bwd peak"),
    ("backward_rss", "bwd rss"),
    ("grads_after_backward", "grads@bwd"),
    ("step_peak", "step peak"),
    ("snapshot", "snapshot"),
    ("model_states", "states"),
    ("peak", "PEAK"),
]


def table(results: dict) -> str:
    """MB per rank (1e6 bytes), the rank with the larger peak."""
    mb = 1e6
    lines = [f"{'setting':22s} {'live (elements)':>16s} " + " ".join(f"{label:>10s}" for _, label in COLUMNS)]
    for name, reports in results.items():
        worst = max(reports, key=lambda r: r["peak"])
        cells = " ".join("         -" if worst[key] is None else f"{worst[key] / mb:>10.0f}" for key, _ in COLUMNS)
        lines.append(f"{name:22s} {worst['live_peak_numel']:>16,d} {cells}")
    return (
        "\n".join(lines)
        + "\n(MB per rank, the rank with the larger peak; each phase's peak is its own, reset at its start)"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=16, help="GPT family member k (default: 16)")
    parser.add_argument("--batch", type=int, default=4, help="micro batch per rank (default: 4)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default: 128)")
    parser.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3), help="zeroshard's stage (default: 3)")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)} (default: all)"
    )
    parser.add_argument("--optimizer", choices=("fused", "plain"), default="fused", help="torch's AdamW kernel")
    parser.add_argument("--first-step", action="store_true", help="measure the first step, not the second")
    parser.add_argument("--port", type=int, default=29613)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a variant may run (default: 1800)")
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.txt")
    ns = parser.parse_args(argv)
    names = [n.strip() for n in ns.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; allowed: {list(VARIANTS)}")
    if ns.size < 1 or ns.batch < 1 or ns.seq_len < 1:
        parser.error(f"--size, --batch and --seq-len must be >= 1, got {ns.size}, {ns.batch}, {ns.seq_len}")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    args = {
        "size": ns.size,
        "batch": ns.batch,
        "seq_len": ns.seq_len,
        "stage": ns.stage,
        "optimizer": ns.optimizer,
        "first_step": ns.first_step,
    }
    results = {}
    for offset, name in enumerate(names):
        results[name] = run_variant(args, name, ns.port + offset, ns.timeout)
        print(f"done: {name}", file=sys.stderr, flush=True)
    text = f"$ python benchmarks/stage3_memory.py {' '.join(argv if argv is not None else sys.argv[1:])}\n\n"
    text += table(results) + "\n"
    print(text)
    if ns.out is not None:
        ns.out.parent.mkdir(parents=True, exist_ok=True)
        ns.out.with_suffix(".json").write_text(json.dumps({"args": args, "results": results}, indent=1))
        ns.out.with_suffix(".txt").write_text(text)


if __name__ == "__main__":
    main()
