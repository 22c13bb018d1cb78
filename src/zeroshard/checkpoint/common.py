"""Steps shared by saving, loading and gathering: agreeing on failures, and where a rank's part of
each flat group sits."""

from __future__ import annotations

import traceback
from typing import Any

import torch

from zeroshard.checkpoint.files import CheckpointError


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
    label = getattr(comm, "rank_label", str)  # a grid's ranks say where they sit (layout.GridComm)
    ranks = [rank for rank, _ in failed]
    named = str(ranks) if label is str else ", ".join(label(rank) for rank in ranks)
    if len(messages) == 1:
        raise CheckpointError(f"{what} failed on rank{'s' if len(ranks) > 1 else ''} {named}: {messages[0]}")
    lines = "\n".join(f"  rank {label(rank)}: {message}" for rank, message in failed)
    raise CheckpointError(f"{what} failed on ranks {ranks}:\n{lines}")


def attempt(fn, *args, **kwargs) -> tuple[Any, str | None]:
    """(fn's result, None), or (None, the error as one message) when it raised."""
    try:
        return fn(*args, **kwargs), None
    except CheckpointError as error:
        return None, str(error)
    except OSError as error:  # the file system's own words say it all (no space, permission, ...)
        return None, f"{type(error).__name__}: {error}"
    except Exception as error:  # noqa: BLE001 - reported to every rank by agree()
        return None, f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=4)}"


def partition_of(engine):
    """The communicator the flat groups are sliced over: a MiCS partition group, else `comm`."""
    return getattr(engine, "partition", None) or engine.comm


def replica_of(engine):
    """MiCS: the communicator over the ranks holding this rank's shard in the other partition
    groups; None when every rank holds a shard of its own."""
    return getattr(engine, "replica", None)


def compute_dtype(engine) -> torch.dtype:
    """The dtype the module's parameters have (bf16/fp16 with mixed precision, else fp32)."""
    return engine.groups[0].param_dtype


def own_range_in_master(group, rank: int) -> tuple[int, int]:
    """This rank's shard [r*S, (r+1)*S) as a range inside `group.master`, which is that shard at
    stages 1-3 and the whole padded buffer at stage 0."""
    if group.sharded_master:
        return 0, group.master.numel()
    return group.layout.shard_range(rank)


def optimizer_states(engine) -> list[dict]:
    """Per flat group (engine order), its optimizer state in one piece (ZeroOptimizer.group_state)."""
    return [engine.optimizer.group_state(group) if group.trainable else {} for group in engine.groups]
