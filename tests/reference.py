"""The correctness oracle: plain data-parallel training that zeroshard must match step by step.

`train_ddp` runs torch's DistributedDataParallel inside an initialised process group (a harness worker);
`train_single` is the same math in one process, emulating `world_size` ranks by computing each rank's
gradients separately and averaging them the way DDP's reducer does (each multiplied by 1/N, then summed in
rank order), so at N = 2 it is bit-for-bit equal to `train_ddp` (a + b == b + a in floating point).

Both return {"losses": [[float per micro step] per step], "grad_norms": [float per step],
"params": {name: tensor}, and "params_per_step" / "grads_per_step" when asked}. Names are those of
`module.named_parameters()` (a tied weight appears once, under its first name).

Gradient clipping uses the library's definition, in float64:
    norm = sqrt(sum over params of (g.double() ** 2).sum()),  coef = clip / (norm + 1e-6)
    if coef < 1: g.mul_(float(coef))   # a python float, so an fp32 multiply
The norm is recorded every step, clipped or not.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def gpt_loss(model, inputs, targets) -> torch.Tensor:
    """Default loss_fn: models that return (output, loss) when given targets, like zeroshard.tools.models.GPT."""
    out = model(inputs, targets)
    return out[1] if isinstance(out, tuple) else out


def gpt_batches(config, batch_size: int = 4, seed: int = 0):
    """batches(step, micro, rank) -> (inputs, targets), a fixed function of its arguments.

    Each row counts up from a random start (mod vocab), so the task is learnable and losses fall.
    """

    def batches(step: int, micro: int, rank: int):
        gen = torch.Generator().manual_seed(((seed * 1009 + step) * 1009 + micro) * 1009 + rank)
        start = torch.randint(0, config.vocab_size, (batch_size, 1), generator=gen)  # (B, 1)
        tokens = (start + torch.arange(config.block_size + 1)) % config.vocab_size  # (B, T + 1)
        return tokens[:, :-1], tokens[:, 1:]  # (B, T), (B, T): next-token targets

    return batches


def train_ddp(
    model_fn,
    batches,
    *,
    optimizer_fn,
    steps: int,
    grad_accum: int = 1,
    clip: float = 0.0,
    reduce_every_micro_step: bool = False,
    lr_scheduler_fn=None,
    loss_fn=gpt_loss,
    record_params: bool = False,
    record_grads: bool = False,
) -> dict:
    """Train with DistributedDataParallel (CPU, gloo, defaults) in the current process group.

    model_fn() must build the same model on every rank (same seed); DDP also broadcasts rank 0's.
    optimizer_fn(params) and lr_scheduler_fn(optimizer) build the optimizer and the scheduler.
    reduce_every_micro_step=False: no_sync() on all but the last micro step, one all-reduce per step.
    reduce_every_micro_step=True: every micro step is all-reduced, and the reduced grads are summed into
    an fp32 accumulator (acc += p.grad, from zeros, in micro step order) that becomes p.grad at the end.
    """
    rank = dist.get_rank()
    ddp = DistributedDataParallel(model_fn())

    def micro_backward(step: int, micro: int) -> float:
        inputs, targets = batches(step, micro, rank)
        loss = loss_fn(ddp, inputs, targets)
        (loss / grad_accum).backward()
        return loss.item()

    def step_grads(step: int) -> list[float]:
        if reduce_every_micro_step:
            return _accumulate_reduced(ddp.module, lambda m: micro_backward(step, m), grad_accum)
        losses = []
        for micro in range(grad_accum):
            sync = ddp.no_sync() if micro < grad_accum - 1 else contextlib.nullcontext()
            with sync:
                losses.append(micro_backward(step, micro))
        return losses

    return _train(ddp.module, step_grads, optimizer_fn, lr_scheduler_fn, steps, clip, record_params, record_grads)


def train_single(
    model_fn,
    batches,
    *,
    optimizer_fn,
    steps: int,
    grad_accum: int = 1,
    clip: float = 0.0,
    reduce_every_micro_step: bool = False,
    lr_scheduler_fn=None,
    loss_fn=gpt_loss,
    world_size: int = 1,
    record_params: bool = False,
    record_grads: bool = False,
) -> dict:
    """train_ddp's math in one process, for `world_size` emulated ranks; losses are rank 0's."""
    model = model_fn()
    params = [p for p in model.parameters() if p.requires_grad]

    def rank_grads(step: int, micro: int, rank: int) -> tuple[float, list]:
        model.zero_grad(set_to_none=True)
        inputs, targets = batches(step, micro, rank)
        loss = loss_fn(model, inputs, targets)
        (loss / grad_accum).backward()
        return loss.item(), [p.grad for p in params]

    def all_reduce_mean(per_rank: list[list]) -> list:
        # As DDP's reducer: each rank's gradient multiplied by 1/N while copied into the bucket (so at
        # N = 3 this is not g / 3), then the buckets are summed in rank order.
        return [
            sum_in_order([g[i] * (1.0 / world_size) if g[i] is not None else None for g in per_rank])
            for i in range(len(params))
        ]

    def step_grads(step: int) -> list[float]:
        losses, local = [], [None] * world_size
        acc = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        for micro in range(grad_accum):
            per_rank = [rank_grads(step, micro, rank) for rank in range(world_size)]
            losses.append(per_rank[0][0])
            if reduce_every_micro_step:
                acc = [sum_in_order([a, r]) for a, r in zip(acc, all_reduce_mean([g for _, g in per_rank]))]
            else:  # no_sync: each rank's .grad accumulates locally (autograd: old + new)
                local = [
                    g if prev is None else [sum_in_order(pair) for pair in zip(prev, g)]
                    for prev, (_, g) in zip(local, per_rank)
                ]
        grads = acc if reduce_every_micro_step else all_reduce_mean(local)
        for p, g in zip(params, grads):
            p.grad = g
        return losses

    return _train(model, step_grads, optimizer_fn, lr_scheduler_fn, steps, clip, record_params, record_grads)


# ---------------------------------------------------------------- shared by both


def _train(model, step_grads, optimizer_fn, lr_scheduler_fn, steps, clip, record_params, record_grads) -> dict:
    optimizer = optimizer_fn(model.parameters())
    scheduler = lr_scheduler_fn(optimizer) if lr_scheduler_fn is not None else None
    out = {"losses": [], "grad_norms": [], "params_per_step": [], "grads_per_step": []}
    for step in range(steps):
        out["losses"].append(step_grads(step))
        out["grad_norms"].append(clip_grad_norm(model.parameters(), clip))
        if record_grads:
            out["grads_per_step"].append(_snapshot(model, grads=True))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if record_params:
            out["params_per_step"].append(_snapshot(model))
    out["params"] = _snapshot(model)
    return out


def clip_grad_norm(parameters, clip: float) -> float:
    """The library's clipping (module docstring); returns the global norm before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None)
    for g in grads:  # parameter order, float64 throughout
        total += (g.double() ** 2).sum()
    norm = total.sqrt()
    if clip > 0:
        coef = clip / (norm + 1e-6)
        if coef < 1:
            for g in grads:
                g.mul_(float(coef))
    return float(norm)


def _accumulate_reduced(module, micro_backward, grad_accum: int) -> list[float]:
    """reduce_every_micro_step: DDP reduces each micro step; sum the reduced grads in fp32."""
    params = [p for p in module.parameters() if p.requires_grad]
    acc = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    losses = []
    for micro in range(grad_accum):
        for p in params:
            p.grad = None
        losses.append(micro_backward(micro))
        for a, p in zip(acc, params):
            if p.grad is not None:
                a += p.grad
    for a, p in zip(acc, params):
        p.grad = a
    return losses


def sum_in_order(tensors: list):
    """Left-to-right sum that skips None (a parameter without a gradient on some rank)."""
    present = [t for t in tensors if t is not None]
    if not present:
        return None
    total = present[0].clone()
    for t in present[1:]:
        total += t
    return total


def _snapshot(model, grads: bool = False) -> dict:
    if grads:
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {n: p.detach().clone() for n, p in model.named_parameters()}
