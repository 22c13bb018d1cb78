"""Snapshots in host memory, each rank's also on a buddy machine, and recovery from them.

[Note: snapshots on a buddy]
A snapshot is a checkpoint in the format of [Note: checkpoint layout], tagged `snapshot<step>`,
written to a directory in host memory on every machine (by default under /dev/shm, a tmpfs: its
files outlive the worker processes, so the workers torchrun restarts on a surviving machine find
them). What a machine's directory holds:
  * the manifest, objects.pt and buffers (every machine);
  * the rank files of its own ranks;
  * the rank files of its ranks' sources: rank r sends its file to its buddy, rank (r + L) mod N,
    L ranks per machine. torchrun numbers ranks machine by machine, so the buddy is the same local
    rank on the next machine, and machine m holds machine m-1's files.
Losing any one machine therefore leaves every rank file on a survivor: m's own files are on m+1,
and m-1's were never only on m. Two neighbouring machines lost together take m's files with them;
recovery then finds the snapshot incomplete and says so.

Writing (collective, `take_snapshot`): each rank writes its shard file, hashed as it is written, into
`.partial-<tag>-<nonce>/`, then sends the file's bytes (mapped, not copied) to its buddy while
receiving its source's (one ring shift, Communicator.shift) straight into their file beside its own
([Note: receiving into the file]), then checks them against the sender's checksum ([Note: checksums]
in files.py). Once every rank reports its files written, the first rank of each machine renames the
directory to `<tag>` and only then removes older snapshots, so a failure at any point leaves the
previous snapshot whole. A snapshot of the same step already there (taken again, e.g. after a
recovery) is first renamed away to `.old-<tag>-<nonce>` and becomes the spare (below) only once the
new one is in place; a crash between the two renames leaves it under that name, and recovery renames
it back.
With all ranks on one machine there is no buddy: a snapshot then survives a worker restart, not the
machine.

[Note: receiving into the file]
A file that arrives (the source's, when a snapshot is written; one a machine lacks, when a run
recovers) is received into a writable mapping of the file it becomes, not into a buffer written out
afterwards: host memory is what snapshots are bounded by, and the buffer would hold a second copy of
the file while it was written, and copying it would cost time besides. The file is allocated whole
first (posix_fallocate), so that a full /dev/shm is an error naming it before anything is sent, not
a SIGBUS when the mapping is written. It arrives under a temporary name beside the file's own and is
renamed to it once checked, so nothing reads it half-written, and a process reading a file of that
name already there (a directory two ranks share) keeps the one it opened. Timings:
docs/bench/snapshots.txt.

[Note: snapshot files written over]
A tmpfs allocates and zeroes a page the first time a file grows into it and frees it when the file
goes, which costs more than writing the page's bytes (docs/bench/checksums.txt; the snapshots it
speeds up: docs/bench/snapshots.txt). Every snapshot writes files of the same names and, at one
world size, the same sizes. So publishing a snapshot does not remove the one it replaces: it keeps
it as `.spare/`. The next snapshot moves a rank's own file and its source's out of `.spare/`, by
name, into its staging directory and writes over their pages: its own file from the start, cut to
size at the end; the source's file, cut or extended to size first, through a mapping that is
pre-faulted, since its pages exist. Publishing that snapshot removes what it left in `.spare/` and
keeps the snapshot it replaced there in turn. The spare is never a snapshot: recovery looks only at
`snapshot<step>` directories with a manifest. It takes no more host memory than writing the next
snapshot beside the last one takes anyway, but it holds that memory between snapshots, where
removing it would give it back until the next one.

Besides the model states and counters, a snapshot keeps what a run needs to continue as if nothing
happened: every rank's random-number generators (torch's CPU generator, the current CUDA device's,
Python's `random`), restored on the rank of the same number (a rank beyond the old world size keeps
its own), and the caller's `client_state` (the data position, an epoch), handed back by `recover`.

Recovery (collective, `recover`, on the ranks torchrun restarted): every rank reports the complete
snapshots its machine holds and which rank files each has; all ranks pick the same newest snapshot
whose manifest and rank files are all on some survivor. A file a machine lacks is sent to it from
one that holds it (point to point, to the machine's first rank, checked against the manifest's
record), after which every machine's directory holds the whole checkpoint and `load_checkpoint`
reads it like any other: resharded to the new world size and stage
([Note: resharding by element ranges] in reader.py), but without hashing the files again: each was
hashed as its rank wrote it, or checked against its sender's checksum when it arrived, and a file in
host memory reads back what was written, while hashing it again would take longer than reading it
(a checkpoint on disk is verified, as every load's is). Without a complete snapshot, or when the
disk checkpoint is newer, the disk checkpoint is loaded instead, with a warning that says why.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import shutil
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors.torch import save as safetensors_bytes

from zeroshard.checkpoint.background import BackgroundSaves
from zeroshard.checkpoint.common import agree, attempt, optimizer_states, replica_of
from zeroshard.checkpoint.files import (
    CheckpointError,
    fsync_dir,
    matches,
    put_in_place,
    record_of,
    temporary_beside,
    write_atomic,
    write_safetensors,
)
from zeroshard.checkpoint.layout import layout_of
from zeroshard.checkpoint.load import load_checkpoint
from zeroshard.checkpoint.manifest import (
    BUFFERS,
    LATEST,
    MANIFEST,
    OBJECTS,
    manifest_text,
    rank_file,
    read_manifest,
    resolve_tag,
)
from zeroshard.checkpoint.objects import rng_state
from zeroshard.checkpoint.save import engine_objects_bytes, part_contents, shard_contents

log = logging.getLogger(__name__)

PREFIX = "snapshot"
SPARE = ".spare"  # the files the next snapshot writes over: [Note: snapshot files written over]
DEFAULT_ROOT = Path("/dev/shm/zeroshard")


def default_directory() -> Path:
    """This job's snapshot directory on this machine: /dev/shm/zeroshard/<torchelastic run id>."""
    return DEFAULT_ROOT / os.environ.get("TORCHELASTIC_RUN_ID", "default")


def buddy_of(rank: int, world_size: int, ranks_per_machine: int) -> int:
    """The rank that keeps a copy of `rank`'s file: the same local rank on the next machine."""
    return (rank + ranks_per_machine) % world_size


def _step_of(tag: str) -> int:
    return int(tag.removeprefix(PREFIX))


def take_snapshot(
    engine,
    directory,
    ranks_per_machine: int,
    keep: int = 1,
    background: BackgroundSaves | None = None,
    client_state=None,
) -> str:
    """Write a snapshot of `engine` at its current step into `directory` on this machine, with this
    rank's file also on its buddy ([Note: snapshots on a buddy]). Collective. Returns its tag.
    `client_state`: what `recover` hands back (the data position, ...), as save_checkpoint's.
    `background`: the engine's writer; the call returns once the rank's shards (and on rank 0 the
    manifest, objects and buffers) are copied, and the writer serialises, sends, writes and
    publishes them while training goes on ([Note: asynchronous save] in background.py)."""
    comm = engine.comm
    counters = engine.counters()
    if counters.backward_pending or counters.mid_accumulation:
        raise CheckpointError("a snapshot is taken after engine.step() at an accumulation boundary")
    if comm.world_size % ranks_per_machine:
        raise CheckpointError(f"{comm.world_size} ranks are not machines of {ranks_per_machine} ranks each")
    if layout_of(engine) is not None or replica_of(engine) is not None:
        raise CheckpointError("snapshots under tensor/pipeline parallelism or MiCS are not supported")
    directory = Path(directory)
    tag = f"{PREFIX}{counters.global_steps}"
    what = f"snapshot {tag}"  # the same on every rank: each machine has its own directory
    states = optimizer_states(engine)
    rng = comm.all_gather_objects(rng_state(), f"{what}: random-number generators")
    contents, error = attempt(shard_contents, engine, states, None, background)  # copies with `background`
    common = None
    if error is None and comm.rank == 0:  # what every machine holds, but the rank files' records
        common, error = attempt(_common_files, engine, states, tag, client_state, rng)
    agree(comm, error, what)
    snapshot = _Staged(tag, what, directory, ranks_per_machine, keep, contents, common)
    if background is None:
        snapshot.finish(comm)
    else:
        writer = background.communicator(comm)
        background.start(lambda: snapshot.finish(writer), str(directory / tag))
    return tag


@dataclass
class _Staged:
    """A snapshot taken at its step, written by `finish` (on the training's communicator, or on the
    writer's from its thread)."""

    tag: str
    what: str
    directory: Path
    ranks_per_machine: int
    keep: int
    contents: tuple  # (file name, tensors, metadata) of this rank's shard file
    common: tuple | None  # rank 0: (manifest without the files' records, {file name: bytes})

    def finish(self, comm) -> None:
        name, tensors, metadata = self.contents
        what = self.what
        nonce = comm.all_gather_objects(uuid.uuid4().hex[:12], f"{what}: staging name")[0]
        staging = self.directory / f".partial-{self.tag}-{nonce}"
        # the rank's own file first, hashed as written (as a checkpoint's): then its bytes go to the buddy
        record, error = attempt(_write_own, self.directory, staging, name, tensors, metadata)
        everyone = comm.all_gather_objects((name, record, error), f"{what}: files")
        agree(comm, next((e for _, _, e in everyone if e is not None), None), what)
        to = buddy_of(comm.rank, comm.world_size, self.ranks_per_machine)
        source = (comm.rank - self.ranks_per_machine) % comm.world_size
        if to != comm.rank:  # one machine: no buddy
            theirs, record = everyone[source][0], everyone[source][1]
            with _Arrival(staging / theirs, record["bytes"], self.directory / SPARE / theirs) as arrival:
                _send_file(comm, staging / name, to, arrival.tensor, source, f"{what}: to the buddy")
                error = arrival.finish(record, f"snapshot file {theirs} arrived from its rank")
        common = None
        if comm.rank == 0 and error is None:  # the manifest, now with every file's record
            assert self.common is not None  # rank 0 made it at the step
            common, error = attempt(_with_records, *self.common, {n: r for n, r, _ in everyone})
        common = comm.all_gather_objects(common, f"{what}: manifest")[0]
        agree(comm, error, what)
        leader = comm.rank % self.ranks_per_machine == 0
        _, error = attempt(_write_files, staging, common if leader else {})
        agree(comm, error, what)
        if leader:
            _, error = attempt(_publish, self.directory, staging, self.tag, self.keep)
        agree(comm, error, what)
        log.info("zeroshard: snapshot %s written to %s (its copy on rank %d)", self.tag, self.directory, to)


def _write_own(directory: Path, staging: Path, name: str, tensors: dict, metadata: dict) -> dict:
    with _naming(staging / name):
        staging.mkdir(parents=True, exist_ok=True)
        _take_spare(directory / SPARE / name, staging / name)  # [Note: snapshot files written over]
        return write_safetensors(staging / name, tensors, metadata, write_over=True)


def _take_spare(spare: Path, path: Path) -> bool:
    """Move the spare file of this name (the replaced snapshot's) to `path`; False where there is none."""
    try:
        os.rename(spare, path)
        return True
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def _naming(path: Path):
    """An OSError of a write as a CheckpointError that names the file; a full /dev/shm (ENOSPC) is
    host memory running out, which the message says, with what a snapshot needs there."""
    try:
        yield
    except OSError as error:
        hint = ""
        if error.errno == errno.ENOSPC:
            hint = (
                f" (host memory: {path.parent.parent} is full; a snapshot needs about twice its ranks' model "
                "states there while the previous one is kept, see zeroshard.snapshot_dir)"
            )
        raise CheckpointError(f"{path}: {error.strerror or error}{hint}") from error


def _send_file(comm, path: Path, to: int, received: torch.Tensor, source: int, what: str) -> None:
    """Send the file at `path` (mapped, not copied) to rank `to` while `received` fills from `source`."""
    with _mapped(path) as sent:
        comm.shift(sent, to, received, source, what)


@contextlib.contextmanager
def _mapped(path: Path):
    """The file's bytes as a uint8 tensor over a read-only mapping, for as long as the block lasts."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:  # nothing to map
            yield torch.empty(0, dtype=torch.uint8)
            return
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            with warnings.catch_warnings():  # a read-only buffer: a send only reads it
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.frombuffer(mapped, dtype=torch.uint8)
            try:
                yield tensor
            finally:
                del tensor  # the map cannot close while a tensor still points into it


def _common_files(engine, states: list[dict], tag: str, client_state, rng: list) -> tuple[dict, dict[str, bytes]]:
    """Rank 0, at the step: the manifest (its files' records to come) and objects.pt and buffers."""
    contents = part_contents(engine, states, tag, None, copy=False)
    out = {OBJECTS: engine_objects_bytes(engine, states, client_state or {}, rng)}
    if contents["buffers"]:
        out[BUFFERS] = safetensors_bytes(contents["buffers"])
    return contents["manifest"], out


def _with_records(manifest: dict, out: dict[str, bytes], records: dict[str, dict]) -> dict[str, bytes]:
    files = dict(records)
    files.update({name: record_of(data) for name, data in out.items()})
    return {**out, MANIFEST: manifest_text({**manifest, "files": files}).encode()}


class _Arrival:
    """A file received straight into a writable mapping of a temporary file beside `path`, which
    `finish` checks and renames to `path` ([Note: receiving into the file]). `tensor` is what the
    exchange fills. Where the file cannot be made, `tensor` is in memory and `error` says why: the
    rank still takes part in the exchange, and `finish` returns the error."""

    def __init__(self, path: Path, size: int, spare: Path | None = None):
        self.path, self.temporary = path, temporary_beside(path)
        self._file: BinaryIO | None = None
        self._mapped: mmap.mmap | None = None
        self.error: str | None
        _, self.error = attempt(self._create, size, spare)  # the error as one message, or None
        self.tensor: torch.Tensor
        if self._mapped is not None:
            self.tensor = torch.frombuffer(self._mapped, dtype=torch.uint8)
        else:
            self.tensor = torch.empty(0 if self.error is None else size, dtype=torch.uint8)

    def _create(self, size: int, spare: Path | None) -> None:
        """`spare`: a file to write over where it exists ([Note: snapshot files written over])."""
        with _naming(self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            written_over = spare is not None and _take_spare(spare, self.temporary)
            self._file = open(self.temporary, "r+b" if written_over else "w+b")
            if written_over and os.fstat(self._file.fileno()).st_size > size:
                os.ftruncate(self._file.fileno(), size)
            if size:
                os.posix_fallocate(self._file.fileno(), 0, size)
                # its pages exist: map them all at once rather than fault on each
                populate = mmap.MAP_POPULATE if written_over else 0
                self._mapped = mmap.mmap(self._file.fileno(), size, flags=mmap.MAP_SHARED | populate)

    def __enter__(self) -> _Arrival:
        return self

    def __exit__(self, *exc) -> None:
        self._close()
        self.temporary.unlink(missing_ok=True)  # where it was not put in place

    def finish(self, record: dict, what: str) -> str | None:
        """Check the bytes against the sender's `record`, then put the file in place (durably:
        files.put_in_place); the error where either failed."""
        if self.error is None and not matches(self.tensor.numpy().data, record):
            self.error = f"{what} with another checksum than it was sent with"
        self._close()
        if self.error is None:
            _, self.error = attempt(self._put_in_place)
        return self.error

    def _put_in_place(self) -> None:
        with _naming(self.path):
            put_in_place(self.temporary, self.path)

    def _close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)  # the mapping cannot close while a tensor points into it
        if self._mapped is not None:
            # Still exported (a tensor of the exchange alive in an error unwinding past us): it
            # closes with the last one, and the error in flight stays the one raised.
            with contextlib.suppress(BufferError):
                self._mapped.close()
        if self._file is not None:
            self._file.close()


def _write_files(staging: Path, files: dict) -> None:
    """Into the staging directory, which is renamed whole once every rank wrote (no file is looked
    for there before): plain writes, checked by size and checksum when read back."""
    staging.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        with _naming(staging / name), open(staging / name, "wb") as file:
            file.write(data)


def _publish(directory: Path, staging: Path, tag: str, keep: int) -> None:
    """Rename the finished staging directory to `tag`, then remove all but the `keep` newest
    snapshots and what interrupted writes left. The newest snapshot it replaces becomes the spare:
    one of the same step set aside for the new one, else the newest of those beyond `keep`."""
    fsync_dir(staging)
    final = directory / tag
    aside = None
    if final.exists():  # kept whole, under another name, until the new one is in place
        aside = directory / f".old-{tag}-{uuid.uuid4().hex[:12]}"
        final.rename(aside)
    staging.rename(final)
    fsync_dir(directory)
    snapshots = sorted(_complete(directory), key=_step_of)
    replaced = [directory / name for name in snapshots[: max(0, len(snapshots) - keep)]]
    replaced += [aside] if aside is not None else []
    for entry in [directory / SPARE, *directory.glob(".partial-*"), *directory.glob(".old-*")]:
        if entry != aside:  # the spare's files the new snapshot left, and leftovers
            shutil.rmtree(entry, ignore_errors=True)
    if replaced:  # the next snapshot writes over its files: [Note: snapshot files written over]
        replaced[-1].rename(directory / SPARE)
    for old in replaced[:-1]:
        shutil.rmtree(old, ignore_errors=True)


def _restore_set_aside(directory: Path) -> None:
    """Rename back a snapshot that _publish set aside when a crash stopped it before the new one
    took its name. Every rank of a machine may try at once: the first rename wins."""
    if not directory.is_dir():
        return
    for aside in directory.glob(".old-*"):
        final = directory / aside.name[len(".old-") :].rsplit("-", 1)[0]
        if (aside / MANIFEST).is_file() and not final.exists():
            with contextlib.suppress(FileNotFoundError, FileExistsError, OSError):
                aside.rename(final)


def _complete(directory: Path) -> list[str]:
    if not directory.is_dir():
        return []
    return [p.name for p in directory.iterdir() if p.name.startswith(PREFIX) and (p / MANIFEST).is_file()]


# -- recovery -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Recovered:
    """What `recover` loaded: `source` "snapshot", "checkpoint" or "nothing", the directory and tag,
    the step, why a snapshot was not used (None where one was), and the client state saved with it."""

    source: str
    path: str | None
    step: int | None
    reason: str | None
    client_state: object = None


def _inventory(directory: Path) -> dict[str, dict]:
    """tag -> {step, world, files present}, for each complete snapshot on this machine."""
    _restore_set_aside(directory)
    out = {}
    for tag in _complete(directory):
        try:
            manifest = read_manifest(directory / tag)
        except (OSError, ValueError, CheckpointError) as error:  # damaged: as good as absent
            log.warning("zeroshard: snapshot %s is unreadable, not a candidate: %s", directory / tag, error)
            continue
        present = [f for f, record in manifest["files"].items() if _size(directory / tag / f) == record["bytes"]]
        out[tag] = {"step": manifest["global_steps"], "world": manifest["world_size"], "files": [*present, MANIFEST]}
    return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _choose(inventories: list[dict]) -> tuple[str | None, str | None]:
    """(the newest snapshot whose files are all on some rank's machine, why newer ones are not)."""
    tags: dict[str, dict] = {}
    for inventory in inventories:
        for tag, entry in inventory.items():
            seen = tags.setdefault(tag, {"world": entry["world"], "files": set()})
            seen["files"] |= set(entry["files"])
    skipped: list[str] = []
    for tag in sorted(tags, key=_step_of, reverse=True):
        needed = {rank_file(r) for r in range(tags[tag]["world"])} | {MANIFEST, OBJECTS}
        missing = sorted(needed - tags[tag]["files"])
        if not missing:
            return tag, "; ".join(skipped) or None
        skipped.append(
            f"{tag} is incomplete: no survivor holds {', '.join(missing)} (a rank and its buddy lost together)"
        )
    return None, "; ".join(skipped) or "no snapshot on any surviving machine"


def recover(engine, directory, ranks_per_machine: int, checkpoint_dir=None) -> Recovered:
    """Load the newest complete snapshot the survivors hold, resharded to this world size and
    stage, or else the newest checkpoint under `checkpoint_dir` (its `latest`), whichever is newer
    ([Note: snapshots on a buddy]). Collective; a warning says why a snapshot was not used."""
    comm = engine.comm
    directory = Path(directory)
    mine, error = attempt(_inventory, directory)
    inventories = comm.all_gather_objects(mine or {}, "recovery: snapshot inventories")
    agree(comm, error, "recovery: reading this machine's snapshots")
    tag, reason = _choose(inventories)
    disk_step = _disk_step(checkpoint_dir)
    if tag is not None and disk_step is not None and disk_step > _step_of(tag):
        reason, tag = f"snapshot {tag} is older than the disk checkpoint of step {disk_step}", None
    if tag is None:
        if checkpoint_dir is None or disk_step is None:
            log.warning("zeroshard: nothing to recover from: %s, and no disk checkpoint", reason)
            return Recovered("nothing", None, None, reason)
        log.warning("zeroshard: recovering from the disk checkpoint in %s: %s", checkpoint_dir, reason)
        path, client_state = load_checkpoint(engine, checkpoint_dir)
        return Recovered("checkpoint", path, disk_step, reason, client_state)
    _fill(comm, directory, tag, inventories, ranks_per_machine)
    # generators too; not hashed again ([Note: snapshots on a buddy])
    path, client_state = load_checkpoint(engine, directory, tag=tag, name=f"snapshot {tag}", verify=False)
    log.info("zeroshard: recovered snapshot %s from host memory (%s)", tag, directory)
    return Recovered("snapshot", path, _step_of(tag), reason, client_state)


def _disk_step(checkpoint_dir) -> int | None:
    if checkpoint_dir is None:
        return None
    checkpoint_dir = Path(checkpoint_dir)
    try:
        tag = resolve_tag(checkpoint_dir, None) if (checkpoint_dir / LATEST).is_file() else None
        return None if tag is None else read_manifest(checkpoint_dir / tag)["global_steps"]
    except (OSError, ValueError, CheckpointError):
        return None


def _fill(comm, directory: Path, tag: str, inventories: list[dict], ranks_per_machine: int) -> None:
    """Give every machine each file of `tag` it lacks: sent point to point from a rank whose machine
    holds it (the holders take turns, file by file) to the first rank of each machine that lacks it,
    so a file crosses the network once per machine that needs it and only its receivers hold it in
    memory."""
    holders: dict[str, list[int]] = {}
    for rank, inventory in enumerate(inventories):
        for name in inventory.get(tag, {}).get("files", []):
            holders.setdefault(name, []).append(rank)
    leaders = range(0, comm.world_size, ranks_per_machine)
    manifest_holder = holders[MANIFEST][0]
    manifest = comm.all_gather_objects(
        read_manifest(directory / tag) if comm.rank == manifest_holder else None, "recovery: manifest"
    )[manifest_holder]
    target = directory / tag
    for index, name in enumerate(sorted(manifest["files"])):
        have = holders.get(name, [])
        lacking = [leader for leader in leaders if leader not in have]
        if not have or not lacking:
            continue  # everywhere already (or a file the snapshot may lack, as buffers without buffers)
        record, source = manifest["files"][name], have[index % len(have)]
        arrival = _Arrival(target / name, record["bytes"]) if comm.rank in lacking else None
        with arrival or contextlib.nullcontext():
            receives = [] if arrival is None else [(source, arrival.tensor)]
            with _mapped(target / name) if comm.rank == source else contextlib.nullcontext() as sent:
                sends = [] if sent is None else [(leader, sent) for leader in lacking]
                comm.exchange(sends, receives, f"recovery: {tag}/{name}")
            del receives
            error = None if arrival is None else arrival.finish(record, f"{target / name}: the copy arrived")
        agree(comm, error, f"recovery: copying {tag}/{name}")
    error = None
    if comm.rank in leaders and comm.rank not in holders[MANIFEST]:  # last: it makes the directory a snapshot
        _, error = attempt(write_atomic, target / MANIFEST, manifest_text(manifest).encode())
    agree(comm, error, f"recovery: copying {tag}/{MANIFEST}")
