"""One flat group: the parameters of one unit that share a fate (same optimizer param group, same
requires_grad), their flat buffers, and how the module's parameters point into them.

[Note: parameter storage]
Module parameters stay the user's `nn.Parameter` objects (names, optimizer groups and hooks keep
working); only their `.data` changes:
  * unsharded: `.data` is a view of the group's full flat buffer (see [Note: flat layout]);
  * sharded (stage 3 between uses): `.data` is an empty tensor, and the full buffer's *storage* is
    resized to zero bytes. Resizing the storage, not dropping the tensor, is what frees the memory:
    autograd saves views of the parameters (`weight.t()` for a Linear's backward), and those views
    would otherwise keep every unit's gathered parameters alive from forward until backward.
    Before the unit's backward the storage is grown back and gathered into again, so the saved
    views see the same values as in forward, and `.data` is re-pointed at fresh views.
The fp32 master shard is what the optimizer updates. Where it lives is decided by shard.py
([Note: master placement]): in compute memory with fp32 compute it is the parameter storage itself
(this rank's slice of the full buffer at stages 0-2, the only copy at stage 3); otherwise it is a
separate fp32 tensor, in an offload store when there is one. A stage-3 group whose master lives where
the compute device cannot address it keeps `compute_shard`, this rank's shard in compute dtype on the
device, which is what its all-gathers read.

[Note: deferred values]
Parameters on the meta device have shapes and no values: a model built under `torch.device("meta")`
so that it is never materialised in full (ZeRO-Inference loading, compat/inference.py). Their group
allocates its buffers on the compute device (`device`) zero filled, each parameter becomes (in place,
`torch.utils.swap_tensors`, so modules and ties keep the same objects) an empty tensor of that device
whose `.data` the group re-points as for any other parameter, and whoever built the model writes
each rank's master shard afterwards (checkpoint/weights.py reads only this rank's element ranges),
then refreshes the parameters. No full buffer of a resharding group is ever made for them.

A DTensor parameter (tensor parallelism) is flattened by its local tensor. It cannot be re-pointed
through `.data` (that leaves its local tensor in place), so it is re-pointed once: at construction it
is swapped (`torch.utils.swap_tensors`, the same object keeps its identity, hooks and optimizer
entry) with a DTensor over the same tp mesh whose local tensor is a view of the full buffer. From
then on only the buffer's storage is freed and grown back, never the views and never the buffer
(FSDP2 keeps its unsharded DTensor parameters the same way); see [Note: ZeRO over the data-parallel
dimension].
This module holds state and does arithmetic; collectives are issued by unit.py through comm.py.
"""

from __future__ import annotations

import torch
from torch import nn

from zeroshard.core.flat import FlatLayout
from zeroshard.core.grad_buffers import GradientBuffers, SpentGradients
from zeroshard.core.mesh import TensorParallelSpec, local_tensor
from zeroshard.core.policy import StagePolicy
from zeroshard.core.precision import PrecisionPolicy


class FlatGroup(GradientBuffers):
    """`policy` says what is sharded, `precision` which dtypes compute and reduce, `reshards` whether
    the full buffer is freed between uses (stage-3 units above the persistence threshold); every
    other choice of this class is derived from them, never from buffer shapes."""

    def __init__(
        self,
        names: list[str],
        params: list[nn.Parameter],
        *,
        policy: StagePolicy,
        precision: PrecisionPolicy,
        world_size: int,
        rank: int,
        reshards: bool,
        optimizer_group: int | None,
        master_store=None,
        grad_store=None,
        compute_shard: bool = False,
        device: torch.device | None = None,
    ):
        self.names = names
        self.params = params
        self.tp_specs = [TensorParallelSpec.of(p) for p in params]  # None for a plain tensor
        self._swapped = False  # DTensor parameters already point at the full buffer
        self.layout = FlatLayout(names, [local_tensor(p).shape for p in params], world_size)
        self.rank = rank
        self.policy = policy
        self.reshards = reshards
        self.reduction = policy.reduction
        self.param_dtype = precision.param_dtype
        self.grad_dtype = precision.reduce_dtype  # accumulation and reduction dtype (see precision.py)
        self.optimizer_group = optimizer_group  # index into optimizer.param_groups, None = not optimized
        self.trainable = optimizer_group is not None
        # Offload stores (core/placement.py) that hold the master and the gradient shard, or None.
        self.master_store = master_store
        self.grad_store = grad_store
        deferred = params[0].device.type == "meta"  # see [Note: deferred values]
        device = (device or torch.device("cpu")) if deferred else params[0].device
        self.device = device
        # Set by its unit when the gather does more than copy (ZeRO++ qwZ quantizes, hpZ keeps secondary
        # copies): then it never gathers in place ([Note: gathering in place at one rank] in unit.py).
        self.gather_must_copy = False
        if deferred:
            for param in params:
                placeholder = nn.Parameter(torch.empty(0, dtype=param.dtype, device=device), param.requires_grad)
                torch.utils.swap_tensors(param, placeholder)
        full = (
            None if deferred else self.layout.flatten([local_tensor(p.detach()) for p in params], torch.float32)
        )  # 1-D, padded
        # The range this rank's optimizer updates: its shard, or the whole buffer for stage 0.
        sharded = policy.shard_optimizer
        start, end = self.layout.shard_range(rank) if sharded else (0, self.layout.padded_numel)
        self.opt_range = (start, end)
        self.full: torch.Tensor | None = None  # param_dtype, 1-D, numel = padded_numel
        self.master: torch.Tensor  # fp32, 1-D, numel = end - start
        self.compute_shard: torch.Tensor | None = None  # param_dtype, 1-D, numel = shard_numel, on device
        # hpZ's secondary copy: param_dtype, (shards, shard_numel), the node piece's shards other than
        # this rank's own ([Note: ZeRO++ and MiCS] in unit.py); valid from a gather until the parameters change.
        self.secondary: torch.Tensor | None = None
        self.secondary_scales: torch.Tensor | None = None  # with qwZ the copy is int8 blocks + scales
        self.secondary_valid = False
        self._init_storage(full, compute_shard)
        # Gradients: full flat buffer kept across micro steps (stages 0/1), or built per backward and
        # reduce-scattered into `grad_shard` (stages 2/3), which lives only from the first reduction
        # of a window to its step ([Note: gradient shard lifetime]).
        self.full_grad: torch.Tensor | None = None
        self.spent = SpentGradients()  # Lifecycle shares one over all units: [Note: spent full gradients reused]
        self._unwritten: list[bool] | None = None  # [Note: a fresh full gradient]
        self._scaled: list[bool] | None = None  # [Note: the pre-divide in the copy]
        self.grad_shard: torch.Tensor | None = None  # grad_dtype, 1-D, numel = shard_numel
        self.reduced_slice: torch.Tensor | None = None  # see [Note: a second reduction before the step]
        self.holds_reduced_slice = False
        # Which parameters got a gradient on this rank since the last step ([Note: parameters
        # without a gradient] in masked.py).
        self.grad_seen = [False] * len(self.layout.slots)
        if self.trainable:
            if self.grads_persist_full:
                self.full_grad = self.zeros_full_grad()
            elif grad_store is not None:
                self.grad_shard = grad_store.tensor(f"{names[0]}.grad", self.layout.shard_numel, self.grad_dtype)

    @property
    def keep_full(self) -> bool:
        """Is the full (unsharded) parameter buffer kept between uses?"""
        return not self.reshards

    @property
    def sharded_master(self) -> bool:
        """Does `master` hold only this rank's shard (stages 1-3), not the whole buffer (stage 0)?"""
        return self.policy.shard_optimizer

    def _init_storage(self, full_fp32: torch.Tensor | None, compute_shard: bool) -> None:
        """`full_fp32` None: deferred values ([Note: deferred values]); buffers start zero filled."""
        start, end = self.opt_range
        if full_fp32 is None and self.keep_full:  # small (persistent) or unsharded groups only
            full_fp32 = torch.zeros(self.layout.padded_numel, dtype=torch.float32, device=self.device)
        if self.keep_full and self.param_dtype == torch.float32 and self.master_store is None:
            assert full_fp32 is not None  # made above when it keeps the full buffer
            self.full = full_fp32
            self.master = full_fp32[start:end]  # a view: the parameters *are* the master weights
            self.point_params_at_full()
            return
        if self.master_store is not None:
            self.master = self.master_store.tensor(f"{self.names[0]}.master", end - start, torch.float32)
            if full_fp32 is not None:
                self.master.copy_(full_fp32[start:end])
            self.master_store.release([self.master])
        elif full_fp32 is None:
            self.master = torch.zeros(end - start, dtype=torch.float32, device=self.device)
        else:
            self.master = full_fp32[start:end].clone()
        if self.keep_full:
            assert full_fp32 is not None  # made above when it keeps the full buffer
            self.full = full_fp32.to(self.param_dtype)  # fp32 with an offloaded master: the buffer itself
            self.point_params_at_full()
            return
        if compute_shard:
            self.compute_shard = (
                full_fp32[start:end].to(self.param_dtype, copy=True)
                if full_fp32 is not None
                else torch.zeros(end - start, dtype=self.param_dtype, device=self.device)
            )
        if any(self.tp_specs):  # DTensor parameters need views of the storage gathers will fill
            self.point_params_at_full(self.new_full())
        self.free_full()

    # -- parameter storage ----------------------------------------------------------------------------
    def point_params_at_full(self, full: torch.Tensor | None = None) -> None:
        swap = not self._swapped
        full = self.full if full is None else full
        assert full is not None  # gathered, or given
        for param, view, spec in zip(self.params, self.layout.views(full), self.tp_specs):
            if spec is None:
                param.data = view
            elif swap:  # once: see [Note: parameter storage]
                torch.utils.swap_tensors(param, spec.parameter(view, param.requires_grad))
        self._swapped = True

    def free_full(self, release: bool = False) -> None:
        """Free the gathered storage; parameters become empty (see [Note: parameter storage]).
        `release`: drop the buffer instead of shrinking its storage, so tensors the user took from
        the gathered parameters (`p.data.cpu()` is no copy on CPU) keep their values; for gathers
        outside forward/backward, where autograd saved no views (GatheredParameters)."""
        empty = torch.empty(0, dtype=self.param_dtype, device=self.device)
        for param, spec in zip(self.params, self.tp_specs):
            if spec is None:  # a DTensor keeps its view; the storage under it is freed below
                param.data = empty
        if self.gathers_in_place:  # `full` is the master: drop it, never shrink the store's storage
            if self.full is not None and self.master_store is not None:
                self.master_store.release([self.master])
            self.full = None
            return
        if self.full is not None and not self.keep_full:
            if release and not any(self.tp_specs):  # DTensor views stay on this buffer for good
                self.full = None  # new_full() allocates afresh; memory goes when the last view does
            else:
                self.full.untyped_storage().resize_(0)

    def new_full(self) -> torch.Tensor:
        """The full buffer to gather into: the *same* storage every time, grown back to size."""
        if self.full is None:
            self.full = torch.empty(self.layout.padded_numel, dtype=self.param_dtype, device=self.device)
        else:
            self.full.untyped_storage().resize_(self.layout.padded_numel * self.full.element_size())
        return self.full

    @property
    def gathers_in_place(self) -> bool:
        """Is the master itself the gathered buffer? See [Note: gathering in place at one rank] in unit.py."""
        return (
            self.reshards
            and self.layout.world_size == 1
            and not self.trainable
            and not self.gather_must_copy
            and self.compute_shard is None
            and not any(self.tp_specs)
            and self.master.dtype == self.param_dtype
            and self.master.device == self.device
        )

    def gather_in_place(self) -> None:
        """The unshard of a group that gathers in place: ask the store for the master's pages (the
        read runs ahead of use, while earlier units compute) and use the master as the buffer."""
        if self.master_store is not None:
            self.master_store.prefetch([self.master])
        self.full = self.master

    def gather_input(self) -> torch.Tensor:
        """This rank's shard of the parameters in compute dtype (input of the all-gather)."""
        # Only sharded (stage-3) groups gather from the master, and there opt_range is the shard.
        assert self.master.numel() == self.layout.shard_numel
        if self.compute_shard is not None:
            return self.compute_shard
        if self.master_store is not None:  # the all-gather reads it at once: a read into a buffer lands first
            self.master_store.prefetch([self.master])
            self.master_store.ready([self.master])
        if self.master.dtype == self.param_dtype and self.master.device == self.device:
            return self.master
        return self.master.to(device=self.device, dtype=self.param_dtype)

    def release_master(self) -> None:
        """An offloaded master shard is not needed until its next use: let the store write it out."""
        if self.master_store is not None and self.compute_shard is None:
            self.master_store.release([self.master])

    def master_pieces(self, tensor: torch.Tensor | None = None):
        """(slot, lo, hi, view) per parameter piece in this rank's optimizer range: elements [lo, hi)
        of the flattened parameter are `view`, a slice of `tensor` (1-D, laid out like `master`;
        default: the master itself)."""
        start, end = self.opt_range
        target = self.master if tensor is None else tensor
        for slot, lo, hi in self.layout.pieces_in(start, end):
            yield slot, lo, hi, target[slot.offset + lo - start : slot.offset + hi - start]

    def own_slice_of_full(self) -> torch.Tensor:
        start, end = self.layout.shard_range(self.rank)
        assert self.full is not None  # gathered
        return self.full[start:end]

    def master_is_view_of_full(self) -> bool:
        return (
            self.full is not None and self.full.untyped_storage().data_ptr() == self.master.untyped_storage().data_ptr()
        )

    def master_is_parameter_storage(self) -> bool:
        """Is the master the parameters' own storage (zero copy; see [Note: master placement])?"""
        if self.keep_full:
            return self.master_is_view_of_full()
        return self.compute_shard is None and self.param_dtype == torch.float32  # stage 3: the shard

    def copy_full_into_master(self) -> None:
        """After the full parameters were changed in place (GatheredParameters with a modifier rank):
        this rank's master shard (and compute shard) take the new values."""
        start, end = self.opt_range
        self.drop_secondary()
        assert self.full is not None  # gathered
        if not self.master_is_view_of_full():
            self.master.copy_(self.full[start:end])  # to the master's store and dtype
        if self.compute_shard is not None:
            self.compute_shard.copy_(self.full[start:end])

    def copy_master_into_params(self) -> None:
        """After the optimizer step (or a load): this rank's compute copy follows its master: its slice
        of a separately stored full buffer (stages 0-2) or its compute shard (stage 3)."""
        start, end = self.opt_range
        self.drop_secondary()
        if self.keep_full and not self.master_is_view_of_full():
            assert self.full is not None  # kept
            self.full[start:end].copy_(self.master)  # casts to the compute dtype and device
        if self.compute_shard is not None:
            self.compute_shard.copy_(self.master)

    def keep_secondary(self, shards: list[int]) -> None:
        """hpZ: keep the gathered parameters' shards `shards` (partition-group shard indices), one row each."""
        assert self.full is not None  # gathered
        self.secondary = self.full.view(-1, self.layout.shard_numel)[shards].clone()  # (len, shard_numel)
        self.secondary_valid = True

    def keep_secondary_encoded(self, q_all: torch.Tensor, scales_all: torch.Tensor, *, shards: list[int]) -> None:
        """hpZ with qwZ: keep shards `shards` of what the quantized gather received (int8 blocks and
        their scales, rank-major), ~1 byte per element instead of the dequantized values;
        gathering and dequantizing them again gives the forward's values bit for bit."""
        world = self.layout.padded_numel // self.layout.shard_numel  # the partition group
        self.secondary = q_all.view(world, -1)[shards].clone()  # int8, (len, blocks x block)
        self.secondary_scales = scales_all.view(world, -1)[shards].clone()  # fp32, (len, blocks)
        self.secondary_valid = True

    def drop_secondary(self) -> None:
        """The parameters change (a step, a load, a modification): the secondary copy is stale."""
        self.secondary = self.secondary_scales = None
        self.secondary_valid = False

    # -- accounting ------------------------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        """Bytes of model states this rank holds for this group at rest."""

        def nbytes(t):
            return 0 if t is None else t.numel() * t.element_size()

        def in_memory(t):  # tensors an NVMe store holds are reported by the store
            stores = [s for s in (self.master_store, self.grad_store) if s is not None]
            return 0 if t is None or not all(s.resident(t) for s in stores) else nbytes(t)

        if self.keep_full:
            params = nbytes(self.full)
        elif self.compute_shard is not None:
            params = nbytes(self.compute_shard)
        else:  # stage 3 gathers from the master: in fp32 it is the parameter shard, else a copy
            params = in_memory(self.master) if self.param_dtype == torch.float32 else 0
        params += nbytes(self.secondary) + nbytes(self.secondary_scales) if self.secondary_valid else 0  # hpZ
        master = 0 if self.master_is_parameter_storage() else in_memory(self.master)
        if self.grads_persist_full:
            grads = nbytes(self.full_grad)
        elif self.grad_shard_is_transient:  # at its size, also between steps, when it is freed
            grads = self.layout.shard_numel * self.grad_dtype.itemsize
        else:
            grads = in_memory(self.grad_shard)
        return {"params": params, "master": master, "grads": grads}

    def destroy(self) -> None:
        empty = torch.empty(0, dtype=self.param_dtype, device=self.device)
        for param, spec in zip(self.params, self.tp_specs):
            if spec is None:
                param.data = empty
        self.full = None
        self.compute_shard = None
        self.secondary = self.secondary_scales = None
        self.full_grad = None
        self.grad_shard = None
        self.master = torch.empty(0)
