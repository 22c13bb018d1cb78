"""The all-gather of updated parameters after a step (stages 1/2), at once or overlapped with the
next forward.

[Note: deferred parameter gather]
At stages 1/2 each rank updates only its slice of a unit's full parameter buffer; the step then
all-gathers the other slices. Waiting for that at the end of step() leaves the link busy and the
CPU idle, then the CPU busy and the link idle (1.45x DDP at 1 Gbit/s, docs/multinode.md). With
`overlap_param_gather` (Megatron's option of the same name) step() only *issues* the gathers, unit by
unit with at most `max_inflight` in flight, and each unit's forward
pre-hook waits for its own gather just before the unit computes, then issues the next ones. The
root unit (the model itself) owns the embeddings, which the forward reads first, so it is gathered
first, then the other units in their order (for a transformer, the order of its blocks). That order
is fixed when the model is sharded, not recorded from a forward: a data-dependent forward could run
units in different orders on different ranks, and the ranks must issue the same collectives in the
same order. A unit running out of that order waits for the gathers queued before its own.
Everything of zeroshard's that reads or writes parameters or masters between a step and the next
forward waits for every gather first, through `wait_all`: state_dict / load_state_dict,
checkpoints, gathered_parameters, refresh_parameters, the module's own state_dict() (a hook),
destroy. zero_grad() touches gradients only and does not wait.

A failed wait is a CollectiveError like any other ([Note: failed steps] in sharded.py): the forward
that met it aborts, and `abort` issues and completes (or abandons) what is left, so that a rank
that failed alone still pairs its collectives with its peers'.

[Note: reads before the next forward]
A script's own read of parameter values between step() and the next forward (an EMA update
`ema_p.lerp_(p, 1e-3)`, `p.data.clamp_(...)`, `p.norm()` for a log line) must call
`wait_parameters()` first, or it reads slices the other ranks have not sent yet. Megatron's
overlap_param_gather has the same rule. zeroshard does not watch for such reads: doing so means
routing every torch call of the script through Python (a TorchFunctionMode) on private torch APIs.
`overlap_param_gather: false` makes step() wait for the gathers, for scripts that cannot follow
the rule (reads from another thread, code that is not theirs).
"""

from __future__ import annotations

import functools

import torch

from zeroshard.core.comm import Communicator
from zeroshard.core.group import FlatGroup
from zeroshard.core.unit import Unit
from zeroshard.core.wrap import ROOT


def _gathers(group: FlatGroup) -> bool:
    """Is this group's full buffer all-gathered from the ranks' master slices after a step?"""
    return group.trainable and group.sharded_master and group.keep_full


def _gather_updated(comm: Communicator | None, group: FlatGroup):
    """Issue the all-gather of the other ranks' slices of `group`'s updated parameters."""
    assert comm is not None and group.full is not None  # issued after a step; kept: it does not reshard
    what = f"all-gather of updated parameters ({group.names[0]}...)"
    return comm.all_gather(group.full, group.own_slice_of_full(), what, async_op=True, counts=group.layout.counts)


@torch.no_grad()
def refresh_parameters(groups: list[FlatGroup], comm: Communicator, deferred=None) -> None:
    """Make every rank's unsharded parameters match the master shards (after a step, or after the
    masters were loaded): copy this rank's master into its slice of the full buffer, then all-gather
    the other ranks' slices where the master is sharded. Stage-3 groups are gathered from their
    shard on next use; only a compute shard kept beside an offloaded master is refreshed.
    `deferred` (a DeferredGather): only issue the all-gathers ([Note: deferred parameter gather])."""
    handles = []
    for group in groups:
        group.copy_master_into_params()
        if group.reshards:
            continue
        if group.sharded_master and deferred is None:
            handles.append(_gather_updated(comm, group))
    for handle in handles:
        handle.wait()
    if deferred is not None:
        deferred.issue(comm)


class DeferredGather:
    def __init__(self, units: list[Unit], max_inflight: int = 2):
        gathered = [u for u in units if any(_gathers(g) for g in u.groups)]
        roots = [u for u in gathered if u.name == ROOT]
        self.units = roots + [u for u in gathered if u.name != ROOT]  # the issue order, on every rank
        self.max_inflight = max(1, max_inflight)
        self._comm: Communicator | None = None  # set by issue()
        self._queue: list[Unit] = []  # gathers not issued yet, in order
        self._inflight: dict[int, list] = {}  # id(unit) -> handles, oldest first
        self._handles: list = []

    @classmethod
    def attach(cls, units: list[Unit], model: torch.nn.Module, optimizer, policy, enabled: bool):
        """The deferred gather of a sharded model, hooked in, or None: only stages 1/2 gather after a
        step (stage 0 gathers nothing, stage 3 before each use anyway)."""
        if not enabled or optimizer is None or not policy.shard_optimizer or policy.shard_parameters:
            return None
        gather = cls(units)
        for unit in gather.units:
            module = unit.module if unit.module is not None else model
            gather._handles.append(module.register_forward_pre_hook(functools.partial(gather._pre_forward, unit)))
        # After the model's forward: the units it did not run; and the module's own state_dict().
        gather._handles.append(model.register_forward_hook(lambda *args: gather.wait_all()))
        gather._handles.append(model.register_state_dict_pre_hook(lambda *args, **kwargs: gather.wait_all()))
        optimizer.deferred_gather = gather
        return gather

    def close(self, wait: bool) -> None:
        self.abort(wait)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def pending(self) -> bool:
        return bool(self._queue or self._inflight)

    # -- after the step ------------------------------------------------------------------------------
    def issue(self, comm) -> None:
        """Start gathering every unit's updated parameters (each rank's master is in its slice)."""
        assert not self.pending, "updated parameters gathered twice without a wait in between"
        self._comm = comm
        self._queue = list(self.units)
        self._top_up()

    @torch.no_grad()
    def _top_up(self) -> None:
        while self._queue and len(self._inflight) < self.max_inflight:
            unit = self._queue.pop(0)
            self._inflight[id(unit)] = [_gather_updated(self._comm, g) for g in unit.groups if _gathers(g)]

    def _wait_oldest(self) -> None:
        handles = self._inflight.pop(next(iter(self._inflight)))
        for handle in handles:
            handle.wait()
        self._top_up()

    # -- before the next forward ------------------------------------------------------------------
    def _pre_forward(self, unit: Unit, module, args) -> None:
        """Complete `unit`'s gather (and those queued before it), then issue the next ones."""
        while id(unit) not in self._inflight and any(u is unit for u in self._queue):
            self._wait_oldest() if self._inflight else self._top_up()
        for handle in self._inflight.pop(id(unit), ()):
            handle.wait()
        self._top_up()

    def wait_all(self) -> None:
        while self._inflight or self._queue:
            self._wait_oldest() if self._inflight else self._top_up()

    def abort(self, wait: bool) -> None:
        """After a failure: complete every gather, issuing those still queued (`wait`: the peers
        issue them too), or drop them all. Raises the first CollectiveError met, after cleaning up."""
        try:
            if wait:
                self.wait_all()
        finally:
            self._queue.clear()
            self._inflight.clear()
