"""ZeRO inside model parallelism: what the core needs to know about the mesh around its group.

[Note: ZeRO over the data-parallel dimension]
In 3D parallelism (Megatron-LM, DeepSpeed; ZeRO paper §8) the ranks form a grid dp x tp x pp. The
ranks of one data-parallel group hold the *same* model-parallel shard (the same tensor-parallel
slices of the same pipeline stage's layers), so ZeRO partitions that shard over `dp` and over
nothing else. Three things cross the other dimensions:
  * the initial broadcast goes from the dp group's rank 0, never from the world's rank 0, or every
    tensor-parallel slice would become rank 0's slice;
  * the gradient norm for clipping is global: the dp-reduced square sums are summed again over the
    tp and pp groups (`ModelParallel.norm_groups`), and a parameter that every tp rank holds whole
    (LayerNorm weights, the bias of a row-parallel linear: `ModelParallel.replicated`) is counted by
    tp rank 0 only (`count_replicated`), so that it is counted once, as in a single process;
  * parameters that are DTensors (torch's tensor parallelism) are flattened by their *local* tensor;
    after a gather the module's parameter is again a DTensor over the tp mesh whose local tensor is
    a view of the flat buffer (`TensorParallelSpec`, used by group.py).
Everything here is data passed into `shard()`; the collectives stay in comm.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, TypeGuard

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

MESH_DIMS = ("dp", "tp", "pp")
SEQUENCE_DIM = "sp"  # sequence parallelism: ZeRO partitions over dp x sp (core/sequence.py)


@dataclass(frozen=True)
class ModelParallel:
    """The model-parallel dimensions around ZeRO's data-parallel group, as the gradient norm sees them.

    `norm_groups`: process groups (tp, pp) whose ranks hold *other* parameters, over which the
    norm's square sum is summed after the dp reduction. `replicated`: names (as in
    `model.named_parameters()`) of parameters every tp rank holds whole. `count_replicated`: whether
    this rank counts them (True on tp rank 0 only)."""

    norm_groups: tuple = ()
    replicated: frozenset = frozenset()
    count_replicated: bool = True
    sizes: dict = field(default_factory=dict)  # {"dp": 2, "tp": 2, ...}, for reports and checks
    # This rank's place in the grid, {"dp": 1, "tp": 0, "pp": 1}: checkpoints name their shards by it
    # (a dp rank alone repeats in every tp/pp part). Empty when built by hand without it.
    coordinate: dict = field(default_factory=dict)


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """Whether `tensor` is a DTensor, without importing torch.distributed.tensor.

    [Note: DTensor imported on demand] torch.distributed.tensor pulls in sympy and the op registry,
    a large part of a process's start-up (docs/bench/import_time.txt); a program that never imported it holds no DTensor, so the
    check only looks at it when something else has loaded it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: the local tensor of a DTensor (sharing its storage), else itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


@dataclass(frozen=True)
class TensorParallelSpec:
    """How to rebuild a DTensor parameter around a local tensor (its mesh, placements, global shape)."""

    mesh: DeviceMesh
    placements: tuple
    shape: torch.Size
    stride: tuple

    @classmethod
    def of(cls, param: torch.Tensor) -> TensorParallelSpec | None:
        if not is_dtensor(param):
            return None
        if param.device_mesh.ndim != 1:
            raise ValueError(
                f"a DTensor parameter lives on a {param.device_mesh.ndim}-D mesh "
                f"{param.device_mesh.mesh_dim_names}: parallelize the model over mesh['tp'] "
                "(1-D); zeroshard shards the local tensor over 'dp' itself"
            )
        return cls(param.device_mesh, tuple(param.placements), param.shape, tuple(param.stride()))

    def parameter(self, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """A DTensor parameter whose local tensor is `local` (a view of a flat buffer), no copy."""
        from torch.distributed.tensor import DTensor as _DTensor  # loaded already: `of` found one

        dtensor = _DTensor.from_local(
            local, self.mesh, self.placements, shape=self.shape, stride=self.stride, run_check=False
        )
        return nn.Parameter(dtensor, requires_grad=requires_grad)

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The local part of a DTensor gradient laid out like the parameter (a Partial gradient is
        reduced over tp first, by DTensor, so that every tp rank holds its slice's true gradient)."""
        if not is_dtensor(grad):
            return grad
        if tuple(grad.placements) != self.placements:
            grad = grad.redistribute(self.mesh, self.placements)
        return grad.to_local()


def replicated_names(model: nn.Module, tensor_parallel: bool) -> frozenset:
    """Parameters every tp rank holds whole. A DTensor parameter: all its placements are Replicate.
    A plain parameter under Megatron-style tp: it lacks Megatron's `tensor_model_parallel` flag
    (read, never set). Without tp, nothing is replicated across tp."""
    if not tensor_parallel:
        return frozenset()
    names = []
    for name, param in model.named_parameters():
        if is_dtensor(param):
            from torch.distributed.tensor import Replicate  # loaded already: param is a DTensor

            if all(isinstance(p, Replicate) for p in param.placements):
                names.append(name)
        elif not getattr(param, "tensor_model_parallel", False):
            names.append(name)
    return frozenset(names)


class ZeroGroups(NamedTuple):
    """The process group ZeRO shards over (None: the world), the model-parallel dimensions around
    it (None: there are none) and the sequence-parallel group inside it (None: no sequence
    parallelism; [Note: Ulysses sequence parallelism] in core/sequence.py)."""

    dp: dist.ProcessGroup | None = None
    model_parallel: ModelParallel | None = None
    sp: dist.ProcessGroup | None = None


def zero_groups(mesh, model: nn.Module) -> ZeroGroups:
    """`shard(mesh=...)`: None (ZeRO over the world), a DeviceMesh with dimensions named from
    MESH_DIMS, a ProcessGroup (ZeRO over it, no model parallelism), or ZeroGroups (`from_mpu`)."""
    if mesh is None:
        return ZeroGroups()
    if isinstance(mesh, ZeroGroups):
        return mesh
    if isinstance(mesh, DeviceMesh):
        return from_device_mesh(mesh, model)
    if isinstance(mesh, dist.ProcessGroup):
        return ZeroGroups(mesh)
    raise TypeError(
        f"mesh={type(mesh).__name__}: expected None (the world), a DeviceMesh, a ProcessGroup or ZeroGroups (from_mpu)"
    )


def from_device_mesh(mesh, model: nn.Module) -> ZeroGroups:
    """ZeRO's groups in a DeviceMesh with named dimensions 'dp' and 'tp'/'pp', or 'dp' and 'sp'."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    allowed = (*MESH_DIMS, SEQUENCE_DIM)
    if "dp" not in names or any(n not in allowed for n in names) or len(set(names)) != len(names):
        raise ValueError(
            f"mesh dimensions {names or '(unnamed)'}: name them from {allowed}, with 'dp' "
            "(the dimension ZeRO partitions over), e.g. init_device_mesh(device, (2, 2), "
            "mesh_dim_names=('dp', 'tp'))"
        )
    if SEQUENCE_DIM in names:
        return _sequence_groups(mesh, names)
    sizes = {n: mesh[n].size() for n in names}
    others = [n for n in ("tp", "pp") if n in names]
    tp = sizes.get("tp", 1) > 1
    return ZeroGroups(
        mesh.get_group("dp"),
        ModelParallel(
            norm_groups=tuple(mesh.get_group(n) for n in others if sizes[n] > 1),
            replicated=replicated_names(model, tp),
            count_replicated=not tp or mesh.get_local_rank("tp") == 0,
            sizes=sizes,
            coordinate={n: mesh.get_local_rank(n) for n in names},
        ),
    )


def _sequence_groups(mesh, names: tuple) -> ZeroGroups:
    """ZeRO over dp x sp, the sp group for attention ([Note: Ulysses sequence parallelism] in
    core/sequence.py). Every rank of dp x sp holds other shards of the same model, so checkpoints
    see one group of dp sp ranks, as without a mesh."""
    if len(names) != 2:
        raise ValueError(
            f"mesh dimensions {names}: sequence parallelism takes a mesh of 'dp' and 'sp' alone "
            "(with 'tp' or 'pp' it is not supported)"
        )
    # DeviceMesh._flatten: the one group of the dims' ranks, as FSDP2 over dp x cp in torchtitan.
    whole = mesh[("dp", SEQUENCE_DIM)]._flatten(f"dp_{SEQUENCE_DIM}")
    return ZeroGroups(whole.get_group(), None, mesh.get_group(SEQUENCE_DIM))


_MPU_DP = ("get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size")
_MPU_TP = (
    ("get_tensor_model_parallel_group", "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"),
    ("get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size"),
)
_MPU_PP = (
    "get_pipeline_model_parallel_group",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
)


def from_mpu(mpu, model: nn.Module) -> ZeroGroups:
    """ZeRO's groups in a DeepSpeed/Megatron `mpu` object. Tensor-parallel calls
    are Megatron's `get_tensor_model_parallel_*` or, as DeepSpeed names them, `get_model_parallel_*`;
    the pipeline's are optional. A sequence-parallel mpu (DeepSpeed's ALST: `get_sequence_parallel_*`
    and `get_sequence_data_parallel_*`, whose `get_model_parallel_*` are the sequence-parallel group)
    makes ZeRO partition over its sequence-data-parallel group."""
    if all(callable(getattr(mpu, f"get_sequence{kind}_parallel_group", None)) for kind in ("", "_data")):
        return ZeroGroups(mpu.get_sequence_data_parallel_group(), None, mpu.get_sequence_parallel_group())
    missing = [m for m in _MPU_DP if not callable(getattr(mpu, m, None))]
    tp_calls = next((calls for calls in _MPU_TP if all(callable(getattr(mpu, c, None)) for c in calls)), None)
    if missing or tp_calls is None:
        raise ValueError(
            f"mpu: {type(mpu).__name__} lacks {missing or []}"
            f"{'' if tp_calls else ' and one of ' + ' / '.join(c[0] + '/rank/world_size' for c in _MPU_TP)}"
            "; zeroshard needs the data-parallel group and the tensor-model-parallel group"
        )
    group, rank, size = (getattr(mpu, c)() for c in tp_calls)
    dims = [("tp", group, size)]
    if all(callable(getattr(mpu, c, None)) for c in _MPU_PP):
        dims.append(("pp", getattr(mpu, _MPU_PP[0])(), getattr(mpu, _MPU_PP[2])()))
    sizes = {"dp": mpu.get_data_parallel_world_size(), **{n: s for n, _, s in dims}}
    coordinate = {"dp": mpu.get_data_parallel_rank(), "tp": rank}
    if len(dims) > 1:
        coordinate["pp"] = mpu.get_pipeline_model_parallel_rank()
    return ZeroGroups(
        mpu.get_data_parallel_group(),
        ModelParallel(
            norm_groups=tuple(g for _, g, s in dims if s > 1),
            replicated=replicated_names(model, size > 1),
            count_replicated=size == 1 or rank == 0,
            sizes=sizes,
            coordinate=coordinate,
        ),
    )


class NormScope:
    """Where the gradient norm's square sum is completed beyond this rank's dp shards: which pieces
    of a flat group's gradient this rank counts, and the model-parallel groups to sum over."""

    def __init__(self, comms=(), skip: dict | None = None):
        self.comms = list(comms)  # Communicators over ModelParallel.norm_groups
        self.skip = skip or {}  # id(FlatGroup) -> [(lo, hi)] of its optimizer range not counted here

    @classmethod
    def build(cls, model_parallel: ModelParallel | None, groups, comms) -> NormScope:
        if model_parallel is None or model_parallel.count_replicated:
            return cls(comms)
        skip = {}
        for group in groups:
            start, end = group.opt_range
            ranges = [
                (slot.offset + lo - start, slot.offset + hi - start)
                for slot, lo, hi in group.layout.pieces_in(start, end)
                if slot.name in model_parallel.replicated
            ]
            if ranges:
                skip[id(group)] = ranges
        return cls(comms, skip)

    def counted(self, group, grad: torch.Tensor) -> list[torch.Tensor]:
        """Pieces of `grad` (1-D, laid out like the group's master) this rank counts in the norm."""
        ranges = self.skip.get(id(group))
        if not ranges:
            return [grad]
        pieces, at = [], 0
        for lo, hi in ranges:
            pieces.append(grad[at:lo])
            at = hi
        pieces.append(grad[at:])
        return [p for p in pieces if p.numel()]

    def all_reduce(self, total: torch.Tensor) -> None:
        for comm in self.comms:
            comm.all_reduce(total, "gradient norm over a model-parallel group", kind="control")


def consecutive_groups(world_size: int, size: int) -> list[list[int]]:
    """Ranks 0..world-1 cut into runs of `size`: the ranks of one node (hpZ's secondary groups) or one
    MiCS shard group ([Note: ZeRO++ and MiCS] in unit.py)."""
    assert world_size % size == 0, (world_size, size)
    return [list(range(start, start + size)) for start in range(0, world_size, size)]


def strided_groups(world_size: int, size: int) -> list[list[int]]:
    """The ranks holding the same shard in every run of `size` (MiCS's replication groups): rank r
    with r + size, r + 2 size, ..."""
    assert world_size % size == 0, (world_size, size)
    return [list(range(first, world_size, size)) for first in range(size)]
