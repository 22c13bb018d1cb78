"""A unit: the module whose parameters are gathered and freed together, and the unit of
gradient reduction. Issues its collectives through the Communicator; states are asserted.

[Note: unit states]
    SHARDED --unshard()--> GATHERING --wait_unshard()--> UNSHARDED --reshard()--> SHARDED
Units that never reshard (stages 0-2, parameters below the persistence threshold) stay UNSHARDED.
A prefetch is an `unshard()` issued early; the consumer's `wait_unshard()` completes it.
"""
from __future__ import annotations

import enum

import torch
from torch import nn

from zeroshard.core.comm import Communicator, Handle
from zeroshard.core.group import FlatGroup
from zeroshard.core.policy import Reduction


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


class Unit:
    def __init__(self, name: str, module: nn.Module | None, groups: list[FlatGroup],
                 comm: Communicator, reshards: bool):
        self.name = name  # the module's qualified name; "<root>" for the model itself
        self.module = module
        self.groups = groups
        self.comm = comm
        self.reshards = reshards
        self.state = UnitState.SHARDED if reshards else UnitState.UNSHARDED
        self.numel = sum(g.layout.padded_numel for g in groups)
        self.trainable_params = sum(len(g.params) for g in groups if g.trainable)
        self._gathers: list[Handle] = []
        self._reductions: list[tuple[Handle, FlatGroup, torch.Tensor | None]] = []
        self.grads_pending = self.trainable_params
        self.reduced_this_backward = False
        self.abandoned: list[torch.Tensor] = []  # see abort()

    # -- parameters ---------------------------------------------------------------------------------
    def unshard(self, phase: str) -> None:
        """Start gathering the parameters (no-op unless SHARDED)."""
        if self.state is not UnitState.SHARDED:
            return
        for group in self.groups:
            shard = group.gather_input()  # 1-D, numel = shard_numel, compute dtype
            what = f"all-gather of unit '{self.name}' parameters ({phase})"
            self._gathers.append(self.comm.all_gather(group.new_full(), shard, what, async_op=True))
        self.state = UnitState.GATHERING

    def wait_unshard(self) -> None:
        if self.state is UnitState.GATHERING:
            for handle in self._gathers:
                handle.wait()
            self._gathers.clear()
            for group in self.groups:
                group.point_params_at_full()
                group.release_master()
            self.state = UnitState.UNSHARDED
        assert self.state is UnitState.UNSHARDED, (self.name, self.state)

    def reshard(self, release: bool = False) -> None:
        """Free the gathered parameters (stage 3); see [Note: parameter storage] in group.py
        (`release`: FlatGroup.free_full)."""
        if not self.reshards or self.state is UnitState.SHARDED:
            return
        if self.state is UnitState.GATHERING:  # never free a buffer a collective still writes
            self.wait_unshard()
        for group in self.groups:
            group.free_full(release)
        self.state = UnitState.SHARDED

    # -- gradients ----------------------------------------------------------------------------------
    def reduce_grads(self, average_over: int) -> None:
        """Issue the gradient reduction of every trainable group (async); `finish_reduce` completes it.

        Gradients are pre-divided by the world size like DDP does, so that at two ranks the sum
        g0/2 + g1/2 is bit-identical to DDP's whatever the order.
        """
        for group in self.groups:
            if not group.trainable:
                continue
            if group.full_grad is None:  # no parameter of this group got a gradient: reduce zeros
                group.full_grad = group.zeros_full_grad()
            group.full_grad.mul_(1.0 / average_over)
            self._reductions.append(self._reduce_group(group))
        self.reduced_this_backward = True

    def _reduce_group(self, group: FlatGroup):
        what = f"gradient reduction of unit '{self.name}'"
        if group.reduction is Reduction.ALL_REDUCE:  # stage 0: every rank keeps everything, like DDP
            return self.comm.all_reduce(group.full_grad, what, async_op=True), group, None
        if group.reduction is Reduction.REDUCE_SCATTER_IN_PLACE:
            # Stage 1: this rank's slice of full_grad becomes its reduced gradient.
            out = group.full_grad[slice(*group.layout.shard_range(group.rank))]
            return self.comm.reduce_scatter(out, group.full_grad, what, async_op=True), group, None
        out = torch.empty(group.layout.shard_numel, dtype=group.grad_dtype, device=group.device)  # 2/3
        return self.comm.reduce_scatter(out, group.full_grad, what, async_op=True), group, out

    def finish_reduce(self) -> None:
        for handle, group, out in self._reductions:
            handle.wait()
            if group.grads_persist_full:  # stages 0/1: [Note: a second reduction before the step]
                group.restore_reduced_slice()
            if out is not None:
                group.grad_shard.add_(out.to(group.grad_shard.device))  # accumulate; offload: to host
                group.full_grad = None  # stages 2/3: the full gradient lives only until reduced
        self._reductions.clear()

    def abort(self, wait: bool) -> None:
        """After a forward or backward raised: complete (`wait`) or abandon the collectives this unit
        has in flight, drop their results, free its gathered parameters. The buffers of abandoned
        collectives are never reused (a peer may still write into them): they stay referenced in
        `abandoned`, and the groups get new ones."""
        reductions, gathers = list(self._reductions), list(self._gathers)
        self._reductions.clear()
        self._gathers.clear()
        completed = False
        try:
            for handle in [h for h, _, _ in reductions] + gathers if wait else ():
                handle.wait()
            completed = True
        finally:
            if not completed:
                for _, group, out in reductions:
                    self.abandoned += [t for t in (out, group.full_grad) if t is not None]
                    group.full_grad = group.zeros_full_grad() if group.grads_persist_full else None
            if self.state is UnitState.GATHERING and completed:
                for group in self.groups:
                    group.point_params_at_full()
                self.state = UnitState.UNSHARDED
            elif self.state is UnitState.GATHERING:
                self.abandoned += [g.full for g in self.groups if g.full is not None]
                for group in self.groups:
                    group.full = None  # gathered into a new buffer next time
                    group.free_full()
                self.state = UnitState.SHARDED
            self.reshard()

    def destroy(self) -> None:
        for handle in self._gathers:
            handle.wait()
        self._gathers.clear()
        self._reductions.clear()
        for group in self.groups:
            group.destroy()
        self.groups = []
