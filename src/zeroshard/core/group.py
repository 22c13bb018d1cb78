"""One flat group: the parameters of one unit that share a fate (same optimizer param group, same
requires_grad), their flat buffers, how the module's parameters point into them, and their gradients:
the full buffer a unit's backward fills, the reduced shard the step reads, and the slice set aside
between two reductions ([Note: a fresh full gradient], [Note: gradient shard lifetime], [Note: a
second reduction before the step]).

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
so that it is never materialised in full (ZeRO-Inference loading, inference/pretrained.py). Their group
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
from zeroshard.core.mesh import TensorParallelSpec, local_tensor
from zeroshard.core.policy import PrecisionPolicy, StagePolicy


# [Note: spent full gradients reused]
# At stages 2/3 each unit's full gradient is made empty by its first gradient and dropped once its
# reduce-scatter is waited for. A buffer above glibc's mmap threshold is fresh pages each time it is
# made, and their first-touch faults, on the main thread, take most of the gradient copy's time
# (measured: docs/performance.md, "Spent full gradients reused"). On a CPU the groups are cut under
# glibc's ceiling ([Note: gathered buffers under glibc's mmap ceiling] in backend.py), and on a GPU the
# caching allocator reuses blocks, but a buffer handed over directly still skips the allocator. Within
# one backward a buffer whose reduction completed is handed to the next unit of the same size
# (`SpentGradients`); its stale values are treated as an empty buffer's ([Note: a fresh full gradient]).
# Only buffers of completed reductions are kept (an abandoned one may still be written by a peer), and
# none outlives the backward: Lifecycle.end_backward and abort clear them, so the step and the next
# forward hold what they held before.
class SpentGradients:
    """Full-gradient buffers of completed reductions, by (numel, dtype, device), for this backward."""

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def give(self, tensor: torch.Tensor) -> None:
        self._free.setdefault((tensor.numel(), tensor.dtype, tensor.device), []).append(tensor)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        kept = self._free.get((numel, dtype, device))
        return kept.pop() if kept else torch.empty(numel, dtype=dtype, device=device)

    def clear(self) -> None:
        self._free.clear()


class FlatGroup:
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
        owners: list[int] | None = None,
        uneven: bool = False,
        master_store=None,
        grad_store=None,
        compute_shard: bool = False,
        device: torch.device | None = None,
    ):
        self.names = names
        self.params = params
        self.tp_specs = [TensorParallelSpec.of(p) for p in params]  # None for a plain tensor
        self._swapped = False  # DTensor parameters already point at the full buffer
        # owners: a whole-parameter optimizer's group ([Note: whole-parameter ownership] in owners.py)
        self.layout = FlatLayout(names, [local_tensor(p).shape for p in params], world_size, owners, uneven)
        self.rank = rank
        self.policy = policy
        self.reshards = reshards
        self.reduction = policy.reduction
        self.param_dtype = precision.param_dtype
        self.master_dtype = precision.master_dtype  # fp32, or bf16 ([Note: bf16 master weights])
        self.params_are_masters = precision.params_are_masters
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
        # Set by an inference engine whose Linear layers read some of this group's weights packed from
        # a quantized store ([Note: packed matmuls] in inference/packed.py).
        self.packed_reads = False
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
        self.master: torch.Tensor  # master_dtype, 1-D, numel = end - start
        self.compute_shard: torch.Tensor | None = None  # param_dtype, 1-D, numel = this rank's slice, on device
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
        self.grad_shard: torch.Tensor | None = None  # grad_dtype, 1-D, numel = this rank's slice
        self.reduced_slice: torch.Tensor | None = None  # see [Note: a second reduction before the step]
        self.holds_reduced_slice = False
        # Which parameters got a gradient on this rank since the last step ([Note: parameters
        # without a gradient] in core/optim/masked.py).
        self.grad_seen = [False] * len(self.layout.slots)
        if self.trainable:
            if self.grads_persist_full:
                self.full_grad = self.zeros_full_grad()
            elif grad_store is not None:
                self.grad_shard = grad_store.tensor(f"{names[0]}.grad", self.layout.shard_size(rank), self.grad_dtype)

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
        if self.keep_full and self.params_are_masters and self.master_store is None:
            assert full_fp32 is not None  # made above when it keeps the full buffer
            self.full = full_fp32.to(self.master_dtype)
            self.master = self.full[start:end]  # a view: the parameters *are* the master weights
            self.point_params_at_full()
            return
        if self.master_store is not None:
            self.master = self.master_store.tensor(
                f"{self.names[0]}.master", end - start, self.master_dtype, pieces=self.whole_pieces()
            )
            if full_fp32 is not None:
                self.open_master()
                self.master.copy_(full_fp32[start:end])
            self.master_store.release([self.master])
        elif full_fp32 is None:
            self.master = torch.zeros(end - start, dtype=self.master_dtype, device=self.device)
        else:
            self.master = full_fp32[start:end].to(self.master_dtype, copy=True)
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
        if self.packed_reads and full.numel() and not full.untyped_storage().nbytes():
            # Every weight here is read packed from the store, which gave the master no fp32 storage:
            # the parameters keep their shapes over one zero ([Note: packed matmuls] in inference/packed.py).
            zero = torch.zeros(1, dtype=full.dtype, device=full.device)
            views = [zero.expand(slot.shape) for slot in self.layout.slots]
        else:
            views = self.layout.views(full)
        for param, view, spec in zip(self.params, views, self.tp_specs):
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

    def gather_in_place(self, for_compute: bool = False) -> None:
        """The unshard of a group that gathers in place: ask the store for the master's pages (the
        read runs ahead of use, while earlier units compute) and use the master as the buffer.
        `for_compute`: for a forward, which may read packed weights in place of some of the values
        (`packed_reads`: [Note: packed matmuls] in inference/packed.py)."""
        if self.master_store is not None and for_compute and self.packed_reads:
            self.master_store.prefetch_for_compute([self.master])
        elif self.master_store is not None:
            self.master_store.prefetch([self.master])
        self.full = self.master

    def gather_input(self) -> torch.Tensor:
        """This rank's shard of the parameters in compute dtype (input of the all-gather)."""
        # Only sharded (stage-3) groups gather from the master, and there opt_range is the shard.
        assert self.master.numel() == self.layout.shard_size(self.rank)
        if self.compute_shard is not None:
            return self.compute_shard
        if self.master_store is not None:  # the all-gather reads it at once: a read into a buffer lands first
            self.master_store.prefetch([self.master])
            self.master_store.ready([self.master])
        if self.master.dtype == self.param_dtype and self.master.device == self.device:
            return self.master
        return self.master.to(device=self.device, dtype=self.param_dtype)

    def whole_pieces(self) -> list[tuple[int, torch.Size]]:
        """(offset in the master, shape) of each parameter that lies whole in this rank's range."""
        start, end = self.opt_range
        return [
            (slot.offset + lo - start, slot.shape)
            for slot, lo, hi in self.layout.pieces_in(start, end)
            if lo == 0 and hi == slot.numel
        ]

    def open_master(self) -> None:
        """Before writing the master outside a step: a store that frees a released tensor's storage
        (the quantized store, inference/store.py) brings its values back."""
        if self.master_store is not None and self.master.numel() and not self.master.untyped_storage().nbytes():
            self.master_store.stage([self.master])
            self.master_store.ready([self.master])

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
        return self.compute_shard is None and self.params_are_masters  # stage 3: the shard

    def copy_full_into_master(self) -> None:
        """After the full parameters were changed in place (GatheredParameters with a modifier rank):
        this rank's master shard (and compute shard) take the new values."""
        start, end = self.opt_range
        self.drop_secondary()
        assert self.full is not None  # gathered
        if not self.master_is_view_of_full():
            self.open_master()
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

    # -- gradients -------------------------------------------------------------------------------------
    @property
    def grads_persist_full(self) -> bool:
        """Stages 0/1: the full gradient buffer lives across micro steps."""
        return not self.policy.shard_gradients

    @property
    def grad_shard_is_transient(self) -> bool:
        """Is the gradient shard freed after each step ([Note: gradient shard lifetime])? Stages 2/3
        with the shard in compute memory; a store's shard stays where the store put it."""
        return self.trainable and not self.grads_persist_full and self.grad_store is None

    def grad(self) -> torch.Tensor | None:
        """The gradient this rank accumulates: the full buffer (stages 0/1) or its shard (2/3),
        zeros where nothing was reduced since the last step."""
        if self.grads_persist_full:
            self.complete_full_grad()  # [Note: zeroed when first read]
            return self.full_grad
        return self._own_grad_shard() if self.trainable else None

    def zeros_full_grad(self) -> torch.Tensor:
        return torch.zeros(self.layout.padded_numel, dtype=self.grad_dtype, device=self.device)

    # [Note: a fresh full gradient]
    # At stages 2/3 a unit's full gradient buffer is made by its first gradient of each backward and
    # freed once reduced. Zero filling it and adding each gradient to the zeros would write and read the
    # whole buffer once more per unit, on the main thread (measured: docs/performance.md, "Stage 3's
    # full gradient"): so it is allocated empty, a slot's first gradient is copied in, later ones (a
    # tied or reused parameter) are added, and `complete_full_grad` zeroes what no gradient wrote (slots
    # without one, the padding) before the reduction reads the buffer. Bit for bit 0 + g, except that a
    # -0.0 stays -0.0 (DDP keeps it too; no update it feeds differs).
    def add_grad(self, index: int, grad: torch.Tensor, scale: float | None = None) -> None:
        """Add a parameter's gradient to its slot. `scale`: the backward reduces this buffer, which
        is multiplied by it first ([Note: the pre-divide in the copy])."""
        if self.full_grad is None:
            self.full_grad = self.spent.take(self.layout.padded_numel, self.grad_dtype, self.device)
            self._mark_unwritten()
        slot = self.layout.slots[index]
        spec = self.tp_specs[index]
        if spec is not None:
            grad = spec.local_grad(grad)
        target = self.full_grad[slot.offset : slot.offset + slot.numel]
        grad = grad.reshape(-1)
        if self._scaled is not None and self._scaled[index]:
            target.add_(grad, alpha=scale)  # a second gradient in the same backward (a pipeline's)
        elif self._unwritten is not None and self._unwritten[index]:
            if scale is not None and grad.dtype == target.dtype:
                torch.mul(grad, scale, out=target)
                self._scaled = self._scaled or [False] * len(self.layout.slots)
                self._scaled[index] = True
            else:
                target.copy_(grad)
            self._unwritten[index] = False
        else:
            target.add_(grad)
        self.grad_seen[index] = True

    # [Note: the pre-divide in the copy]
    # A reduction pre-divides the buffer by the world size (unit.py reduce_grads), one more pass over it
    # after the copies that filled it (measured: docs/performance.md, "The pre-divide in the copy"). DDP
    # multiplies each gradient by 1/N as it copies it into its bucket; so does add_grad when the
    # backward will reduce (`scale`) and the slot is written for the first time in the window:
    # torch.mul(grad, 1/N, out=slot) is the copy followed by mul_(1/N), element for element. `_scaled`
    # marks those slots; `prescale` multiplies the others (accumulated over earlier micro-steps, or of
    # another dtype than the buffer) and clears the marks. A second gradient into a marked slot before
    # the reduction is added times 1/N: exact for N a power of two (a /2^k is exact), within one
    # rounding of (a + b)/N otherwise.
    def prescale(self, scale: float) -> None:
        """Multiply by `scale` what add_grad did not, before a reduction."""
        marks, self._scaled = self._scaled, None
        assert self.full_grad is not None  # what is about to be reduced
        if marks is None:
            self.full_grad.mul_(scale)
            return
        for slot, done in zip(self.layout.slots, marks):
            if not done:
                self.full_grad[slot.offset : slot.offset + slot.numel].mul_(scale)

    # [Note: zeroed when first read]
    # Stages 0/1 keep their full gradient buffer across steps. Zeroing it in zero_grads and adding the
    # next backward's gradients to the zeros would write the buffer once more per step and read it once
    # more per gradient (measured: docs/performance.md, "Stages 0/1's kept gradient buffer"); DDP copies
    # a bucket's first gradient instead. So zero_grads (and setting the reduced slice aside) only marks
    # every slot unwritten, as a fresh buffer's are ([Note: a fresh full gradient]), and the stale
    # values stay until a gradient is copied over them; whoever reads the buffer otherwise goes through
    # `grad()` / `grad_for_optimizer()` (a checkpoint, safe_*_grad, a step without a backward) or the
    # reduction, which first zero what is still unwritten.
    def _mark_unwritten(self) -> None:
        self._unwritten = [True] * len(self.layout.slots)
        self._scaled = None

    def complete_full_grad(self) -> None:
        """Zero what no gradient wrote since the buffer was made or marked unwritten ([Note: a fresh
        full gradient], [Note: zeroed when first read]); no-op when nothing is marked."""
        if self.full_grad is None or self._unwritten is None:
            return
        for slot, unwritten in zip(self.layout.slots, self._unwritten):
            if unwritten:
                self.full_grad[slot.offset : slot.offset + slot.numel].zero_()
        for lo, hi in self.layout.padding:
            self.full_grad[lo:hi].zero_()
        self._unwritten = None

    def note_loaded_grads(self) -> None:
        """Gradients accumulated before a checkpoint (saved mid-window) were loaded: a slot counts
        as having had a gradient where the part held here is non-zero (the checkpoint does not say
        which had one; the step's all-reduce of these flags joins every rank's part)."""
        grad = self.grad()
        assert grad is not None  # a trainable group's, which a checkpoint gave values
        start = 0 if self.grads_persist_full else self.layout.shard_range(self.rank)[0]
        end = start + grad.numel()
        for index, slot in enumerate(self.layout.slots):
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if lo < hi and bool(grad[lo - start : hi - start].any()):
                self.grad_seen[index] = True

    def drop_full_grad(self) -> None:
        """Stages 2/3, its reduction completed: the full gradient goes to the next unit of this
        backward ([Note: spent full gradients reused])."""
        assert self.full_grad is not None  # the buffer reduce_grads reduced
        self.spent.give(self.full_grad)
        self.full_grad = None

    # [Note: gradient shard lifetime]
    # At stages 2/3 the reduced gradient shard (this rank's 1/N of the gradients, 4Ψ/N bytes in fp32)
    # is needed only from the window's first reduction to its step. Kept allocated between steps and
    # zeroed, as a persistent buffer would be, it sits under the next forward's activations, the
    # largest thing a training step allocates: so it is freed by the step and by zero_grads (what
    # torch's zero_grad(set_to_none=True) does for FSDP2's sharded gradients), and the first
    # reduce-scatter of the next backward lands in a tensor that becomes the shard (`add_reduced`),
    # while the activations of the units already done are being freed. Later micro-steps of the
    # window add into it. Bit for bit the same as adding into zeros, except that a -0.0 stays -0.0
    # (DDP keeps it too; no update it feeds differs). Whoever reads or writes the gradient outside
    # a backward (checkpoint, safe_*_grad, a step with no backward) gets zeros made on demand.
    # Shards in an offload store keep the store's tensor for good (the store's memory is elsewhere).
    def add_reduced(self, out: torch.Tensor) -> None:
        """Stages 2/3: take one reduction's output (1-D, this rank's slice) into the shard."""
        if (
            self.grad_shard is None
            and self.grad_shard_is_transient
            and out.dtype == self.grad_dtype
            and out.device == self.device
        ):
            self.grad_shard = out
        else:
            shard = self._own_grad_shard()
            shard.add_(out.to(shard.device))  # accumulate; offload: to host

    def _own_grad_shard(self) -> torch.Tensor:
        if self.grad_shard is None:
            self.grad_shard = torch.zeros(self.layout.shard_size(self.rank), dtype=self.grad_dtype, device=self.device)
        return self.grad_shard

    def free_grad_shard(self) -> None:
        """The step no longer needs this group's gradient ([Note: gradient shard lifetime])."""
        if self.grad_shard_is_transient:
            self.grad_shard = None

    def grad_for_optimizer(self) -> torch.Tensor:
        """The reduced gradient matching `master`, in grad_dtype."""
        if not self.grads_persist_full:
            return self._own_grad_shard()
        self.complete_full_grad()  # [Note: zeroed when first read]
        start, end = self.opt_range
        assert self.full_grad is not None  # stages 0/1 keep it
        return self.full_grad[start:end]

    def zero_grads(self) -> None:
        """Discard every gradient since the last step: accumulated, reduced, set aside, and (stages
        2/3) a full gradient a failed backward left unreduced."""
        if self.grads_persist_full and self.full_grad is not None:
            self._mark_unwritten()  # [Note: zeroed when first read]
        elif not self.grads_persist_full:
            self.full_grad = None
        if self.grad_shard_is_transient:
            self.grad_shard = None  # [Note: gradient shard lifetime]
        elif self.grad_shard is not None:
            self.grad_shard.zero_()
        self.reduced_slice = None
        self.holds_reduced_slice = False
        self.grad_seen = [False] * len(self.layout.slots)

    # [Note: a second reduction before the step]
    # Stages 0/1 reduce the full gradient buffer in place (stage 1 reduce-scatters it): afterwards this
    # rank's slice (stage 0: the whole buffer) holds the reduced gradient and, at stage 1, the rest of
    # the buffer only stale local values. A script may run another backward before the step (a GAN's
    # discriminator: one backward on real, one on fake data). Adding its local gradients to that buffer
    # and reducing again would mix reduced and local values, so the reduced slice is set aside and the
    # buffer zeroed when the next backward begins, and the slice is added back once that backward's
    # reduction is done: reduced(g1) + reduced(g2), what stages 2/3 do by reducing into a separate
    # grad_shard. Stage 0 could re-reduce reduced(g1) + g2 as DDP does, but that rounds differently from
    # the other stages; one meaning at every stage is the simpler contract.
    def set_aside_reduced_slice(self) -> None:
        if not self.holds_reduced_slice:
            return
        own = self.grad_for_optimizer()
        self.reduced_slice = own.clone() if self.reduced_slice is None else self.reduced_slice.add_(own)
        self._mark_unwritten()  # [Note: zeroed when first read]
        self.holds_reduced_slice = False

    def restore_reduced_slice(self) -> None:
        if self.reduced_slice is not None:
            self.grad_for_optimizer().add_(self.reduced_slice)
            self.reduced_slice = None
        self.holds_reduced_slice = True

    # -- accounting ------------------------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        """Bytes of model states this rank holds for this group at rest."""

        def nbytes(t):
            return 0 if t is None else t.numel() * t.element_size()

        def in_memory(t):  # tensors an NVMe store holds are reported by the store
            stores = [s for s in (self.master_store, self.grad_store) if s is not None]
            return 0 if t is None else min([nbytes(t), *(s.held_bytes(t) for s in stores)])

        if self.keep_full:
            params = nbytes(self.full)
        elif self.compute_shard is not None:
            params = nbytes(self.compute_shard)
        else:  # stage 3 gathers from the master: in the compute dtype it is the parameter shard, else a copy
            params = in_memory(self.master) if self.params_are_masters else 0
        params += nbytes(self.secondary) + nbytes(self.secondary_scales) if self.secondary_valid else 0  # hpZ
        master = 0 if self.master_is_parameter_storage() else in_memory(self.master)
        if self.grads_persist_full:
            grads = nbytes(self.full_grad)
        elif self.grad_shard_is_transient:  # at its size, also between steps, when it is freed
            grads = self.layout.shard_size(self.rank) * self.grad_dtype.itemsize
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
