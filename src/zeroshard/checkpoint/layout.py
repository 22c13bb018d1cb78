"""Checkpoints under tensor and pipeline parallelism: where a rank's shards go, and how the ranks of
the whole grid agree.

[Note: checkpoints across layouts]
Under a dp x tp x pp grid every (tp, pp) coordinate holds a different model-parallel part (other
tensor-parallel slices, another pipeline stage's layers), and ZeRO shards each part over its own
dp group ([Note: ZeRO over the data-parallel dimension] in core/mesh.py). So a checkpoint is one
dp-only checkpoint per part, side by side, under one manifest:

    global_step<N>/
      manifest.json               world rank 0: "mesh" {"dp", "tp", "pp"}, "parts" (each part's tp,
                                  pp and directory), "shards" (every rank file's (dp, tp, pp)
                                  coordinate), and the size and checksum of every part's manifest
      tp<t>_pp<p>/                the part at tp rank t, pp rank p, written by its dp group exactly
        manifest.json             as a dp-only checkpoint is ([Note: checkpoint layout]), plus its
        rank_<r>.safetensors      "mesh", "coordinate" and "shards"; each parameter also records
        objects.pt, buffers...    "tp_split_dim": the dim its tp slices are cut along, null when
                                  every tp rank holds it whole, "unknown" when the model does not say
                                  (Megatron-style parameters without Megatron's `partition_dim`)

Loading at another dp with the same tp and pp reads the part of the rank's own (tp, pp) and
re-slices it over dp as any checkpoint is ([Note: resharding by element ranges] in reader.py):
exact. Another tp or pp has other local shapes and parameters: that goes through the full state
dict (`consolidate`, which concatenates tp slices along `tp_split_dim` and joins the pipeline
stages' parameters), and a direct load is refused, naming both layouts. A grid of tp = pp = 1 is
dp-only: it writes and reads the dp-only format.
Every collective goes through the dp communicator and the model-parallel ones (`GridComm`):
gathering over dp, then over tp, then over pp reaches every rank of the grid, with no
communicator of the world needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from zeroshard.checkpoint.files import CheckpointError
from zeroshard.checkpoint.manifest import MANIFEST
from zeroshard.core.mesh import MESH_DIMS


def part_dir(tp: int, pp: int) -> str:
    return f"tp{tp:02d}_pp{pp:02d}"


def describe(sizes: dict) -> str:
    """'dp 2 x tp 2 x pp 1', the words every layout error uses."""
    return " x ".join(f"{d} {sizes.get(d, 1)}" for d in MESH_DIMS)


class GridComm:
    """All ranks of the grid through the communicators of its dimensions, dp first: an object
    gathered over dp, then over each model-parallel group, reaches every rank, in the order
    index = dp + D * (tp + T * pp) (the dimensions of size 1 drop out). Only what `agree` and a
    checkpoint's small control messages need: `rank`, `world_size`, `all_gather_objects`."""

    def __init__(self, dp, others: list, dims: list[str]):
        self.comms = [dp, *others]
        self.dims = dims  # the dimension of each communicator
        self.world_size = math.prod(c.world_size for c in self.comms)
        self.rank, stride = 0, 1
        for comm in self.comms:
            self.rank += comm.rank * stride
            stride *= comm.world_size

    def all_gather_objects(self, obj, what: str) -> list:
        gathered = [obj]
        for comm in self.comms:
            gathered = [item for piece in comm.all_gather_objects(gathered, what) for item in piece]
        return gathered

    def rank_label(self, index: int) -> str:
        """'(dp 1, tp 0)': where rank `index` of `all_gather_objects` sits in the grid."""
        parts = []
        for comm, dim in zip(self.comms, self.dims):
            parts.append(f"{dim} {index % comm.world_size}")
            index //= comm.world_size
        return "(" + ", ".join(parts) + ")"


@dataclass(frozen=True)
class Layout:
    """This rank's place in a grid with tp * pp > 1, and the communicator over the whole grid."""

    sizes: dict  # {"dp": D, "tp": T, "pp": P}
    coordinate: dict  # {"dp": d, "tp": t, "pp": p}
    comm: GridComm

    @property
    def part(self) -> str:
        return part_dir(self.coordinate["tp"], self.coordinate["pp"])

    @property
    def parts(self) -> int:
        return self.sizes["tp"] * self.sizes["pp"]


def layout_of(engine) -> Layout | None:
    """The grid `engine` trains in, or None where it is dp-only (no model parallelism, or tp = pp = 1)."""
    model_parallel = getattr(engine, "model_parallel", None)
    if model_parallel is None:
        return None
    sizes = {d: int(model_parallel.sizes.get(d, 1)) for d in MESH_DIMS}
    if sizes["tp"] * sizes["pp"] == 1:
        return None
    if not model_parallel.coordinate:
        raise CheckpointError(
            "checkpoints under tensor/pipeline parallelism need this rank's (dp, tp, pp) "
            "coordinate: build ModelParallel with zeroshard.core.mesh.from_device_mesh or "
            "from_mpu (or pass coordinate={'dp': .., 'tp': .., 'pp': ..})"
        )
    coordinate = {d: int(model_parallel.coordinate.get(d, 0)) for d in MESH_DIMS}
    dims = ["dp"] + [d for d in ("tp", "pp") if sizes[d] > 1]
    comm = GridComm(engine.comm, list(engine.model_parallel_comms), dims)
    return Layout(sizes, coordinate, comm)


def saved_sizes(manifest: dict) -> dict:
    """The grid a checkpoint was written in: its "mesh", or dp-only at its world size."""
    return manifest.get("mesh") or {"dp": manifest["world_size"], "tp": 1, "pp": 1}


def current_sizes(engine, layout: Layout | None) -> dict:
    return layout.sizes if layout is not None else {"dp": engine.comm.world_size, "tp": 1, "pp": 1}


def check_same_model_parallel(path, manifest: dict, engine, layout: Layout | None) -> None:
    """A checkpoint loads directly only into the tp and pp it was written at (any dp)."""
    saved, now = saved_sizes(manifest), current_sizes(engine, layout)
    if (saved["tp"], saved["pp"]) != (now["tp"], now["pp"]):
        raise CheckpointError(
            f"{path / MANIFEST}: saved at {describe(saved)}, but this run is {describe(now)}: a checkpoint "
            "loads directly at the same tp and pp only (any dp). To change tp or pp, consolidate it "
            f"(`zeroshard consolidate {path} model.safetensors`) and load the full weights into the new "
            "layout (zeroshard.checkpoint.load_full_weights); optimizer state does not carry over"
        )


def tp_split_dim(param, spec) -> int | Literal["unknown"] | None:
    """The dim along which tensor parallelism cut `param` (its tp slices join in tp-rank order),
    None where every tp rank holds it whole, "unknown" where the model does not say. `spec`: the
    group's TensorParallelSpec of a DTensor parameter, None for a plain one."""
    if spec is not None:
        from torch.distributed.tensor import Replicate, Shard  # see [Note: DTensor imported on demand]

        if all(isinstance(p, Replicate) for p in spec.placements):
            return None
        shard = next((p for p in spec.placements if isinstance(p, Shard)), None)
        return shard.dim if shard is not None and type(shard) is Shard else "unknown"
    if not getattr(param, "tensor_model_parallel", False):  # Megatron's flags: read, never set
        return None
    dim, stride = getattr(param, "partition_dim", None), getattr(param, "partition_stride", 1)
    return dim if isinstance(dim, int) and not isinstance(dim, bool) and stride == 1 else "unknown"
