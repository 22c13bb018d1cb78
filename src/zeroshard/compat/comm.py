"""`deepspeed.comm` for scripts: `import zeroshard.comm as dist` where they wrote `import deepspeed.comm`.

DeepSpeed's `comm` package is a thin layer over torch.distributed with the same names (get_rank,
all_reduce, barrier, ReduceOp, ...), plus `init_distributed` and `get_local_rank`. This module is that
layer for scripts; zeroshard's own collectives go through `zeroshard.core.comm.Communicator`, which
counts and checks them. Everything here runs on the world group (or the group passed), exactly as
the same call on torch.distributed would: nothing is counted, nothing is checked.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from zeroshard.core import liveness
from zeroshard.core.comm import CollectiveError

log = logging.getLogger(__name__)

# torch's enum: values pass unchanged to torch.distributed, and DeepSpeed's names (SUM, MAX, AVG, ...)
# are the same ones.
ReduceOp = dist.ReduceOp
ProcessGroup = dist.ProcessGroup
# torch 2.13 renamed the tensor collectives; older releases have only the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def default_backend() -> str:
    """NCCL where a GPU exists, gloo otherwise (what `init_distributed` picks)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout=None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config=None,
    rank: int = -1,
    world_size: int = -1,
    *,
    timeout_s: float | None = None,
) -> None:
    """Initialise torch.distributed from torchrun's environment; no-op when already initialised.

    DeepSpeed's signature; `auto_mpi_discovery`, `distributed_port` and `config` change nothing here
    (torchrun sets the environment; zeroshard has no launcher of its own). `timeout` is a timedelta
    (DeepSpeed's) or `timeout_s` seconds; default 30 minutes, torch's.
    """
    if dist.is_initialized() or dist_init_required is False:
        return
    if rank >= 0 and world_size > 0:  # explicit, as DeepSpeed allows: the address still comes from env
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
    missing = [k for k in _ENV if k not in os.environ]
    if missing and init_method is None:
        raise RuntimeError(
            f"torch.distributed is not initialised and {', '.join(missing)} are not set: "
            "launch the script with `torchrun --nproc_per_node N script.py`"
        )
    backend = dist_backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(get_local_rank())
    if timeout is None:
        timeout = timedelta(seconds=timeout_s if timeout_s is not None else 1800.0)
    elif not isinstance(timeout, timedelta):
        raise TypeError(f"init_distributed(timeout=...) takes a datetime.timedelta, got {type(timeout).__name__}")
    kwargs: dict[str, Any] = {"init_method": init_method} if init_method is not None else {}
    if verbose:
        log.info("initialising torch.distributed with backend %s", backend)
    _init_process_group(backend, timeout, kwargs)


def _init_process_group(backend: str, timeout: timedelta, kwargs: dict) -> None:
    """torch's init_process_group, bounded by `timeout`; a failure names the ranks that are missing
    ([Note: naming the missing ranks] in core/liveness.py)."""
    rank, world = int(os.environ.get("RANK", -1)), int(os.environ.get("WORLD_SIZE", 0))
    if rank >= 0:
        liveness.announce(rank, timeout.total_seconds())  # under torchrun: before, so its peers can tell
    started = time.monotonic()
    try:
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    except Exception as error:
        missing = liveness.describe_missing(list(range(world)), rank, timeout.total_seconds())
        raise CollectiveError(
            f"rank {rank}/{world}: init_process_group failed after {time.monotonic() - started:.1f}s "
            f"(timeout {timeout.total_seconds():g}s); {missing}: {error}"
        ) from error
    liveness.announce(dist.get_rank(), timeout.total_seconds())  # without torchrun: the store is up now


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group=None) -> int:
    return dist.get_rank(group)


def get_world_size(group=None) -> int:
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its machine (torchrun's LOCAL_RANK; 0 without it)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    # dist.group.WORLD is None only before init_process_group, when torch raises anyway
    return dist.get_global_rank(cast(dist.ProcessGroup, group or dist.group.WORLD), group_rank)


def get_all_ranks_from_group(group=None) -> list[int]:
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def get_backend(group=None) -> str:
    return dist.get_backend(group)


def get_world_group():
    return dist.group.WORLD


def new_group(ranks=None, **kwargs):
    return dist.new_group(ranks, **kwargs)


def destroy_process_group(group=None) -> None:
    dist.destroy_process_group(group)


def barrier(group=None, async_op: bool = False, device_ids=None):
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False):
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def inference_all_reduce(tensor, op=ReduceOp.SUM, group=None):
    """DeepSpeed's fast-path all-reduce for inference; the plain one here."""
    return dist.all_reduce(tensor, op=op, group=group)


def reduce(tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor, src: int, group=None, async_op: bool = False):
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def broadcast_object_list(object_list, src: int, group=None, device=None):
    return dist.broadcast_object_list(object_list, src, group=group, device=device)


def all_gather(tensor_list, tensor, group=None, async_op: bool = False):
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list, obj, group=None):
    return dist.all_gather_object(object_list, obj, group=group)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op: bool = False):
    return _all_gather_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op: bool = False):
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor, input_tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    return _reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def gather(tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False):
    return dist.gather(tensor, gather_list, dst, group=group, async_op=async_op)


def scatter(tensor, scatter_list=None, src: int = 0, group=None, async_op: bool = False):
    return dist.scatter(tensor, scatter_list, src, group=group, async_op=async_op)


def all_to_all_single(
    output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op: bool = False
):
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


def send(tensor, dst: int, group=None, tag: int = 0):
    return dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor, src: int | None = None, group=None, tag: int = 0):
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor, dst: int, group=None, tag: int = 0):
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor, src: int | None = None, group=None, tag: int = 0):
    return dist.irecv(tensor, src, group=group, tag=tag)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def log_summary(show_straggler: bool = False) -> None:
    """DeepSpeed's communication log; zeroshard's engine reports volume with `engine.comm_report()`."""
    log.info("zeroshard.comm does not log script collectives; engine.comm_report() has the engine's")
