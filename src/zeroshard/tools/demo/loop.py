"""Rank side of `zeroshard train`: a character-level GPT on the standard library's source, with ZeRO.

Launched by `zeroshard train` as `torchrun --nproc_per_node N -m zeroshard.tools.demo.loop RUN_DIR`. Rank 0
reports every step (loss averaged over ranks, tokens/s, memory of every rank) for the parent's progress
bar, then the held-out loss and a sample of generated text.
"""

from __future__ import annotations

import copy
import logging
import time

import torch

from zeroshard.compat.api import initialize
from zeroshard.tools.bench import measure
from zeroshard.tools.bench.rank import RankContext, run_rank
from zeroshard.tools.demo.corpus import Batches, CharTokenizer, load_corpus, split
from zeroshard.tools.models.gpt import GPT, GPTConfig

log = logging.getLogger(__name__)

PROMPT = "def "


def default_config(spec: dict) -> dict:
    steps = spec["steps"]
    warmup = max(2, min(30, steps // 10))
    config = {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": spec["lr"], "betas": [0.9, 0.99], "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "overlap_comm": True},
        "bf16": {"enabled": spec["precision"] == "bf16"},
    }
    if steps > warmup:
        config["scheduler"] = {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": steps,
                "warmup_num_steps": warmup,
                "warmup_type": "linear",
                "cos_min_ratio": 0.1,
            },
        }
    return config


def merge(base: dict, override: dict) -> dict:
    """`override` wins key by key, sections merged recursively (a user config refines the defaults)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def build_config(spec: dict) -> dict:
    user = spec.get("config") or {}
    defaults = default_config(spec)
    if any(key in user for key in BATCH_KEYS):  # the user's batch sizes, resolved by the engine as DeepSpeed does
        defaults = {k: v for k, v in defaults.items() if k not in BATCH_KEYS}
    config = merge(defaults, user)
    if spec.get("stage") is not None:  # --stage beats the config file
        config.setdefault("zero_optimization", {})["stage"] = spec["stage"]
    return config


class Trainer:
    def __init__(self, ctx: RankContext):
        self.ctx, spec = ctx, ctx.spec
        corpus = load_corpus()
        self.tokenizer = CharTokenizer(corpus.text)
        torch.manual_seed(spec["seed"])
        self.model = GPT(GPTConfig(**{**spec["shape"], "vocab_size": self.tokenizer.vocab_size}))
        self.config = build_config(spec)
        self.engine, *_ = initialize(model=self.model, model_parameters=self.model.parameters(), config=self.config)
        # the engine resolved the batch sizes (a config may give train_batch_size only)
        self.micro, self.accumulation = (
            self.engine.train_micro_batch_size_per_gpu(),
            self.engine.gradient_accumulation_steps(),
        )
        train_tokens, val_tokens = split(self.tokenizer.encode(corpus.text))
        seq_len = spec["shape"]["block_size"]
        self.train = Batches(train_tokens, seq_len, self.micro, spec["seed"], ctx.rank)
        self.val = Batches(val_tokens, seq_len, self.micro, spec["seed"] + 1, ctx.rank)
        self.tokens_per_step = self.micro * self.accumulation * seq_len * ctx.world_size
        self.sources = corpus.sources

    def _to(self, batch):
        return tuple(t.to(self.ctx.device) for t in batch)

    def step(self) -> float:
        """One optimizer step: `accumulation` micro steps; returns their mean loss."""
        total = 0.0
        for _ in range(self.accumulation):
            x, y = self._to(self.train.next())
            _, loss = self.engine(x, y)
            self.engine.backward(loss)
            self.engine.step()
            total += loss.item()
        return total / self.accumulation

    def across_ranks(self, loss: float) -> tuple[float, list[int]]:
        """(mean loss over ranks, every rank's memory): one small all-reduce, counted as control."""
        world, rank = self.ctx.world_size, self.ctx.rank
        values = torch.zeros(1 + world, dtype=torch.float64, device=self.ctx.device)
        values[0] = loss / world
        values[1 + rank] = self.memory()
        self.engine.comm.all_reduce(values, "train: loss and memory per rank", kind="control")
        return float(values[0]), [int(v) for v in values[1:].tolist()]

    def memory(self) -> int:
        if self.ctx.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.ctx.device))
        return measure.rss()

    @torch.no_grad()
    def validation_loss(self, batches: int = 8) -> float:
        self.engine.eval()
        losses = [self.engine(*self._to(self.val.next()))[1].item() for _ in range(batches)]
        self.engine.train()
        return sum(losses) / len(losses)

    @torch.no_grad()
    def sample(self, chars: int) -> str:
        """Generated on every rank alike (same seed, same gathered parameters, so the same text): at stage 3
        each forward gathers the units, a collective every rank must join."""
        self.engine.eval()
        torch.manual_seed(self.ctx.spec["seed"])
        prompt = self.tokenizer.encode(PROMPT)[None, :].to(self.ctx.device)  # (1, T)
        out = self.model.generate(prompt, chars, temperature=0.8, top_k=20)  # (1, T + chars)
        self.engine.train()
        return self.tokenizer.decode(out[0].tolist())


def work(ctx: RankContext) -> dict:
    spec = ctx.spec
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    trainer = Trainer(ctx)
    tokens_per_step = trainer.tokens_per_step
    ctx.progress(
        event="start",
        total=spec["steps"],
        params=trainer.engine.num_parameters(),
        stage=trainer.engine.zero_optimization_stage(),
    )
    losses, started = [], time.perf_counter()
    for step in range(1, spec["steps"] + 1):
        step_started = time.perf_counter()
        loss, memory = trainer.across_ranks(trainer.step())
        losses.append(loss)
        ctx.progress(
            event="step",
            step=step,
            loss=loss,
            memory=memory,
            tokens_per_s=tokens_per_step / (time.perf_counter() - step_started),
        )
    elapsed = time.perf_counter() - started
    ctx.progress(event="sampling")
    result = {
        "spec": spec,
        "config": trainer.config,
        "params": trainer.engine.num_parameters(),
        "stage": trainer.engine.zero_optimization_stage(),
        "world_size": ctx.world_size,
        "corpus": list(trainer.sources),
        "vocab": trainer.tokenizer.vocab_size,
        "losses": losses,
        "train_seconds": elapsed,
        "tokens_per_s": tokens_per_step * len(losses) / elapsed,
        "validation_loss": trainer.validation_loss(),
        "memory_report": trainer.engine.memory_report(),
        "sample": trainer.sample(spec["sample_chars"]),
        "prompt": PROMPT,
    }
    trainer.engine.destroy()
    return result


if __name__ == "__main__":
    run_rank(work)
