"""Rank side of `zeroshard bench`: every configuration of the spec, one after another, in one process group.

Launched by `launch.py` as `torchrun --nproc_per_node N -m zeroshard.tools.bench.worker RUN_DIR`. For each
configuration: build the same model from the same seed, train `warmup` steps, count one step's
communication, then time `steps` steps (per step the slowest rank) while tracking peak memory (see
[Note: measuring peak memory] in measure.py). Between configurations everything is freed and trimmed, so
each one starts from the same baseline.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from zeroshard.tools.bench import measure, peers
from zeroshard.tools.bench.rank import RankContext, run_rank
from zeroshard.tools.bench.subject import Subject, zeroshard_subject
from zeroshard.tools.deepspeed_defaults import DEFAULTS as DS_DEFAULTS
from zeroshard.tools.demo.corpus import Batches, CharTokenizer, load_corpus
from zeroshard.tools.models.gpt import GPT, GPTConfig

log = logging.getLogger(__name__)


# DeepSpeed's stage-3 gathering values (its defaults, as recorded in tools/deepspeed_defaults.py): what
# DeepSpeed's own rows run with, and a row of zeroshard given them (run["gathering"] == "deepspeed").
DEEPSPEED_GATHERING = {
    key: DS_DEFAULTS[f"zero_optimization.{key}"]
    for key in (
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
    )
}


def ds_config(spec: dict, run: dict) -> dict:
    zero = {
        "stage": run["stage"],
        # zeroshard's default at every stage, DeepSpeed's at stage 3 only: on for both, so that every
        # system reduces gradients under the backward, as DDP and FSDP2 do.
        "overlap_comm": True,
    }
    if run["kind"] == "deepspeed" or run.get("gathering") == "deepspeed":
        zero.update(DEEPSPEED_GATHERING)
    else:  # zeroshard's own gathering (GatheringPolicy()): every parameter sharded, exactly 3Ψ at stage 3
        zero["stage3_param_persistence_threshold"] = 0
    if run.get("offload_optimizer"):
        zero["offload_optimizer"] = {"device": run["offload_optimizer"]}
    if run.get("offload_param"):
        zero["offload_param"] = {"device": run["offload_param"]}
    # No optimizer section: every system is handed the same torch optimizer (bench_optimizer), and
    # zeroshard runs with the defaults a user gets (the cross-rank collective check stays on). The
    # clipping is spelled out because the torch peers apply it too (peers.build): the same update.
    return {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": spec.get("clip", 1.0),
        "zero_optimization": zero,
        "bf16": {"enabled": spec["precision"] == "bf16"},
    }


def bench_optimizer(spec: dict) -> functools.partial:
    """The one optimizer object every system gets: torch's AdamW, with the fused kernel (what zeroshard's
    config-built AdamW uses, and DeepSpeed's FusedAdam counterpart) or, with `spec["adamw"] ==
    "default"`, the kernel torch picks when none is named. A partial, so that ZeroRedundancyOptimizer
    can take its class and keywords."""
    fused = True if spec.get("adamw", "fused") == "fused" else None
    return functools.partial(torch.optim.AdamW, lr=spec["lr"], weight_decay=0.0, fused=fused)


def build_subject(spec: dict, run: dict, vocab: int, device: torch.device) -> Subject:
    """The system `run` names, over the spec's GPT built from its seed (vocabulary `spec["vocab"]`, else
    `vocab`), handed the bench's optimizer and config."""
    torch.manual_seed(spec["seed"])
    model = GPT(GPTConfig(**{**spec["shape"], "vocab_size": spec.get("vocab") or vocab}))
    make_optimizer = bench_optimizer(spec)
    if run["kind"] == "zeroshard":
        return zeroshard_subject(model, ds_config(spec, run), device, make_optimizer)
    return peers.build(run, model, device, ds_config(spec, run), make_optimizer)


class Bench:
    """The shared inputs of every configuration: spec, data, meter."""

    def __init__(self, ctx: RankContext, tokens: torch.Tensor, vocab: int):
        self.ctx, self.tokens, self.vocab = ctx, tokens, vocab
        self.meter = measure.PeakMemory(ctx.device)

    def run(self, spec: dict, run: dict) -> dict:
        if "shape" in run:  # a size sweep: each configuration names its own member of the family
            spec = {**spec, "shape": run["shape"]}
        measure.trim()
        baseline = self.meter.current()
        subject = build_subject(spec, run, self.vocab, self.ctx.device)
        self.ctx.progress(event="start", run=run["name"], total=spec["warmup"] + spec["steps"])
        figures = self._measure(spec, subject, run["name"])
        per_rank = subject.gather(
            {
                "rank": self.ctx.rank,
                "states": subject.states(),
                "baseline_memory": baseline,
                "start_memory": figures.pop("start_memory"),
                "peak_memory": figures.pop("peak_memory"),
            }
        )
        params = subject.params
        subject.close()
        del subject
        measure.trim()
        tokens_per_step = spec["batch"] * spec["shape"]["block_size"] * self.ctx.world_size
        return {
            **run,
            **figures,
            "params": params,
            "ranks": per_rank,
            "tokens_per_s": tokens_per_step / figures["step_time"]["median_s"],
        }

    def _measure(self, spec: dict, subject: Subject, label: str) -> dict:
        ctx = self.ctx
        batches = Batches(self.tokens, spec["shape"]["block_size"], spec["batch"], spec["seed"], ctx.rank)
        losses = []
        for i in range(spec["warmup"]):
            losses.append(subject.step(*self._to(batches.next())))
            ctx.progress(event="step", run=label, phase="warmup", step=i + 1, loss=losses[-1])
        comm = subject.count_comm(lambda: losses.append(subject.step(*self._to(batches.next()))))
        measure.trim()
        start = self.meter.current()
        self.meter.reset()
        times = []
        for i in range(spec["steps"]):
            x, y = self._to(batches.next())
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            started = time.perf_counter()
            losses.append(subject.step(x, y))  # .item() inside synchronises
            times.append(subject.slowest(time.perf_counter() - started))
            ctx.progress(event="step", run=label, phase="timed", step=i + 1, loss=losses[-1], step_s=times[-1])
        return {
            "comm_paper_bytes": comm,
            "step_time": measure.step_stats(times),
            "step_times": times,
            "losses": losses,
            "start_memory": start,
            "peak_memory": self.meter.peak(),
        }

    def _to(self, batch):
        return tuple(t.to(self.ctx.device) for t in batch)

    def warm_up_process(self, spec: dict) -> None:
        """One throwaway step of a tiny model, so that one-time costs (thread pools, gloo buffers, lazily
        loaded kernels) land before the first baseline rather than inside the first configuration."""
        tiny = {**spec, "shape": {**spec["shape"], "n_layer": 1, "n_head": 1, "n_embd": 8}, "warmup": 1, "steps": 1}
        self.run(tiny, {"name": "process warm-up", "kind": "zeroshard", "stage": 3})


def work(ctx: RankContext) -> dict:
    spec = ctx.spec
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    corpus = load_corpus()
    tokenizer = CharTokenizer(corpus.text)
    bench = Bench(ctx, tokenizer.encode(corpus.text), tokenizer.vocab_size)
    measure.freeze_survivors()
    bench.warm_up_process(spec)
    results = []
    for run in spec["runs"]:
        if run["kind"] != "zeroshard" and not peers.available(run["kind"]):
            results.append({**run, "skipped": peers.unavailable_reason(run["kind"])})
            continue
        results.append(bench.run(spec, run))
        ctx.progress(event="done", run=run["name"])
    return {
        "spec": spec,
        "world_size": ctx.world_size,
        "device": str(ctx.device),
        "vocab": spec.get("vocab") or tokenizer.vocab_size,
        "memory_method": bench.meter.method,
        "torch": torch.__version__,
        "runs": results,
    }


if __name__ == "__main__":
    run_rank(work)
