"""A unit: the module whose parameters are gathered and freed together, and the unit of
gradient reduction. Issues its collectives through the Communicator; states are asserted.

[Note: unit states]
    SHARDED --unshard()--> GATHERING --wait_unshard()--> UNSHARDED --reshard()--> SHARDED
Units that never reshard (stages 0-2, parameters below the persistence threshold) stay UNSHARDED.
A prefetch is an `unshard()` issued early; the consumer's `wait_unshard()` completes it. Every
transition into or out of SHARDED updates the shared LiveCount ([Note: bounded gathering], gathered.py).

[Note: gathering in place at one rank]
At one rank a stage-3 group's shard is its whole flat buffer (shard_numel == padded_numel), so the
all-gather is only a copy of the master into the gathered buffer: every forward would move the
model's bytes twice more (read the shard, write the buffer) and allocate and free a buffer per unit,
more work than a ZeRO-Inference token's read from the NVMe store itself. A group that
is not trained and whose master is in compute dtype on the compute device (fp32 inference from
CPU memory or the memory-mapped NVMe store) therefore gathers in place: `full` *is* the master,
the parameters are views of the store's tensor, and freeing drops those views and releases the
master to its store (the NVMe store drops its pages), never resizing the master's storage. Trained
groups keep the copy: the optimizer updates the master in place, while tensors a user took from
gathered parameters (GatheredParameters) keep the values they were gathered with; so do ZeRO++
units (qwZ quantizes what it gathers, hpZ keeps secondary copies: `gather_must_copy`).

[Note: ZeRO++ and MiCS]
Communication policies of the same stage 3 (core/policy.py `CommunicationPolicy`); `Links` carries the
communicators they need, built by sharded.py from core/mesh.py's rank groups.
  * MiCS (`CommunicationPolicy.shard_size` k): a unit's `comm` is its *partition group*, k consecutive ranks: flat
    layouts are padded and sliced over k, parameters all-gathered and gradients reduce-scattered
    inside it; then each reduced shard is all-reduced over the *replica group* (the ranks holding
    the same shard in the other partition groups), the hierarchical reduction of MiCS §3.3.
    Per rank: model states / k. Sums run in another order than one all-reduce: at 4 ranks, k = 2,
    results match plain stage 3 to rounding, not bit for bit (at k = world it *is* plain stage 3).
  * hpZ (`CommunicationPolicy.secondary_size` h): a primary gather (forward, or any gather that is not for
    backward) leaves every rank a *secondary copy*, its 1/h piece of the gathered parameters
    (FlatGroup.keep_secondary), over the h consecutive ranks of its node; the backward gather of
    the unit (and an activation-checkpointing recomputation inside backward) then runs inside that
    node group from the copies (ZeRO++ §3.2). The values are the gathered ones, bit for bit, so
    the math is plain stage 3's. Any change of the parameters (a step, a load, a modified
    GatheredParameters) drops the copies (FlatGroup.drop_secondary); the next forward's gather
    refreshes them. The piece of the rank at place j of its node is *strided*: the partition
    shards j, j + h, j + 2h, ... (N/h of them), which include the rank's own primary shard (a
    node's ranks are consecutive, and h divides N, so partition rank p = j mod h); that one is not
    copied, the backward reads it from the shard the rank holds anyway. The backward gathers the
    piece as N/h node all-gathers, the m-th of shards mh .. mh + h - 1, each into its contiguous
    slice of the gathered buffer. Cost: padded numel x (1/h - 1/N) per unit between forward and
    step, half of a contiguous piece's 1/h at two nodes.
  * qwZ (`CommunicationPolicy.quantize_weights`): primary gathers send int8 blocks and scales
    (`quantize.all_gather`), dequantized into the gathered buffer; masters stay exact
    fp32, so the quantization error does not accumulate across steps (ZeRO++ §3.1). The backward
    sees exactly the forward's weights: it dequantizes the same shard again, or, with hpZ, the
    secondary copy, which is then kept as received (int8 blocks and scales, ~1 byte per element
    instead of 4; FlatGroup.keep_secondary_encoded) and gathered inside the node as such.
  * qgZ (`CommunicationPolicy.quantize_gradients`): the gradient reduce-scatter is an all-to-all of int8 blocks,
    summed locally in fp32 (`quantize.reduce_scatter`); the MiCS replica all-reduce
    after it stays exact.
Parameters below the persistence threshold are never gathered and are reduced like the others.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.core import quantize
from zeroshard.core.comm import Communicator, Handle
from zeroshard.core.gathered import LiveCount
from zeroshard.core.group import FlatGroup
from zeroshard.core.mesh import consecutive_groups, strided_groups
from zeroshard.core.policy import CommunicationPolicy, Reduction, StagePolicy


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"


@dataclass(frozen=True)
class Links:
    """A unit's collectives beyond its partition group: [Note: ZeRO++ and MiCS]."""

    replica: Communicator | None = None  # MiCS: all-reduce of reduced shards across partition groups
    secondary: Communicator | None = None  # hpZ: the node group the backward gathers inside
    quantize_weights: bool = False  # qwZ
    quantize_gradients: bool = False  # qgZ
    block: int = 256  # elements per quantization block


def build_links(
    comm: Communicator, policy: StagePolicy, communication: CommunicationPolicy
) -> tuple[Communicator, Links]:
    """(partition communicator, Links) of `communication` over `comm`'s ranks ([Note: ZeRO++ and MiCS]
    in core/unit.py). Every rank builds every group, in the same order."""
    communication.check(policy, comm.world_size)
    if communication.ranks_per_node is not None:
        comm.place_on_nodes(communication.ranks_per_node)
    world, shard = comm.world_size, communication.shard_size or comm.world_size
    partition, replica = comm, None
    if shard < world:
        partition = comm.split(consecutive_groups(world, shard))
        replica = comm.split(strided_groups(world, shard))
    secondary = None
    if communication.secondary_size is not None:
        size = communication.secondary_size
        secondary = partition if size == shard else comm.split(consecutive_groups(world, size))
    return partition, Links(
        replica=replica,
        secondary=secondary,
        quantize_weights=communication.quantize_weights,
        quantize_gradients=communication.quantize_gradients,
        block=communication.block,
    )


class Unit:
    def __init__(
        self,
        name: str,
        module: nn.Module | None,
        groups: list[FlatGroup],
        comm: Communicator,
        reshards: bool,
        links: Links = Links(),
        live: LiveCount | None = None,
    ):
        self.name = name  # the module's qualified name; "<root>" for the model itself
        self.module = module
        self.groups = groups
        self.comm = comm  # the partition group: every rank, or a MiCS shard group
        self.links = links
        if links.quantize_weights or links.secondary is not None:  # its gather is more than a copy
            for group in groups:
                group.gather_must_copy = True
        self._keep_secondary = False
        self.reshards = reshards
        self.numel = sum(g.layout.padded_numel for g in groups)
        self.live = live if live is not None else LiveCount()  # shared by a model's units (Lifecycle)
        self._state = UnitState.SHARDED if reshards else UnitState.UNSHARDED
        self.trainable_params = sum(len(g.params) for g in groups if g.trainable)
        # Parameters without a gradient of their own (a LoRA model's base weights) can still be read by
        # backward: [Note: frozen parameters in backward] in lifecycle.py.
        self.frozen = any(not g.trainable for g in groups)
        self.input_grads_pending = 0  # forward calls whose inputs' gradients backward has yet to compute
        self.grads_done = False  # every trainable parameter has its gradient in this backward
        self._gathers: list[Handle | quantize.Composite] = []
        self._reductions: list[tuple[Handle | quantize.Composite, FlatGroup, torch.Tensor | None]] = []
        self.grads_pending = self.trainable_params
        self.reduced_this_backward = False
        self.abandoned: list[torch.Tensor] = []  # see abort()

    @property
    def state(self) -> UnitState:
        return self._state

    @state.setter
    def state(self, new: UnitState) -> None:
        was_sharded, now_sharded = self._state is UnitState.SHARDED, new is UnitState.SHARDED
        if self.reshards and was_sharded != now_sharded:
            (self.live.add if was_sharded else self.live.remove)(self.numel)
        self._state = new

    # -- parameters ---------------------------------------------------------------------------------
    def unshard(self, phase: str) -> None:
        """Start gathering the parameters (no-op unless SHARDED)."""
        if self.state is not UnitState.SHARDED:
            return
        node = self.links.secondary
        from_secondary = node is not None and phase == "backward" and all(g.secondary_valid for g in self.groups)
        # Only a pass with a backward to come needs the copies (not eval, not ZeRO-Inference).
        keep_secondary = node is not None and not from_secondary and torch.is_grad_enabled()
        for group in self.groups:
            if group.gathers_in_place:  # one rank: no copy ([Note: gathering in place at one rank])
                group.gather_in_place(for_compute=phase == "forward" and not torch.is_grad_enabled())
                continue
            what = f"all-gather of unit '{self.name}' parameters ({phase})"
            if from_secondary:  # hpZ: inside the node group, from the copies the forward kept
                self._gathers += self._gather_from_secondary(group, f"{what} from secondary copies")
                continue
            if self.links.quantize_weights:  # qwZ
                keep = (
                    functools.partial(group.keep_secondary_encoded, shards=self._secondary_shards()[1])
                    if keep_secondary
                    else None
                )
                handle = quantize.all_gather(
                    self.comm, group.new_full(), group.gather_input(), what, self.links.block, async_op=True, keep=keep
                )
            else:
                shard = group.gather_input()  # 1-D, this rank's slice, compute dtype
                handle = self.comm.all_gather(group.new_full(), shard, what, async_op=True, counts=group.layout.counts)
            self._gathers.append(handle)
        self._keep_secondary = keep_secondary and not self.links.quantize_weights  # else kept as received
        self.state = UnitState.GATHERING

    def wait_unshard(self) -> None:
        if self.state is UnitState.GATHERING:
            for handle in self._gathers:
                handle.wait()
            self._gathers.clear()
            for group in self.groups:
                if group.gathers_in_place and group.master_store is not None:
                    group.master_store.ready([group.master])  # its read (gather_in_place) has landed
                group.point_params_at_full()
                if not group.gathers_in_place:  # in place, the master is in use until free_full
                    group.release_master()
                if self._keep_secondary:
                    group.keep_secondary(self._secondary_shards()[1])
            self.state = UnitState.UNSHARDED
        assert self.state is UnitState.UNSHARDED, (self.name, self.state)

    def _secondary_shards(self) -> tuple[list[int], list[int]]:
        """hpZ: (the partition shards of this rank's strided piece, those of them it copies: all but
        its own primary shard); see [Note: ZeRO++ and MiCS]."""
        node = self.links.secondary
        assert node is not None  # hpZ
        piece = list(range(node.rank, self.comm.world_size, node.world_size))
        assert self.comm.rank in piece, (self.comm.rank, piece)  # consecutive nodes, h divides N
        return piece, [shard for shard in piece if shard != self.comm.rank]

    def _gather_from_secondary(self, group: FlatGroup, what: str) -> list:
        """hpZ's backward gather: one node all-gather per shard of the piece (the m-th fills the
        gathered buffer's shards mh .. mh + h - 1), the own shard read from the primary shard,
        quantized again with qwZ (the same values as the forward's: quantization is deterministic)."""
        node, full = self.links.secondary, group.new_full()
        assert node is not None and group.secondary is not None  # hpZ, with the copies the forward kept
        numel, h = group.layout.shard_numel, node.world_size
        quantized = group.secondary_scales is not None
        own: tuple = quantize.quantize(group.gather_input(), self.links.block) if quantized else (group.gather_input(),)
        copies = iter(
            zip(group.secondary, group.secondary_scales)
            if group.secondary_scales is not None
            else ((row,) for row in group.secondary)
        )
        handles = []
        for m, shard in enumerate(self._secondary_shards()[0]):
            out = full[m * h * numel : (m + 1) * h * numel]  # 1-D, numel = h x shard_numel
            mine: tuple = own if shard == self.comm.rank else next(copies)
            if quantized:
                q, scales = mine
                handles.append(
                    quantize.all_gather_encoded(
                        node, out, q, scales, f"{what} ({m})", h, self.links.block, async_op=True
                    )
                )
            else:
                handles.append(node.all_gather(out, mine[0], f"{what} ({m})", async_op=True))
        return handles

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
            group.complete_full_grad()  # [Note: a fresh full gradient] in group.py
            group.prescale(1.0 / average_over)  # [Note: the pre-divide in the copy]
            self._reductions.append(self._reduce_group(group))
        self.reduced_this_backward = True

    def _reduce_group(self, group: FlatGroup):
        what = f"gradient reduction of unit '{self.name}'"
        assert group.full_grad is not None  # reduce_grads made it
        if group.reduction is Reduction.ALL_REDUCE:  # stage 0: every rank keeps everything, like DDP
            return self.comm.all_reduce(group.full_grad, what, async_op=True), group, None
        if group.reduction is Reduction.REDUCE_SCATTER_IN_PLACE:
            # Stage 1: this rank's slice of full_grad becomes its reduced gradient.
            out = group.full_grad[slice(*group.layout.shard_range(group.rank))]
            handle = self.comm.reduce_scatter(out, group.full_grad, what, async_op=True, counts=group.layout.counts)
            return handle, group, None
        out = torch.empty(group.layout.shard_size(group.rank), dtype=group.grad_dtype, device=group.device)  # 2/3
        if self.links.quantize_gradients:  # qgZ
            return (
                quantize.reduce_scatter(self.comm, out, group.full_grad, what, self.links.block, async_op=True),
                group,
                out,
            )
        handle = self.comm.reduce_scatter(out, group.full_grad, what, async_op=True, counts=group.layout.counts)
        return handle, group, out

    # [Note: taken as they land]
    # Stages 0/1 never wait for a reduction inside backward ([Note: one reduction in flight]). Left in
    # flight until end_backward, every unit's reduction would keep its temporaries (at stage 1, the
    # peer's half of each block): all of them alive at once, freed together at the end of backward and
    # returned to the kernel, so every backward would touch them afresh, page fault by page fault
    # (measured: docs/performance.md, "Stages 0/1 never wait for a reduction inside backward"). So after
    # issuing a unit's reduction the lifecycle takes the earlier ones that have already completed, in
    # order, without waiting: their temporaries are freed and reused by the next ones. Stages 2/3 wait
    # for unit k's reduction only once the next unit's is issued, so k's full gradient stays alive
    # through the next unit's whole backward, beside that unit's own: there the lifecycle also takes
    # what has landed whenever a group is about to make a new full gradient, which then reuses k's
    # buffer ([Note: spent full gradients reused]). The reduced values land as they would at
    # end_backward or at the next issue, in the same order; MiCS's second reduction (a collective of its
    # own) is left for the end.
    def reduction_done(self) -> bool:
        """Could `finish_reduce` run now without waiting? (MiCS's second reduction would wait: no.)"""
        return self.links.replica is None and all(handle.done() for handle, _, _ in self._reductions)

    def finish_reduce(self) -> None:
        across = []  # MiCS: the shards reduced in the partition group, then over the replica group
        for handle, group, out in self._reductions:
            handle.wait()
            if out is not None and self.links.replica is not None:
                what = f"gradient reduction of unit '{self.name}' across partition groups"
                across.append((self.links.replica.all_reduce(out, what, async_op=True), group, out))
            else:
                self._take_reduced(group, out)
        for handle, group, out in across:
            handle.wait()
            self._take_reduced(group, out)
        self._reductions.clear()

    @staticmethod
    def _take_reduced(group: FlatGroup, out: torch.Tensor | None) -> None:
        if group.grads_persist_full:  # stages 0/1: [Note: a second reduction before the step]
            group.restore_reduced_slice()
        if out is not None:
            group.add_reduced(out)  # [Note: gradient shard lifetime] in group.py
            group.drop_full_grad()  # stages 2/3: the full gradient lives only until reduced

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


class InflightReductions:
    """The units whose gradient reduction is in flight, oldest first ([Note: taken as they land])."""

    def __init__(self):
        self.units: list[Unit] = []

    def __bool__(self) -> bool:
        return bool(self.units)

    def add(self, unit: Unit) -> None:
        self.units.append(unit)

    def take_landed(self) -> None:
        """Finish, oldest first, the reductions that have completed; never waits."""
        while self.units and self.units[0].reduction_done():
            self.units.pop(0).finish_reduce()

    def keep_at_most(self, count: int) -> None:
        """Wait for the oldest until at most `count` are in flight."""
        while len(self.units) > count:
            self.units.pop(0).finish_reduce()

    def finish_all(self) -> None:
        for unit in self.units:
            unit.finish_reduce()
        self.units.clear()

    def clear(self) -> None:
        self.units.clear()
