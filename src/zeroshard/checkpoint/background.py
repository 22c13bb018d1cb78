"""Asynchronous checkpoint saves: the files are written by a thread while training goes on.

[Note: asynchronous save]
`save_checkpoint(..., async_save=True)` (or `zeroshard.async_checkpoint` in the config) runs the
first part of a save as usual, in the caller's thread and on every rank: the ranks agree on the tag
and directory, rank 0 serialises objects.pt (a value that cannot be loaded back fails the call) and
clears what crashed saves left. Then each rank *stages* what it would write -- its master and
optimizer-state shards, copied to host memory (pinned when they live on a GPU) -- and rank 0 the
manifest and the module's buffers; the call returns. A thread of the engine's (`BackgroundSaves`)
writes the rank files and runs the rest of [Note: atomic publication] (save.py): the ranks agree
that every file is written, rank 0 writes the manifest and publishes by renaming, then moves
`latest`. Those agreements run on a gloo process group of their own, created at the first
asynchronous save, so that they never interleave with the training's collectives.

What training sees: the call's stall is the staging copy (the whole rank's shards once, in host
memory until the thread has written them); the next save, `load_checkpoint`, `wait_checkpoint()`
and `destroy()` first wait for the thread, and raise, on every rank, the error it met (every rank
learnt every rank's failure in the thread's agreement, so all raise the same CheckpointError,
naming the rank and the file). A process killed at any point leaves what a killed synchronous save
leaves: `latest` names the previous, complete checkpoint. The thread is not a daemon: a script that
ends without waiting still finishes and publishes its last save before the process exits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from zeroshard.checkpoint.files import CheckpointError
from zeroshard.core.comm import Communicator


class BackgroundSaves:
    """One engine's checkpoint writer: at most one save in flight, its error kept for the next call."""

    def __init__(self) -> None:
        self._comm: Communicator | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.path: str | None = None  # the checkpoint the last save publishes
        self.buffers: dict[str, torch.Tensor] = {}  # host copies, reused by the next save ([Note: staging buffers])

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def communicator(self, comm: Communicator) -> Communicator:
        """The gloo group the thread agrees on, over `comm`'s ranks (made at the first call: collective)."""
        if self._comm is None:
            if comm.world_size != dist.get_world_size():
                raise CheckpointError(
                    f"an asynchronous save needs the data-parallel group to be every rank ({comm.world_size} of "
                    f"{dist.get_world_size()} here, under tensor or pipeline parallelism): save synchronously"
                )
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=comm.timeout_s))
            self._comm = Communicator(comm.timeout_s, group=group)
            self._comm._owns_group = True
        return self._comm

    def start(self, work: Callable[[], None], path: str) -> None:
        assert not self.busy, "wait() for the save in flight first"
        self.path = path

        def run() -> None:
            try:
                work()
            except BaseException as error:  # noqa: BLE001 - kept for the next call, on this rank
                self._error = error

        self._thread = threading.Thread(target=run, name="zeroshard-checkpoint-writer", daemon=False)
        self._thread.start()

    def wait(self) -> str | None:
        """Wait for the save in flight; raise its error (each error once). Returns its checkpoint path."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if isinstance(error, CheckpointError):
            raise CheckpointError(f"the asynchronous save of {self.path} failed: {error}") from error
        if error is not None:
            raise CheckpointError(f"the asynchronous save of {self.path} failed: {error!r}") from error
        return self.path

    def close(self) -> None:
        """Wait for the save in flight (raising its error), then free the process group."""
        try:
            self.wait()
        finally:
            if self._comm is not None:
                self._comm.destroy()
                self._comm = None


# [Note: staging buffers]
# The host copies of one save are kept for the next one (same names, shapes and dtypes: the same
# engine saves the same shards), as torch DCP's and torchtitan's pinned-memory stagers keep theirs:
# a fresh gigabyte of host memory costs the kernel's zero-filling of every page, a quarter of a
# million page faults, on every save; reused, the stall is the copy alone. The price is that the
# copy stays allocated between saves (the rank's shards once: docs/checkpoint.md).
def stage(tensors: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Host copies of `tensors`, which training may change as soon as this returns (pinned memory for
    GPU tensors, so the copies run at the link's speed). `buffers`: copies of an earlier call, reused
    where a name's shape and dtype match, and updated with this call's ([Note: staging buffers])."""
    out = {}
    synchronize = False
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        host = buffers.get(name) if buffers is not None else None
        if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
            pinned = tensor.device.type == "cuda"
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
        host.copy_(tensor, non_blocking=tensor.device.type == "cuda")
        synchronize |= tensor.device.type == "cuda"
        out[name] = host
    if synchronize:
        torch.cuda.synchronize()
    if buffers is not None:
        buffers.clear()
        buffers.update(out)
    return out
