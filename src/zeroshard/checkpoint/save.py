"""Saving a checkpoint: every rank writes its own shards, rank 0 the manifest, published atomically.

[Note: atomic publication]
Nothing is written under a name a reader looks for until the whole checkpoint exists:
  0. rank 0 serialises objects.pt (and proves it loads back; [Note: objects.pt holds data, not
     code] in objects.py): an unloadable client state fails the save before anything is written;
  1. every rank writes `save_dir/.tmp-<tag>-<nonce>/rank_<r>.safetensors` (fsynced, hashed while
     written) and reports its checksum; ranks agree that all succeeded;
  2. rank 0 writes objects.pt, buffers.safetensors and, last, manifest.json into the same directory;
  3. rank 0 renames the directory to `save_dir/<tag>`. An existing `<tag>` is first renamed away to
     `.old-<tag>-<nonce>` and deleted only after the new one is in place; a crash between the two
     renames leaves the old checkpoint under that name, which `checkpoint_path` (manifest.py) loads
     and the next save renames back;
  4. rank 0 replaces `latest` (temporary file + os.replace) and only then deletes the old copy.
Under tensor/pipeline parallelism ([Note: checkpoints across layouts] in layout.py) each part's dp
rank 0 does step 2 in its part's directory `tp<t>_pp<p>/`, and rank (dp 0, tp 0, pp 0), once every
part is written, adds the top manifest, last, and does steps 3 and 4 for the whole directory.
A crash at any moment therefore leaves `latest` naming a complete checkpoint. Leftover `.tmp-*`
directories of crashed saves are removed by the next save. Every rank must see the same `save_dir`
(a shared file system when ranks run on several machines).

[Note: checkpoints of replicated shards]
Under MiCS ([Note: ZeRO++ and MiCS] in core/unit.py) the flat groups are sliced over a partition
group of k ranks, and each of the N/k partition groups holds the same shards: the replica
all-reduce after every backward keeps even the gradients accumulated mid-window alike. One copy
is therefore the whole state. The ranks of replica rank 0 (the first partition group, world rank
0 among them) write `rank_<p>.safetensors` for their partition rank p; the other ranks write no
shard but still join every agreement of step 1, so a failure on any rank, writer or not, fails
the save everywhere. The manifest says `world_size` k and `replicas` N/k: the files are those of
a plain stage-3 checkpoint at k ranks, and load as one at any world size, stage or MiCS size
([Note: resharding by element ranges] in reader.py). Without MiCS k = N and every rank writes.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import uuid
from pathlib import Path

import torch

from zeroshard.checkpoint.background import BackgroundSaves, stage
from zeroshard.checkpoint.common import (
    agree,
    attempt,
    compute_dtype,
    optimizer_states,
    own_range_in_master,
    partition_of,
    replica_of,
)
from zeroshard.checkpoint.files import CheckpointError, dtype_name, fsync_dir, write_atomic, write_safetensors
from zeroshard.checkpoint.layout import Layout, layout_of, tp_split_dim
from zeroshard.checkpoint.manifest import (
    BUFFERS,
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    OBJECTS,
    check_tag,
    describe_groups,
    grad_key,
    is_elementwise,
    manifest_text,
    master_key,
    model_aliases,
    persistent_buffers,
    rank_file,
    state_key,
)
from zeroshard.checkpoint.objects import objects_bytes
from zeroshard.core.mesh import MESH_DIMS

log = logging.getLogger(__name__)


def save_checkpoint(
    engine, save_dir, tag=None, client_state=None, save_latest: bool = True, background: BackgroundSaves | None = None
) -> str:
    """Write a checkpoint of `engine` to `save_dir/<tag>` (default tag `global_step<N>`) and, with
    `save_latest`, point `save_dir/latest` at it. Collective: every rank calls it with the same
    arguments (under tensor/pipeline parallelism every rank of the grid: [Note: checkpoints across
    layouts] in layout.py). Returns the checkpoint directory. `background`: the engine's writer,
    which writes and publishes the files after this returns ([Note: asynchronous save] in
    background.py); None: all of it before returning."""
    counters = engine.counters()
    if counters.backward_pending:
        raise CheckpointError(
            "save_checkpoint() called between engine.backward() and engine.step(): "
            "call engine.step() first, the gradients of this micro step are not saved"
        )
    comm = engine.comm  # the dp group: the ranks of one part
    layout = layout_of(engine)
    if background is not None and layout is not None:  # alike on every rank: refused before any collective
        raise CheckpointError(
            "an asynchronous save under tensor or pipeline parallelism is not supported: save synchronously"
        )
    grid = layout.comm if layout is not None else comm  # every rank that writes into this checkpoint
    save_dir = Path(save_dir)
    tag = check_tag(str(tag) if tag is not None else f"global_step{counters.global_steps}")
    proposals = grid.all_gather_objects((tag, str(save_dir.resolve()), uuid.uuid4().hex[:12]), "checkpoint tag")
    if len({t for t, _, _ in proposals}) > 1:
        raise CheckpointError(f"ranks passed different checkpoint tags: {[t for t, _, _ in proposals]}")
    if len({d for _, d, _ in proposals}) > 1:  # e.g. a directory named from each rank's own clock
        dirs = "\n".join(f"  rank {r}: {d}" for r, (_, d, _) in enumerate(proposals))
        raise CheckpointError(
            "ranks passed different checkpoint directories to save_checkpoint(); every rank "
            f"must pass the same save_dir (name it once, e.g. on rank 0, and broadcast it):\n{dirs}"
        )
    nonce = proposals[0][2]
    what = f"saving checkpoint {save_dir / tag}"
    staging = save_dir / f".tmp-{tag}-{nonce}"
    part_dir = staging / layout.part if layout is not None else staging
    # once: an offloaded step joins its sub-groups for it (and reads its swap files, which may fail)
    states, error = attempt(optimizer_states, engine)
    # each part's dp rank 0 serialises the objects first: a value that could not be loaded back is
    # refused before any shard is written
    objects = None
    if error is None and comm.rank == 0:
        objects, error = attempt(engine_objects_bytes, engine, states, client_state or {})
    if error is None and grid.rank == 0:
        _, error = attempt(_prepare, save_dir, staging)
    agree(grid, error, what)
    # What the files will hold, taken now: the rank's shards, and on dp rank 0 the part's manifest
    # and buffers (copies when another thread writes them while training changes the originals).
    shard = None
    if writes_shards(engine):
        shard, error = attempt(shard_contents, engine, states, layout, background)
    contents = None
    if error is None and comm.rank == 0:
        contents, error = attempt(part_contents, engine, states, tag, layout, background is not None)

    def write_and_publish(comm, grid) -> None:
        """Steps 1-4 of [Note: atomic publication], from the contents taken above."""
        failed: str | None
        if error is not None:
            record, failed = None, error
        elif shard is not None:  # [Note: checkpoints of replicated shards]: else a replica's
            record, failed = attempt(_write_rank_file, part_dir, *shard)
        else:
            record, failed = _REPLICA, None
        records = comm.all_gather_objects(record, f"{what}: shard checksums")
        part = None  # on dp rank 0: the part's files, once all of them are written
        if comm.rank == 0 and failed is None and all(r is not None for r in records):
            written = [r for r in records if r != _REPLICA]
            part, failed = attempt(write_part, part_dir, written, objects, contents)
        parts = grid.all_gather_objects(part, f"{what}: parts") if layout is not None else [part]
        if grid.rank == 0:
            done = [p for p in parts if p is not None]  # one per part whose dp rank 0 wrote it whole
            complete = len(done) == (layout.parts if layout is not None else 1)
            if complete:
                _, failed = attempt(_publish, staging, save_dir, tag, nonce, save_latest, layout, done, counters)
            if not complete or failed is not None:
                # every rank is done writing (the checksums were gathered): remove the staging directory
                # before reporting, so that no rank sees it after the error (a crash would leave it too)
                shutil.rmtree(staging, ignore_errors=True)
        agree(grid, failed, what)
        log.info("zeroshard: saved checkpoint %s", save_dir / tag)

    if background is None:
        write_and_publish(comm, grid)
    else:
        agree(comm, error, f"{what}: staging")
        writer = background.communicator(comm)  # layout is None here: the grid is the dp group
        background.start(lambda: write_and_publish(writer, writer), str(save_dir / tag))
    return str(save_dir / tag)


# -- every rank ---------------------------------------------------------------------------------------
_REPLICA = "replica"  # what a rank that writes no shard reports instead of its file's checksum


def writes_shards(engine) -> bool:
    """Does this rank write its shards? All do, except MiCS replicas beyond the first ([Note:
    checkpoints of replicated shards])."""
    replica = replica_of(engine)
    return replica is None or replica.rank == 0


def rank_tensors(engine, states: list[dict]) -> dict[str, torch.Tensor]:
    """This rank's part of the model states: for each group, elements [r*S, (r+1)*S) of its fp32
    master weights and of each elementwise optimizer state (r: the partition rank, the world rank
    without MiCS); at stage 0, where every rank holds the whole buffer, each rank writes that same
    slice of it, so the files look alike at every stage. In the middle of gradient accumulation
    also the gradients accumulated so far (rank-local)."""
    rank = partition_of(engine).rank
    with_grads = engine.counters().mid_accumulation
    tensors = {}
    for index, (group, state) in enumerate(zip(engine.groups, states)):
        lo, hi = own_range_in_master(group, rank)
        tensors[master_key(index)] = group.master[lo:hi]  # 1-D fp32, numel = shard_numel
        for key, value in state.items():
            if is_elementwise(value, group.master):
                tensors[state_key(index, key)] = value[lo:hi]
        grad = group.grad() if group.trainable and with_grads else None  # no zeros made for nothing
        if grad is not None:
            tensors[grad_key(index)] = grad
    return tensors


def shard_contents(
    engine, states: list[dict], layout: Layout | None, background: BackgroundSaves | None
) -> tuple[str, dict, dict]:
    """(file name, tensors, metadata) of this rank's shard file; with `background`, host copies of the
    tensors, in its staging buffers."""
    partition = partition_of(engine)
    name = rank_file(partition.rank)
    metadata = {"format": FORMAT, "rank": str(partition.rank), "world_size": str(partition.world_size)}
    if layout is not None:
        metadata.update({f"{d}_rank": str(layout.coordinate[d]) for d in MESH_DIMS})
    tensors = rank_tensors(engine, states)
    return name, stage(tensors, background.buffers) if background is not None else tensors, metadata


def _write_rank_file(part_dir: Path, name: str, tensors: dict, metadata: dict) -> tuple[str, dict]:
    try:
        part_dir.mkdir(parents=True, exist_ok=True)
        return name, write_safetensors(part_dir / name, tensors, metadata)
    except OSError as error:
        if error.filename is not None:
            raise
        # a full disk in the middle of a write names no file: say which one
        raise CheckpointError(f"writing {part_dir / name}: {type(error).__name__}: {error}") from error


# -- rank 0 -------------------------------------------------------------------------------------------
def _prepare(save_dir: Path, staging: Path) -> None:
    """Create `save_dir`, clear what crashed saves left behind (see [Note: atomic publication])."""
    save_dir.mkdir(parents=True, exist_ok=True)
    _clear_leftovers(save_dir, staging)


def _clear_leftovers(save_dir: Path, staging: Path) -> None:
    for entry in save_dir.iterdir():
        if entry.name.startswith(".tmp-") and entry != staging:
            log.warning("removing %s, left by an interrupted save", entry)
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        elif entry.name.startswith(".old-"):
            tag = entry.name[len(".old-") :].rsplit("-", 1)[0]
            if (save_dir / tag).exists():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                log.warning("restoring checkpoint %s from %s, left by an interrupted save", tag, entry.name)
                _rename(entry, save_dir / tag)
        elif entry.name.startswith(f".{LATEST}.tmp-"):
            entry.unlink(missing_ok=True)


def part_contents(engine, states: list[dict], tag: str, layout: Layout | None, copy: bool) -> dict:
    """What step 2 of [Note: atomic publication] writes for one part (the whole checkpoint when
    dp-only), but the files' checksums: its manifest and buffers (`copy`: host copies)."""
    buffers = {k: v.detach() for k, v in persistent_buffers(engine.module).items()}
    manifest = build_manifest(engine, states, tag, {}, list(buffers))
    shards = {}
    if layout is not None:
        shards = {rank_file(r): {**layout.coordinate, "dp": r} for r in range(partition_of(engine).world_size)}
        manifest.update(mesh=dict(layout.sizes), shards=shards)
        if layout.sizes["tp"] > 1:
            _record_tp_splits(engine, manifest["groups"])
    return {
        "manifest": manifest,
        "buffers": stage(buffers) if copy else buffers,
        "shards": shards,
        "coordinate": dict(layout.coordinate) if layout is not None else None,
        "dir": layout.part if layout is not None else None,
    }


def write_part(part_dir: Path, records, objects: bytes, contents: dict) -> dict:
    """Step 2 of [Note: atomic publication] for one part: its objects, buffers and manifest. Returns
    what the top manifest records of it."""
    files = dict(records)
    files[OBJECTS] = write_atomic(part_dir / OBJECTS, objects)
    if contents["buffers"]:
        files[BUFFERS] = write_safetensors(part_dir / BUFFERS, contents["buffers"])
    manifest = {**contents["manifest"], "files": files}
    record = write_atomic(part_dir / MANIFEST, manifest_text(manifest).encode())
    if contents["coordinate"] is None:
        return {}
    return {
        "tp": contents["coordinate"]["tp"],
        "pp": contents["coordinate"]["pp"],
        "dir": contents["dir"],
        "manifest": record,
        "shards": contents["shards"],
    }


def _record_tp_splits(engine, groups: list[dict]) -> None:
    """Each parameter's `tp_split_dim` ([Note: checkpoints across layouts] in layout.py)."""
    for group, described in zip(engine.groups, groups):
        for param, spec, entry in zip(group.params, group.tp_specs, described["params"]):
            entry["tp_split_dim"] = tp_split_dim(param, spec)


def _publish(
    staging: Path,
    save_dir: Path,
    tag: str,
    nonce: str,
    save_latest: bool,
    layout: Layout | None,
    parts: list[dict],
    counters,
) -> None:
    """Steps 2 (the top manifest of a tp/pp checkpoint, last) to 4 of [Note: atomic publication]."""
    if layout is not None:
        from zeroshard.version import __version__

        parts = sorted(parts, key=lambda p: (p["pp"], p["tp"]))
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "library_version": __version__,
            "tag": tag,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "global_steps": counters.global_steps,
            "mesh": dict(layout.sizes),
            "parts": [{"tp": p["tp"], "pp": p["pp"], "dir": p["dir"]} for p in parts],
            "shards": {f"{p['dir']}/{name}": coordinate for p in parts for name, coordinate in p["shards"].items()},
            "files": {f"{p['dir']}/{MANIFEST}": p["manifest"] for p in parts},
        }
        write_atomic(staging / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    publish(staging, save_dir, tag, nonce, save_latest)


def engine_objects_bytes(engine, states: list[dict], client_state, rng: list | None = None) -> bytes:
    """What is not a per-element tensor: client state, scheduler, loss scaler, optimizer param-group
    hyper-parameters and scalar optimizer state (Adam's `step`), per group, with torch.save, each
    value one that torch.load(weights_only=True) rebuilds (or a CheckpointError naming it). `rng`:
    every rank's random-number generator states, kept by snapshots (snapshot.rng_state)."""
    scalars = {}
    for index, (group, state) in enumerate(zip(engine.groups, states)):
        scalars[index] = {
            key: (
                value.detach().cpu() if isinstance(value, torch.Tensor) else value,
                isinstance(value, torch.Tensor) and value.device.type != "cpu",
            )
            for key, value in state.items()
            if not is_elementwise(value, group.master)
        }
    objects = {
        "client_state": client_state,
        "optimizer": {
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups],
            "scalars": scalars,
        },
        "lr_scheduler": _state_of(engine.lr_scheduler),
        "loss_scaler": _state_of(engine.loss_scaler),
    }
    if rng is not None:
        objects["rng"] = rng
    return objects_bytes(objects)  # [Note: objects.pt holds data, not code] in objects.py


def _state_of(component):
    return component.state_dict() if component is not None and hasattr(component, "state_dict") else None


def _readable(value):
    """`value` when it survives JSON unchanged, else a pointer to objects.pt (which always has it)."""
    try:
        if json.loads(json.dumps(value)) == value:
            return value
    except (TypeError, ValueError):
        pass
    return {"stored_in": OBJECTS}


def build_manifest(engine, states: list[dict], tag: str, files: dict, buffers: list[str]) -> dict:
    from zeroshard.version import __version__

    counters = engine.counters()
    shards = partition_of(engine).world_size  # the rank files: [Note: checkpoints of replicated shards]
    replicas = {"replicas": engine.comm.world_size // shards} if shards < engine.comm.world_size else {}
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "tag": tag,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "world_size": shards,
        **replicas,
        "stage": engine.policy.stage,
        "param_dtype": dtype_name(compute_dtype(engine)),
        "global_steps": counters.global_steps,
        "micro_steps": counters.micro_steps,
        "skipped_steps": counters.skipped_steps,
        "gradient_accumulation_steps": counters.gradient_accumulation_steps,
        "mid_accumulation": counters.mid_accumulation,
        "optimizer": engine.optimizer.name,
        "lr_scheduler": _readable(_state_of(engine.lr_scheduler)),
        "loss_scaler": _readable(_state_of(engine.loss_scaler)),
        "aliases": model_aliases(engine.module),
        "buffers": buffers,
        "groups": describe_groups(engine, states),
        "files": files,
        "config": _config_of(engine),
    }


def _config_of(engine) -> dict | None:
    """The run's parsed config, for people reading the manifest (loading never uses it)."""
    try:
        return json.loads(json.dumps(engine.config.model_dump(mode="json")))
    except Exception:  # noqa: BLE001 - informational only
        return None


def _rename(source: Path, target: Path) -> None:
    source.rename(target)


def publish(staging: Path, save_dir: Path, tag: str, nonce: str, save_latest: bool) -> None:
    """Steps 3 and 4 of [Note: atomic publication]."""
    fsync_dir(staging)
    final, old = save_dir / tag, save_dir / f".old-{tag}-{nonce}"
    replacing = final.exists()
    if replacing:
        _rename(final, old)
    _rename(staging, final)
    fsync_dir(save_dir)
    if save_latest:
        write_atomic(save_dir / LATEST, tag.encode())
    if replacing:
        shutil.rmtree(old, ignore_errors=True)
