"""Speculative decoding for ZeRO-Inference: a draft kept in memory proposes tokens, the streamed
model checks them all in one pass over its weights.

    engine = from_pretrained("path/to/model", config)            # weights streamed from NVMe
    draft = resident_draft("path/to/model", num_bits=4)          # its own 4-bit copy, in memory
    tokens = engine.generate(input_ids, assistant_model=draft, max_new_tokens=64)

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
offload/quantized.py), held whole by every rank in memory (int4 with groups of 64: 0.16 of the fp32
bytes) and run by an inference engine over this rank alone: the ranks' drafts propose different
numbers of tokens, so a draft must never take part in a collective. Assisted generation takes one
sequence at a time (transformers refuses batches): it is the batch-1 mode.

[Note: speculative decoding on several ranks]
Every forward of a stage-3 engine is a collective, so all ranks must run the same number of target
passes, and with a draft each rank needs its own number. transformers' `synced_gpus` keeps a
finished rank running passes, but its assisted loop then asks the draft for a negative number of
tokens once that rank's sequence is full, and raises. So the ranks agree themselves: a stopping
criterion runs once per pass on every rank (after the pass) and all-reduces who is still going; a
rank whose sequence ended leaves `generate` and runs one pass on a single token per pass the others
still make, and every rank leaves when the count reaches zero. With no rank ending early this costs
one small all-reduce per pass and no extra pass.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.compat.inference import InferenceEngine
from zeroshard.compat.pretrained import init_one_rank, meta_model, weights_source
from zeroshard.config import load_config


def resident_draft(
    path,
    num_bits: int = 4,
    group_size: int = 64,
    *,
    model_class=None,
    wrap_modules: list[str] | None = None,
    packed_matmul: bool | None = None,
) -> InferenceEngine:
    """The checkpoint at `path` (a save_pretrained() directory) as a draft for speculative decoding:
    every weight matrix quantized to `num_bits` (8 or 4) in groups of `group_size`, the whole model
    kept in this rank's memory and run on this rank alone ([Note: exact speculative decoding]).
    Pass it as `engine.generate(..., assistant_model=draft)`. `wrap_modules`: the module classes
    dequantized one at a time (`zeroshard.wrap_modules`; default: each decoder layer, and the rest
    together), which bounds the draft's fp32 memory. `packed_matmul` (default: with 4 bits): its
    Linear layers multiply by the 4-bit weights as stored ([Note: packed matmuls] in
    compat/packed_matmul.py), which changes only which tokens it proposes, never the output.
    Collective: every rank calls it."""
    source = weights_source(path)
    init_one_rank()
    own = _own_rank_group()
    config = load_config(
        {
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "weight_quantization": {"quantized_initialization": {"num_bits": num_bits, "group_size": group_size}},
            "zeroshard": {
                "wrap_modules": wrap_modules,
                "packed_matmul": num_bits == 4 if packed_matmul is None else packed_matmul,
            },
        },
        1,
    )
    draft = InferenceEngine(meta_model(path, model_class), config, group=own)
    draft.load_weights(source)
    return draft


def _own_rank_group():
    """A process group of this rank alone (made on every rank: new groups are collective)."""
    if dist.get_world_size() == 1:
        return None  # the engine's own group over the world is this rank alone
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


def generate_in_step(engine: InferenceEngine, *args, **kwargs):
    """`engine.module.generate(*args, **kwargs)` with an `assistant_model` on several ranks
    ([Note: speculative decoding on several ranks]). Collective."""
    import transformers

    prompt = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if prompt is None:
        raise ValueError("speculative decoding on several ranks needs the prompt ids (input_ids)")
    model = cast(Any, engine.module)  # a transformers model: generation_config, generate
    config = model.generation_config
    if kwargs.get("max_new_tokens") is not None:
        length = prompt.shape[-1] + kwargs["max_new_tokens"]
    else:
        length = kwargs.get("max_length") or (
            prompt.shape[-1] + config.max_new_tokens if config.max_new_tokens is not None else config.max_length
        )
    eos = kwargs.get("eos_token_id", config.eos_token_id)
    step = _InStep(engine, length, [] if eos is None else [eos] if isinstance(eos, int) else list(eos))
    kwargs["stopping_criteria"] = transformers.StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), step])
    kwargs["synced_gpus"] = False
    tokens = model.generate(*args, **kwargs)
    one = torch.zeros((1, 1), dtype=torch.long, device=prompt.device)
    while step.running:  # others still verify: one pass per pass of theirs
        engine.module(input_ids=one)
        step.agree(False)
    return tokens


class _InStep:
    """A transformers stopping criterion that never stops a sequence itself: after each pass it
    counts, over all ranks, the sequences still going ([Note: speculative decoding on several ranks])."""

    def __init__(self, engine: InferenceEngine, length: int, eos: list[int]):
        self.engine, self.length, self.eos = engine, length, eos
        self.running = True

    def agree(self, going: bool) -> None:
        count = torch.tensor([float(going)], device=self.engine.comm.device)
        self.engine.comm.all_reduce(count, "speculative decoding: ranks still generating", kind="control")
        self.running = bool(count.item() > 0)

    def __call__(self, input_ids, scores, **kwargs):
        done = input_ids.shape[-1] >= self.length or int(input_ids[0, -1]) in self.eos
        self.agree(not done)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
