"""Speculative decoding on several stage-3 ranks: the ranks keep the same number of target passes
while each one's draft proposes its own number of tokens.

[Note: speculative decoding on several ranks]
Every forward of a stage-3 model is a collective, so all ranks must run the same number of target
passes, and with a draft each rank needs its own number. transformers' `synced_gpus` keeps a
finished rank running passes, but its assisted loop then asks the draft for a negative number of
tokens once that rank's sequence is full, and raises. So the ranks agree themselves: a stopping
criterion runs once per pass on every rank (after the pass) and all-reduces who is still going; a
rank whose sequence ended leaves `generate` and runs one pass on a single token per pass the others
still make, and every rank leaves when the count reaches zero. With no rank ending early this costs
one small all-reduce per pass and no extra pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from zeroshard.core.sharded import Sharded


def generate_in_step(sharded: Sharded, *args, **kwargs):
    """`sharded.module.generate(*args, **kwargs)` with an `assistant_model` on several ranks
    ([Note: speculative decoding on several ranks]). Collective."""
    import transformers

    prompt = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if prompt is None:
        raise ValueError("speculative decoding on several ranks needs the prompt ids (input_ids)")
    model = cast(Any, sharded.module)  # a transformers model: generation_config, generate
    config = model.generation_config
    if kwargs.get("max_new_tokens") is not None:
        length = prompt.shape[-1] + kwargs["max_new_tokens"]
    else:
        length = kwargs.get("max_length") or (
            prompt.shape[-1] + config.max_new_tokens if config.max_new_tokens is not None else config.max_length
        )
    eos = kwargs.get("eos_token_id", config.eos_token_id)
    step = _InStep(sharded, length, [] if eos is None else [eos] if isinstance(eos, int) else list(eos))
    kwargs["stopping_criteria"] = transformers.StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), step])
    kwargs["synced_gpus"] = False
    tokens = model.generate(*args, **kwargs)
    one = torch.zeros((1, 1), dtype=torch.long, device=prompt.device)
    while step.running:  # others still verify: one pass per pass of theirs
        sharded.module(input_ids=one)
        step.agree(False)
    return tokens


class _InStep:
    """A transformers stopping criterion that never stops a sequence itself: after each pass it
    counts, over all ranks, the sequences still going ([Note: speculative decoding on several ranks])."""

    def __init__(self, sharded: Sharded, length: int, eos: list[int]):
        self.sharded, self.length, self.eos = sharded, length, eos
        self.running = True

    def agree(self, going: bool) -> None:
        count = torch.tensor([float(going)], device=self.sharded.comm.device)
        self.sharded.comm.all_reduce(count, "speculative decoding: ranks still generating", kind="control")
        self.running = bool(count.item() > 0)

    def __call__(self, input_ids, scores, **kwargs):
        done = input_ids.shape[-1] >= self.length or int(input_ids[0, -1]) in self.eos
        self.agree(not done)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
