"""Ulysses sequence parallelism (DeepSpeed-Ulysses, Jacobs et al., arXiv 2309.14509): each rank of an
`sp` group holds one contiguous shard of every sequence, and attention sees the whole sequence
through two all-to-alls.

[Note: Ulysses sequence parallelism]
Everything but attention works token by token, so a rank computes its shard's activations with the
whole (gathered) layer, as for any batch. Attention needs every token: the first all-to-all turns the
shard's queries, keys and values, all heads (B, H, S/sp, D), into the whole sequence of H/sp heads
(B, H/sp, S, D) (head block r to rank r, the shards concatenated in rank order), each rank computes
its heads' causal attention over the whole sequence, and the second all-to-all turns the output back
into the shard of all heads. Each all-to-all is its own adjoint, so backward runs the same exchange
on the gradients. Key/value heads are split the same way; fewer key/value heads than sp ranks are
repeated so that each rank gets the one its queries read (sp must then be a multiple of them).

ZeRO partitions over dp x sp (core/mesh.py): each rank holds 1/(dp sp) of the model states and its
gradient is averaged over all dp sp ranks, as for a batch. A sequence's loss is the mean over its
real tokens in every shard (`SequenceParallel.whole_loss`): each rank divides its shard's summed loss
by the whole sequences' count of real tokens, and a differentiable all-reduce sums the parts, so every
sp rank holds the whole sequences' loss. Its backward hands each rank's shard loss a gradient of sp (the
all-reduce of the ranks' unit gradients), which the averaging over dp sp turns back into the mean over
dp of the whole sequences' gradients: the gradient without sequence parallelism, to rounding.

The shards of a batch (`shard_batch`): the sequence is padded at its end to a multiple of sp (pad
token, label -100), labels are shifted over the whole sequence before it is cut (so a shard's last
token is labelled with the next shard's first), and positions are global. Causal attention over the
whole sequence never lets a real token see the padding behind it, so no mask is needed; a batch with
padding anywhere but at the end is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zeroshard.core.comm import Communicator

IGNORE = -100  # the label of a position that has none (torch's cross_entropy ignore_index)


class _AllToAll(torch.autograd.Function):
    """out[i] <- rank i's x[r] (r: this rank), for x laid out (sp, ...): its own adjoint."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, what: str) -> torch.Tensor:
        ctx.comm, ctx.what = comm, what
        x = x.contiguous()
        out = torch.empty_like(x)
        comm.all_to_all(out, x, what)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        ctx.comm.all_to_all(out, grad, f"{ctx.what} (backward)")
        return out, None, None


class _AllReduceSum(torch.autograd.Function):
    """The sum over the group, differentiable: the gradient of each rank's term is the sum of the
    ranks' output gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator, what: str) -> torch.Tensor:
        ctx.comm, ctx.what = comm, what
        out = x.detach().clone()
        comm.all_reduce(out, what)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.detach().clone()
        ctx.comm.all_reduce(grad, f"{ctx.what} (backward)")
        return grad, None, None


@dataclass(frozen=True)
class SequenceParallel:
    """The sp group of this rank ([Note: Ulysses sequence parallelism])."""

    comm: Communicator

    @property
    def size(self) -> int:
        return self.comm.world_size

    @property
    def rank(self) -> int:
        return self.comm.rank

    # -- attention ---------------------------------------------------------------------------------
    def check_heads(self, heads: int, kv_heads: int) -> None:
        sp = self.size
        if heads % sp:
            raise ValueError(
                f"Ulysses sequence parallelism splits the attention heads over the sp ranks: "
                f"{heads} heads are not divisible by sequence_parallel_size {sp}"
            )
        if kv_heads % sp and sp % kv_heads:
            raise ValueError(
                f"{kv_heads} key/value heads and sequence_parallel_size {sp}: one must divide the other "
                "(key/value heads are split over the sp ranks, or repeated when there are fewer)"
            )

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, S/sp, D) shard of all heads -> (B, N/sp, S, D) whole sequence of this rank's heads."""
        sp, (b, n, s, d) = self.size, x.shape
        x = x.reshape(b, sp, n // sp, s, d).permute(1, 0, 2, 3, 4)  # (sp, B, N/sp, S/sp, D)
        x = _AllToAll.apply(x, self.comm, "Ulysses attention: sequence shards to head shards")
        return x.permute(1, 2, 0, 3, 4).reshape(b, n // sp, sp * s, d)

    def to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N/sp, S, D) this rank's heads -> (B, N, S/sp, D) this rank's shard of all heads."""
        sp, (b, n, s, d) = self.size, x.shape
        x = x.reshape(b, n, sp, s // sp, d).permute(2, 0, 1, 3, 4)  # (sp, B, N/sp, S/sp, D)
        x = _AllToAll.apply(x, self.comm, "Ulysses attention: head shards to sequence shards")
        return x.permute(1, 0, 2, 3, 4).reshape(b, n * sp, s // sp, d)

    def attention(self, query, key, value, *, scaling=None, dropout: float = 0.0) -> torch.Tensor:
        """Causal attention of this rank's sequence shard over the whole sequence. query (B, H, S/sp,
        D), key and value (B, KV, S/sp, D) -> (B, S/sp, H, D), as transformers' attention functions
        return it. torch's scaled_dot_product_attention on each rank's heads."""
        sp, heads, kv_heads = self.size, query.shape[1], key.shape[1]
        self.check_heads(heads, kv_heads)
        if kv_heads % sp:  # fewer key/value heads than ranks: each rank gets the one its queries read
            key, value = key.repeat_interleave(sp // kv_heads, dim=1), value.repeat_interleave(sp // kv_heads, dim=1)
        q, k, v = self.to_heads(query), self.to_heads(key), self.to_heads(value)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:  # grouped-query attention: key/value head i serves query heads i*g .. i*g + g - 1
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling)
        return self.to_sequence(out).transpose(1, 2)  # (B, S/sp, H, D)

    # -- the loss ----------------------------------------------------------------------------------
    def whole_loss(self, loss_sum: torch.Tensor, tokens) -> torch.Tensor:
        """The whole sequences' mean loss, on every sp rank, from `loss_sum`, the sum of this rank's
        shard's per-token losses (`cross_entropy(..., reduction="sum", ignore_index=-100)`), and
        `tokens`, their number (an int or a tensor). Differentiable: backward it as the loss
        ([Note: Ulysses sequence parallelism])."""
        total = torch.as_tensor(tokens, dtype=torch.float64, device=self.comm.device).reshape(1).clone()
        self.comm.all_reduce(total, "real tokens of the whole sequences", kind="control")
        share = loss_sum / total.clamp(min=1).to(loss_sum.device, loss_sum.dtype).reshape(())
        return _AllReduceSum.apply(share, self.comm, "the whole sequences' loss")


def shard_batch(batch: dict, rank: int, size: int, *, pad_token_id: int = 0) -> dict:
    """This sp rank's shard of a batch of sequences (B, S): `input_ids` padded at the end to a
    multiple of `size` with `pad_token_id`, `position_ids` global (given ones are kept), `labels`
    shifted over the whole sequence before it is cut, as `shift_labels` (-100 where there is no next
    token or it is padding), every other (B, S) tensor padded with 0 and cut alike. An
    `attention_mask` is dropped: it may only mark padding at the end, which causal attention over the
    whole sequence never lets a real token see. [Note: Ulysses sequence parallelism]"""
    if "input_ids" not in batch:
        raise ValueError(f"a sequence-parallel batch needs 'input_ids'; it has {sorted(batch)}")
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"input_ids of shape {tuple(ids.shape)}: a sequence-parallel batch is (batch, sequence)")
    rows, length = ids.shape
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.shape[:2] != (rows, length):
            raise ValueError(f"'{key}' of shape {tuple(value.shape)} does not match input_ids' {(rows, length)}")
    padded = -(-length // size) * size
    out: dict = {}
    mask = batch.get("attention_mask")
    if mask is not None and not _padding_at_the_end(mask):
        raise ValueError(
            "attention_mask marks padding before real tokens: sequence parallelism attends causally over "
            "the whole sequence without a mask, so pad sequences at their end (padding_side='right')"
        )
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=ids.device).expand(rows, length)
    for key, value in batch.items():
        if key in ("attention_mask", "labels", "position_ids") or not isinstance(value, torch.Tensor):
            if key not in ("attention_mask", "labels", "position_ids"):
                out[key] = value
            continue
        out[key] = _pad(value, padded, pad_token_id if key == "input_ids" else 0)
    last = positions[:, -1:]
    out["position_ids"] = torch.cat([positions, last + torch.arange(1, padded - length + 1, device=ids.device)], 1)
    labels = batch.get("labels")
    if labels is not None:
        if mask is not None:
            labels = labels.masked_fill(mask == 0, IGNORE)
        out["shift_labels"] = _pad(labels[:, 1:], padded, IGNORE)
    chunk = padded // size
    return {k: (v[:, rank * chunk : (rank + 1) * chunk] if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def _pad(value: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    """`value` (B, s, ...) padded along dimension 1 to `length` with `fill`."""
    extra = length - value.shape[1]
    if extra <= 0:
        return value
    tail = value.new_full((value.shape[0], extra, *value.shape[2:]), fill)
    return torch.cat([value, tail], 1)


def _padding_at_the_end(mask: torch.Tensor) -> bool:
    """Every row's ones come before its zeros."""
    ones = mask.long().sum(1, keepdim=True)  # (B, 1)
    expected = torch.arange(mask.shape[1], device=mask.device) < ones  # (B, S)
    return bool(torch.equal(expected, mask.bool()))
