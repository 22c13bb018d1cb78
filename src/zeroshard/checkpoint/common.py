"""Steps shared by saving, loading and gathering: agreeing on failures, walking a range of a flat
buffer parameter by parameter, and refreshing the unsharded parameters from the master weights."""
from __future__ import annotations

import traceback
from collections.abc import Iterator

import torch

from ..flat import FlatLayout, Slot
from .files import CheckpointError


def agree(comm, error: str | None, what: str) -> None:
    """Every rank learns every rank's failure and raises the same CheckpointError, so that no rank
    walks on into a collective that a failed peer will never join."""
    errors = comm.all_gather_objects(error, f"{what}: status")
    failed = [(rank, message) for rank, message in enumerate(errors) if message is not None]
    if not failed:
        return
    messages = sorted({message for _, message in failed})
    if len(failed) == len(errors) and len(messages) == 1:  # the same problem everywhere (a bad file)
        raise CheckpointError(f"{what}: {messages[0]}")
    ranks = [rank for rank, _ in failed]
    if len(messages) == 1:
        raise CheckpointError(f"{what} failed on rank{'s' if len(ranks) > 1 else ''} {ranks}: {messages[0]}")
    lines = "\n".join(f"  rank {rank}: {message}" for rank, message in failed)
    raise CheckpointError(f"{what} failed on ranks {ranks}:\n{lines}")


def attempt(fn, *args, **kwargs) -> tuple[object, str | None]:
    """(fn's result, None), or (None, the error as one message) when it raised."""
    try:
        return fn(*args, **kwargs), None
    except CheckpointError as error:
        return None, str(error)
    except OSError as error:  # the file system's own words say it all (no space, permission, ...)
        return None, f"{type(error).__name__}: {error}"
    except Exception as error:  # noqa: BLE001 - reported to every rank by agree()
        return None, f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=4)}"


def pieces_in_range(layout: FlatLayout, start: int, end: int) -> Iterator[tuple[Slot, int, int]]:
    """(slot, lo, hi) for each parameter overlapping [start, end) of the padded buffer: elements
    [lo, hi) of the flattened parameter sit at [slot.offset + lo, slot.offset + hi)."""
    for slot in layout.slots:
        lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
        if lo < hi:
            yield slot, lo - slot.offset, hi - slot.offset


def compute_dtype(engine) -> torch.dtype:
    """The dtype the module's parameters have (bf16/fp16 with mixed precision, else fp32)."""
    return engine.groups[0].param_dtype


def own_range_in_master(group, rank: int) -> tuple[int, int]:
    """This rank's shard [r*S, (r+1)*S) as a range inside `group.master`, which is that shard at
    stages 1-3 and the whole padded buffer at stage 0."""
    start, _ = group.opt_range
    a, b = group.layout.shard_range(rank)
    return a - start, b - start


@torch.no_grad()
def refresh_full_parameters(engine) -> None:
    """After the master weights changed outside a step: make every rank's unsharded parameters
    match them (stage-3 units are gathered from the master shards on their next use)."""
    handles = []
    for group in engine.groups:
        if not group.keep_full:  # stage 3: gathered from the master on next use
            continue
        group.copy_master_into_full()
        if group.opt_range != (0, group.layout.padded_numel):  # sharded master: gather the others' slices
            what = f"all-gather of loaded parameters ({group.names[0]}...)"
            handles.append(engine.comm.all_gather(group.full, group.own_slice_of_full(), what, async_op=True))
    for handle in handles:
        handle.wait()
