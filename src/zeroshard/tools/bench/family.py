"""The GPT family benchmarks scale along, and the memory model used to find its largest member that fits.

Member k has k layers of width 64k and k heads of 64 (k = 12 is GPT-2 small's shape), with the bench's
vocabulary and sequence length. Peak memory per rank of member k at stage s is modelled as

    baseline + model_states(Ψ_k, s) + units(k, s) + c_s * activations(k)

  * baseline: the process's RSS before any model exists (interpreter, torch, process group), measured;
  * model_states: `zeroshard.tools.estimator.model_state_bytes` (paper §5), exact for our flat buffers;
  * units: full-size buffers that live only during a step and scale with one unit (a transformer block):
    at stage 3 the gathered parameters of the current and the prefetched block, from stage 2 on the
    gradients of up to three blocks awaiting their reduce-scatter (the engine bounds reductions in flight);
  * activations(k): bytes autograd keeps for backward, ~17 fp32 values per token per layer and width plus
    three copies of the logits (after Korthikanti et al., arXiv 2205.05198, §4.1, for fp32 and no dropout);
    c_s is calibrated from the bench's own measured peak at stage s, so it absorbs allocator slack.

The search is therefore an extrapolation from one measured size, not a trial of every size; the output
says so.
"""
from __future__ import annotations

from dataclasses import dataclass

from zeroshard.tools import estimator as est
from zeroshard.core.policy import stage_policy

HEAD_DIM = 64
MAX_SIZE = 4096


def gpt_shape(size: int, vocab: int, seq_len: int) -> dict:
    """GPTConfig fields of family member `size`."""
    if size < 1:
        raise ValueError(f"model size must be >= 1, got {size}")
    return dict(vocab_size=vocab, block_size=seq_len, n_layer=size, n_head=size, n_embd=HEAD_DIM * size)


def num_params(size: int, vocab: int, seq_len: int) -> int:
    shape = gpt_shape(size, vocab, seq_len)
    return est.GPTSpec(vocab=vocab, n_layer=shape["n_layer"], n_embd=shape["n_embd"], n_head=shape["n_head"],
                       block_size=seq_len).num_params()


def block_params(size: int) -> int:
    d = HEAD_DIM * size
    return 12 * d * d + 13 * d  # qkv, proj, fc, fc-proj weights + biases + two LayerNorms


def activation_bytes(size: int, vocab: int, seq_len: int, batch: int, dtype_bytes: int = 4) -> int:
    """Bytes autograd keeps for backward on one rank (see the module docstring)."""
    d = HEAD_DIM * size
    return batch * seq_len * (size * 17 * d + 3 * vocab) * dtype_bytes


def unit_bytes(size: int, stage: int, dtype_bytes: int = 4) -> int:
    policy = stage_policy(stage)
    copies = (2 if policy.shard_parameters else 0) + (3 if policy.shard_gradients else 0)
    return copies * block_params(size) * dtype_bytes


@dataclass(frozen=True)
class MemoryModel:
    """Calibrated peak-memory model of one stage for one (vocab, seq_len, batch, ranks, recipe)."""

    stage: int
    ranks: int
    vocab: int
    seq_len: int
    batch: int
    recipe: est.Recipe
    baseline: int  # bytes
    activation_scale: float  # c_s

    def peak(self, size: int) -> int:
        states = est.model_state_bytes(num_params(size, self.vocab, self.seq_len), self.ranks, self.stage,
                                       self.recipe).total
        act = activation_bytes(size, self.vocab, self.seq_len, self.batch, self.recipe.param_bytes)
        return int(self.baseline + states + unit_bytes(size, self.stage, self.recipe.param_bytes)
                   + self.activation_scale * act)


def calibrate(stage: int, ranks: int, vocab: int, seq_len: int, batch: int, recipe: est.Recipe, size: int,
              baseline: int, measured_peak: int, measured_states: int) -> MemoryModel:
    """Fit c_s so that the model reproduces the measured peak of member `size` (never below 1)."""
    act = activation_bytes(size, vocab, seq_len, batch, recipe.param_bytes)
    transient = measured_peak - baseline - measured_states - unit_bytes(size, stage, recipe.param_bytes)
    return MemoryModel(stage, ranks, vocab, seq_len, batch, recipe, baseline, max(1.0, transient / act))


def largest_fitting(model: MemoryModel, budget: int) -> int | None:
    """Largest member k whose modelled peak is within `budget` bytes (binary search; None if k=1 does not fit)."""
    if model.peak(1) > budget:
        return None
    low, high = 1, MAX_SIZE
    if model.peak(high) <= budget:
        return high
    while high - low > 1:  # invariant: peak(low) fits, peak(high) does not
        middle = (low + high) // 2
        low, high = (middle, high) if model.peak(middle) <= budget else (low, middle)
    return low
