"""Computing along a long sequence a tile at a time, with DeepSpeed's ALST names (`TiledMLP`,
`TiledFusedLogitsLoss`, `sequence_tiled_compute`): the activations of one tile exist at a time, in
forward and in backward, instead of the whole sequence's (its MLP's intermediate activations, its
logits: sequence x vocabulary).

[Note: tiles and ZeRO's gradient hooks]
Forward computes each tile without autograd and keeps only its inputs; backward computes each tile
again with autograd and takes `torch.autograd.grad` of it, for the tile's input and for the
parameters the tile reads, summing the parameters' over the tiles. Those parameters are inputs of the
autograd function, so their summed gradient reaches them once, as one gradient of one backward:
ZeRO's per-parameter gradient hook (core/lifecycle.py) sees a parameter's gradient exactly once per
backward, as without tiles. DeepSpeed instead lets each tile's backward accumulate into `.grad` and
marks all but the last as not ready (`ds_grad_is_ready`); and its `TiledFusedLogitsLoss` runs the
backward inside the forward, which a stage-3 engine here refuses (a backward outside its own): this
one computes the logits of each tile once more in backward, like the others. The parameters a tile
reads are `compute_params`, or, when none are given, every trainable parameter of the module passed.
Autograd records an input's shape when the function is applied, so at stage 3 the parameters are
gathered around that call (`GatheredParameters`): a module whose unit is not gathered at that moment
(an LM head that is a unit of its own, read by a tiled loss) stays gathered until backward reduces its
gradient; each tile's own call of the module, in backward, finds it gathered.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeroshard.compat.zero.gathered import GatheredParameters

__all__ = ["TiledFusedLogitsLoss", "TiledMLP", "sequence_tiled_compute"]


class _Tiled(torch.autograd.Function):
    """`fn` over tiles of the first `sharded` tensors (cut alike along `dim`), the first of which
    is differentiated; `params` (the rest) get their gradients summed over the tiles. `combine`:
    "cat" (outputs joined along `out_dim`), "sum" or "mean" (scalar outputs reduced)."""

    @staticmethod
    def forward(ctx, fn, shards: int, dim: int, combine: str, out_dim: int, sharded: int, *tensors):
        inputs, params = tensors[:sharded], tensors[sharded:]
        tiles = list(zip(*(torch.chunk(t, shards, dim) for t in inputs)))
        with torch.no_grad():
            outputs = [fn(*tile) for tile in tiles]
        ctx.fn, ctx.dim, ctx.combine, ctx.out_dim, ctx.tiles = fn, dim, combine, out_dim, tiles
        # The parameters themselves, not saved tensors: a stage-3 parameter is resharded between
        # forward and backward, and a saved tensor would hold its sharded state's autograd metadata.
        ctx.params = params
        if combine == "cat":
            return torch.cat(outputs, out_dim)
        stacked = torch.stack([o.reshape(()) for o in outputs])
        return stacked.sum() if combine == "sum" else stacked.mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        params = ctx.params
        sharded = len(ctx.tiles[0])
        needs = ctx.needs_input_grad[6:]  # after fn, shards, dim, combine, out_dim, sharded
        wants_input = needs[0]
        wanted = [p for p, need in zip(params, needs[sharded:]) if need]
        param_grads: list[torch.Tensor | None] = [None] * len(wanted)
        input_grads = []
        grads = torch.chunk(grad, len(ctx.tiles), ctx.out_dim) if ctx.combine == "cat" else None
        for i, tile in enumerate(ctx.tiles):
            first = tile[0].detach().requires_grad_(wants_input)
            with torch.enable_grad():
                out = ctx.fn(first, *tile[1:])
            if grads is not None:
                out_grad = grads[i]
            else:
                out_grad = grad / len(ctx.tiles) if ctx.combine == "mean" else grad
            targets = ([first] if wants_input else []) + wanted
            found = list(torch.autograd.grad(out, targets, out_grad, allow_unused=True)) if targets else []
            if wants_input:
                tile_grad = found.pop(0)
                input_grads.append(tile_grad if tile_grad is not None else torch.zeros_like(first))
            for j, g in enumerate(found):
                so_far = param_grads[j]
                if g is not None:
                    param_grads[j] = g if so_far is None else so_far + g
        input_grad = torch.cat(input_grads, ctx.dim) if input_grads else None
        summed = iter(param_grads)
        per_param = [next(summed) if need else None for need in needs[sharded:]]
        return (None, None, None, None, None, None, input_grad, *([None] * (sharded - 1)), *per_param)


def _apply(fn, shards: int, dim: int, combine: str, out_dim: int, sharded: list, params: list):
    """`_Tiled` over `sharded` tensors, with `params` gathered around the call: [Note: tiles and
    ZeRO's gradient hooks]."""
    with GatheredParameters(params, enabled=bool(params)):
        return _Tiled.apply(fn, int(shards), dim, combine, out_dim, len(sharded), *sharded, *params)


def _params(module, compute_params) -> list[torch.Tensor]:
    if compute_params:
        return list(compute_params)
    return [p for p in module.parameters() if p.requires_grad] if module is not None else []


class TiledMLP:
    """DeepSpeed's `TiledMLP.apply(fn, self, x, shards, compute_params)`: `fn(self, x_tile)` over
    `shards` tiles of `x` (..., sequence, hidden) along the sequence ([Note: tiles and ZeRO's
    gradient hooks]). The tutorial's use: a model's MLP forward that calls it."""

    @staticmethod
    def apply(fn: Callable, module, x: torch.Tensor, shards: int, compute_params=None) -> torch.Tensor:
        params = _params(module, compute_params)
        return _apply(lambda tile: fn(module, tile), shards, -2, "cat", -2, [x], params)


class TiledFusedLogitsLoss:
    """DeepSpeed's `TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params,
    output_reduction)`: `fn(self, x_tile, y_tile[, mask_tile])` -> a scalar loss per tile, over
    `shards` tiles of the flattened (batch x sequence) positions, reduced by "mean" or "sum"; the
    logits exist one tile at a time ([Note: tiles and ZeRO's gradient hooks])."""

    @staticmethod
    def apply(fn: Callable, module, x, y, mask, shards: int, compute_params=None, output_reduction="mean"):
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f'unknown reduction {output_reduction!r}: valid values are: "mean"/"sum"')
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(
                f"x {tuple(x.shape)} and y {tuple(y.shape)}: both [batch_size, seq_len, ...], "
                "with the same batch and sequence sizes"
            )
        if mask is not None and (mask.dim() != 2 or mask.shape != x.shape[:2]):
            raise ValueError(f"mask {tuple(mask.shape)}: [batch_size, seq_len] like x {tuple(x.shape[:2])}")
        flat = [x.flatten(0, 1), y.flatten(0, 1)] + ([mask.flatten(0, 1)] if mask is not None else [])
        params = _params(module, compute_params)
        call = (lambda a, b, c: fn(module, a, b, c)) if mask is not None else (lambda a, b: fn(module, a, b))
        return _apply(call, shards, 0, output_reduction, 0, flat, params)


def sequence_tiled_compute(
    fn: Callable,
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict,
    kwargs_to_pass: dict,
    grad_requiring_tensor_key: str,
    compute_params=None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
):
    """DeepSpeed's `sequence_tiled_compute`: `fn(**tile_of(kwargs_to_shard), **kwargs_to_pass)` over
    `shards` tiles along dimension 1 (the sequence, `seqlen` long) of every tensor of
    `kwargs_to_shard`, of which `grad_requiring_tensor_key`'s gets a gradient. Outputs joined along
    `output_unshard_dimension`; 0: one scalar per tile, reduced by `output_reduction` ("mean",
    "sum"). The parameters `fn` reads are `compute_params` ([Note: tiles and ZeRO's gradient hooks]:
    here they must be given, as `fn` has no module)."""
    if output_unshard_dimension == 0 and output_reduction not in ("mean", "sum"):
        raise ValueError(f"unknown value {output_reduction}: valid values are: mean/sum (scalar outputs)")
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not in kwargs_to_shard")
    keys = [grad_requiring_tensor_key] + [k for k in kwargs_to_shard if k != grad_requiring_tensor_key]
    for key in keys:
        if kwargs_to_shard[key].shape[1] != seqlen:
            raise ValueError(f"{key} of shape {tuple(kwargs_to_shard[key].shape)}: dimension 1 is not seqlen={seqlen}")
    params = list(compute_params or [])

    def call(*tiles):
        return fn(**dict(zip(keys, tiles)), **kwargs_to_pass)

    combine = str(output_reduction) if output_unshard_dimension == 0 else "cat"
    sharded = [kwargs_to_shard[k] for k in keys]
    return _apply(call, shards, 1, combine, output_unshard_dimension, sharded, params)
