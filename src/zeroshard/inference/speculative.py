"""Speculative decoding for ZeRO-Inference: a draft kept in memory proposes tokens, the streamed
model checks them all in one pass over its weights.

    model = from_pretrained("path/to/model", offload=zeroshard.NVMeOffload("/local_nvme"))   # weights streamed
    draft = resident_draft("path/to/model", num_bits=4)          # its own 4-bit copy, in memory
    tokens = model.generate(input_ids, assistant_model=draft, max_new_tokens=64)

or any small model of the same vocabulary as `assistant_model` (transformers' own argument).

[Note: exact speculative decoding]
At batch 1 a streamed model's time per token is its bytes over the disk's rate; every pass over the
weights that yields more than one token divides it. transformers' assisted generation does the
bookkeeping (candidates, cropping the cache): the draft proposes k tokens one by one, the target
runs one forward over the k + 1 positions and keeps the proposals up to its first disagreement,
plus its own next token. Greedy: a proposal is kept only if it is the target's argmax at that
position, so the tokens are the target's greedy tokens. Sampling: the rejection rule of Leviathan
et al. (2023) keeps a proposal x with probability min(1, p(x) / q(x)) and otherwise samples from
norm(max(0, p - q)), which leaves the output distributed exactly as the target's samples. Either way
the draft changes how many passes the weights are read in, never what comes out.

The draft here is the same checkpoint quantized group-wise ([Note: quantized weight store] in
inference/store.py), held whole by every rank in memory (int4 with groups of 64: 0.16 of the fp32
bytes) and run by an inference model over this rank alone: the ranks' drafts propose different
numbers of tokens, so a draft must never take part in a collective. Assisted generation takes one
sequence at a time (transformers refuses batches): it is the batch-1 mode. On several stage-3 ranks
the target keeps the ranks' passes in step (speculative_in_step.py).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from zeroshard.core.policy import GatheringPolicy
from zeroshard.inference.pretrained import from_pretrained, init_one_rank, weights_source
from zeroshard.inference.quantization import QuantSpec
from zeroshard.inference.sharded import InferenceModel


def resident_draft(
    path,
    num_bits: int = 4,
    group_size: int = 64,
    *,
    model_class=None,
    wrap_modules: list[str] | None = None,
    packed_matmul: bool | None = None,
) -> InferenceModel:
    """The checkpoint at `path` (a save_pretrained() directory) as a draft for speculative decoding:
    every weight matrix quantized to `num_bits` (8 or 4) in groups of `group_size`, the whole model
    kept in this rank's memory and run on this rank alone ([Note: exact speculative decoding]).
    Pass it as `model.generate(..., assistant_model=draft)`. `wrap_modules`: the module classes
    dequantized one at a time (`GatheringPolicy.wrap`; default: each decoder layer, and the rest
    together), which bounds the draft's fp32 memory. `packed_matmul` (default: with 4 bits): its
    Linear layers multiply by the 4-bit weights as stored ([Note: packed matmuls] in
    inference/packed.py), which changes only which tokens it proposes, never the output.
    Collective: every rank calls it."""
    weights_source(path)  # a wrong path fails before the collective that makes this rank's group
    init_one_rank()
    return from_pretrained(
        path,
        model_class=model_class,
        quantize=QuantSpec(num_bits, group_size),
        packed_matmul=num_bits == 4 if packed_matmul is None else packed_matmul,
        gathering=GatheringPolicy(wrap=tuple(wrap_modules) if wrap_modules else None),
        group=_own_rank_group(),
    )


def _own_rank_group():
    """A process group of this rank alone (made on every rank: new groups are collective)."""
    if dist.get_world_size() == 1:
        return None  # the model's own group, the world, is this rank alone
    group, _ = dist.new_subgroups(group_size=1)
    return group


class PassCounter:
    """Forward passes of a module, counted by a pre-hook (`close()` removes it): how many times a
    target read its weights, and how many tokens a draft proposed."""

    def __init__(self, module: nn.Module):
        self.passes = 0
        self._handle = module.register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        self.passes += 1

    def close(self) -> None:
        self._handle.remove()


def speculation_report(new_tokens: int, target_passes: int, draft_passes: int) -> dict:
    """Tokens per pass over the target's weights, and the share of the draft's proposals kept. The
    first target pass (the prompt) yields one token; every later pass yields its accepted proposals
    plus one token of its own, and every draft forward proposes one token."""
    accepted = max(0, new_tokens - target_passes)
    return {
        "new_tokens": new_tokens,
        "target_passes": target_passes,
        "draft_proposals": draft_passes,
        "tokens_per_pass": new_tokens / target_passes if target_passes else 0.0,
        "acceptance": accepted / draft_passes if draft_passes else 0.0,
    }
