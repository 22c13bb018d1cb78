"""Where stage 3's peak memory per rank comes from: the high-water mark after forward, after backward
and after the optimizer step, on the bench's GPT family member (default k=16: 16 layers, width 1024,
~202M parameters), for several `zero_optimization` settings side by side.

    python benchmarks/stage3_memory.py --out docs/bench/stage3_memory

Each setting runs in its own 2-rank gloo launch (1 torch thread per rank, fp32, torch's fused AdamW,
random tokens of a 256-token vocabulary, micro-batch --batch x --seq-len): one warm-up step (records the
unit orders), then one measured step. Memory is the kernel's RSS high-water mark (VmHWM, reset through
/proc/self/clear_refs before the forward) with MALLOC_MMAP_THRESHOLD_=65536, as `zeroshard bench`
measures it ([Note: measuring peak memory] in tools/bench/measure.py); each figure is cumulative from
the reset, so "after step" is the step's peak, the bench's figure. `live` is the most parameter
elements the units had gathered at once during that forward and backward ([Note: bounded gathering]
in core/gathered.py). Memory does not depend on machine load: one measured step is enough.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VARIANTS = {
    "default": ({}, {}),
    "deepspeed-values": ({"stage3_prefetch_bucket_size": 50_000_000, "stage3_max_live_parameters": 10**9,
                          "stage3_max_reuse_distance": 10**9}, {}),
    "default+no-snapshot": ({}, {"transactional_step": False}),
}
VOCAB = 256


def _rank(rank: int, world: int, port: int, args: dict, zero: dict, extras: dict, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import zeroshard
    from zeroshard.tools.bench import family, measure
    from zeroshard.tools.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**family.gpt_shape(args["size"], VOCAB, args["seq_len"])))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    config = {"train_micro_batch_size_per_gpu": args["batch"], "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 0,
                                    **zero},
              "zeroshard": extras}
    engine, *_ = zeroshard.initialize(model=model, optimizer=optimizer, config=config)
    del model
    generator = torch.Generator().manual_seed(rank)
    meter = measure.PeakMemory(torch.device("cpu"))

    def loss():
        tokens = torch.randint(VOCAB, (args["batch"], args["seq_len"] + 1), generator=generator)
        logits = engine(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    engine.backward(loss())
    engine.step()
    measure.trim()
    live = engine.sharded.lifecycle.live
    live.reset_peak()
    start = meter.current()
    meter.reset()
    out = loss()
    after_forward = meter.peak()
    engine.backward(out)
    after_backward, live_peak = meter.peak(), live.peak
    engine.step()
    after_step = meter.peak()
    states = engine.memory_report()["total"]
    queue.put({"rank": rank, "start": start, "after_forward": after_forward, "after_backward": after_backward,
               "after_step": after_step, "live_peak_numel": live_peak, "model_states": states,
               "method": meter.method})
    dist.barrier()
    os._exit(0)  # see tests/harness.py: gloo may abort at interpreter teardown


def run_variant(args: dict, zero: dict, extras: dict, port: int) -> list[dict]:
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_rank, args=(r, 2, port, args, zero, extras, queue)) for r in range(2)]
    for p in procs:
        p.start()
    reports = sorted((queue.get(timeout=3600) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(timeout=60)
    return reports


def table(results: dict) -> str:
    mb = 1e6
    lines = ["setting                            live peak (elements)  model states  start  after fwd  "
             "after bwd  after step   (MB per rank, the larger rank)"]
    for name, reports in results.items():
        worst = max(reports, key=lambda r: r["after_step"])
        lines.append(f"{name:34s} {worst['live_peak_numel']:>20,d} {worst['model_states'] / mb:>13.0f} "
                     f"{worst['start'] / mb:>6.0f} {worst['after_forward'] / mb:>10.0f} "
                     f"{worst['after_backward'] / mb:>10.0f} {worst['after_step'] / mb:>11.0f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=16, help="GPT family member k (default: 16)")
    parser.add_argument("--batch", type=int, default=4, help="micro batch per rank (default: 4)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default: 128)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of: {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--port", type=int, default=29613)
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.txt")
    ns = parser.parse_args(argv)
    names = [n.strip() for n in ns.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; allowed: {list(VARIANTS)}")
    if ns.size < 1 or ns.batch < 1 or ns.seq_len < 1:
        parser.error(f"--size, --batch and --seq-len must be >= 1, got {ns.size}, {ns.batch}, {ns.seq_len}")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    args = {"size": ns.size, "batch": ns.batch, "seq_len": ns.seq_len}
    results = {}
    for offset, name in enumerate(names):
        zero, extras = VARIANTS[name]
        results[name] = run_variant(args, zero, extras, ns.port + offset)
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
