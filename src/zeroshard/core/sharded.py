"""`zeroshard.shard`: ZeRO applied to a model and its optimizer, with no config and no engine.

Like FSDP2's `fully_shard`, one call turns a plain model and a plain torch optimizer into their
sharded form; what comes back owns everything ZeRO adds — the units and their flat groups, the
lifecycle hooks, the sharded optimizer, the offload stores and the communicator — and is driven
with four calls:

    sharded = zeroshard.shard(model, torch.optim.AdamW(model.parameters()), stage=3)
    loss = sharded(batch)            # forward through the model (gathers units at stage 3)
    sharded.backward(loss)           # reduces each unit's gradients as its backward finishes
    sharded.step()                   # optimizer step on this rank's shards, parameters refreshed
    sharded.zero_grad()              # only needed to discard gradients (they are cleared by step)

The DeepSpeed engine (compat/engine.py) is this object plus a config, accessors, gradient
accumulation counters and checkpoints. With `optimizer=None` (ZeRO-Inference, compat/inference.py)
nothing is trainable: no gradient buffers, no optimizer state, and at stage 3 the parameter shards
are the only copy of the weights. `group` is the process group ZeRO shards over: the world,
or the data-parallel dimension of a device mesh.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import sys

import torch
from torch import nn

from zeroshard.core.comm import CollectiveError, Communicator
from zeroshard.core.gathered import GatherLimits
from zeroshard.core.lifecycle import Lifecycle, Phase
from zeroshard.core.mesh import ModelParallel, NormScope, from_device_mesh
from zeroshard.core.optimizer import ZeroOptimizer
from zeroshard.core.optimizer_groups import optimizer_group_index, repoint_optimizer
from zeroshard.core.param_gather import DeferredGather, ParameterReaders, refresh_parameters
from zeroshard.core.partition import register_engine
from zeroshard.core.placement import Placement
from zeroshard.core.policy import CommPolicy, StagePolicy, stage_policy
from zeroshard.core.precision import DynamicLossScaler, PrecisionPolicy, check_supported
from zeroshard.core.shard import shard_module
from zeroshard.core.streamed import StreamedStep, split
from zeroshard.core.unit import build_links

log = logging.getLogger(__name__)

# [Note: bounded gathering] in gathered.py: the next unit prefetched (any bound below one unit's size
# means that), no element bound beyond it, only the root unit kept from forward to backward. DeepSpeed's
# defaults (5e7, 1e9, 1e9) can gather a small model whole.
DEFAULT_PREFETCH_NUMEL = GatherLimits().prefetch_numel


def shard(model: nn.Module, optimizer: torch.optim.Optimizer | None, *, stage: int | StagePolicy = 3,
          precision: PrecisionPolicy | None = None, placement: Placement | None = None,
          group=None, mesh=None, model_parallel: ModelParallel | None = None,
          wrap: list[str] | None = None, persistence_threshold: int = 0,
          prefetch_numel: int = DEFAULT_PREFETCH_NUMEL, max_live_numel: int | None = None,
          reuse_distance: int = 1, overlap_comm: bool = True,
          gradient_clipping: float = 0.0, loss_scaler: DynamicLossScaler | None = None,
          comm_timeout_s: float = 300.0, check_collectives: bool = True,
          comm_policy: CommPolicy | None = None, overlap_param_gather: bool = True) -> Sharded:
    """Shard `model`'s states over the ranks of `group` (default: the world) at `stage`.

    `optimizer` must be a torch optimizer over `model`'s parameters with an elementwise update (SGD,
    Adam, AdamW, ...); it is kept (class, hyper-parameters, param-group dicts) and re-pointed at this
    rank's fp32 master shards. `precision` sets the compute and reduce dtypes, `placement` the
    offload stores, `wrap` the module classes that become units (default: the blocks of the largest
    ModuleList). At stage 3, `prefetch_numel`, `max_live_numel` and `reuse_distance` bound the gathered
    parameters ([Note: bounded gathering] in core/gathered.py). Rank 0's parameter values are broadcast first, as DDP does. `optimizer=None`: for
    inference only (forward passes; `backward` and `step` raise).

    Inside 3D parallelism, `mesh` is a DeviceMesh with dimensions named 'dp' and 'tp' and/or 'pp':
    ZeRO shards over 'dp' only, and the gradient norm is completed over the others (or give
    `group` and `model_parallel` yourself, e.g. from `zeroshard.core.mesh.from_mpu`). See
    [Note: ZeRO over the data-parallel dimension] in core/mesh.py. `comm_policy`: ZeRO++ and MiCS at
    stage 3 ([Note: ZeRO++ and MiCS] in core/unit.py).
    `overlap_param_gather`: stages 1/2, [Note: deferred parameter gather] in core/param_gather.py.
    """
    if mesh is not None:
        if group is not None or model_parallel is not None:
            raise ValueError("shard(mesh=...) derives the dp group and the model-parallel groups from the "
                             "mesh: pass either mesh or group/model_parallel, not both")
        group, model_parallel = from_device_mesh(mesh, model)
    comm = Communicator(comm_timeout_s, check_collectives, group=group)
    policy = stage if isinstance(stage, StagePolicy) else stage_policy(stage)
    return Sharded(model, optimizer, comm, policy, precision or PrecisionPolicy(), placement or Placement(),
                   wrap=wrap, persistence_threshold=persistence_threshold,
                   gather_limits=GatherLimits(prefetch_numel, max_live_numel, reuse_distance),
                   overlap_comm=overlap_comm, gradient_clipping=gradient_clipping, loss_scaler=loss_scaler,
                   model_parallel=model_parallel, comm_policy=comm_policy, overlap_param_gather=overlap_param_gather)


class Sharded(ParameterReaders):
    """A model and its optimizer under ZeRO; build it with `shard()`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, comm: Communicator,
                 policy: StagePolicy, precision: PrecisionPolicy, placement: Placement, *,
                 wrap: list[str] | None, persistence_threshold: int, gather_limits: GatherLimits, overlap_comm: bool,
                 gradient_clipping: float, loss_scaler: DynamicLossScaler | None,
                 model_parallel: ModelParallel | None = None, comm_policy: CommPolicy | None = None,
                 overlap_param_gather: bool = True):
        self.module = model
        self.model_parallel = model_parallel
        self.comm = comm
        self.policy = policy
        self.precision = precision
        self.placement = placement
        device = next(model.parameters(), torch.empty(0)).device
        check_supported(precision.param_dtype, comm.device if device.type == "meta" else device)
        _cast_buffers(model, precision.param_dtype)
        optimizer_groups = optimizer_group_index(optimizer) if optimizer is not None else {}
        self.comm_policy = comm_policy or CommPolicy()
        self.partition, self.links = build_links(comm, policy, self.comm_policy)
        self.units = shard_module(model, policy, comm, optimizer_groups=optimizer_groups,
                                  precision=precision, placement=placement,
                                  persistence_threshold=persistence_threshold, wrap_modules=wrap,
                                  partition=self.partition, links=self.links)
        self.groups = [g for unit in self.units for g in unit.groups]
        self._param_groups = {id(p): (u, g) for u in self.units for g in u.groups for p in g.params}
        register_engine(self)  # for zero.GatheredParameters, which gets parameters and nothing else
        self.loss_scaler = loss_scaler
        self.optimizer: ZeroOptimizer | None = None
        self.norm_comms = self._norm_comms(comm)
        if optimizer is not None:
            repoint_optimizer(optimizer, self.groups)
            norm = NormScope.build(model_parallel, self.groups, self.norm_comms)
            self.optimizer = ZeroOptimizer(optimizer, self.groups, self.partition, policy, float(gradient_clipping),
                                           loss_scaler, self._streamed_step(optimizer), norm=norm,
                                           replica=self.links.replica)
            # States offloaded out of memory (NVMe) are offloaded so that memory never holds them:
            # the streamed step checks every swap file before it updates anything, but takes no
            # copy ([Note: transactional step] in rollback.py).
            store = placement.optimizer_store
            self.optimizer.transactional = store is None or store.in_memory
        # overlap_comm (DeepSpeed: overlap gradient reduction with backward): off, each unit's
        # reduction is waited for before backward goes on (none in flight); on, one is in flight
        # while the next unit's backward computes ([Note: one reduction in flight] in lifecycle.py).
        self.lifecycle = Lifecycle(self.units, policy, comm.rank, comm.world_size,
                                   limits=gather_limits, overlap_comm=overlap_comm,
                                   max_inflight_reductions=1 if overlap_comm else 0)
        self.lifecycle.register()
        if self.optimizer is not None:
            self.lifecycle.before_final_waits = self.optimizer.copy_ahead
        self.deferred_gather = DeferredGather.attach(self.units, model, self.optimizer, policy, overlap_param_gather,
                                                     wait=self.wait_parameters)
        self._grads_lost: str | None = None  # [Note: failed steps]
        self._broken: str | None = None

    def _norm_comms(self, comm: Communicator) -> list[Communicator]:
        if self.model_parallel is None or not self.model_parallel.norm_groups:
            return []
        if self.loss_scaler is not None:  # its overflow vote runs over dp only: stages would disagree
            raise ValueError("fp16 dynamic loss scaling is not supported with tensor or pipeline parallelism: "
                             "use bf16 (no loss scaling) or fp32")
        return [Communicator(comm.timeout_s, comm.check_collectives, group=g) for g in self.model_parallel.norm_groups]

    def _streamed_step(self, optimizer) -> StreamedStep | None:
        if self.placement.optimizer_store is None:
            return None
        subs = split([g for g in self.groups if g.trainable], self.placement.sub_group_size)
        for index, param_group in enumerate(optimizer.param_groups):
            param_group["params"] = [s.param for s in subs if s.group.optimizer_group == index]
        return StreamedStep(optimizer, subs, self.placement.optimizer_store)

    # -- one training step ---------------------------------------------------------------------------
    # [Note: failed steps]
    # A forward, backward or step that raises leaves parameters, masters, optimizer state and loss
    # scaler as they were before it (the step: [Note: transactional step] in rollback.py). What
    # this rank has in flight is completed -- every rank that got as far issued the same
    # collectives -- and dropped, gathered units are freed, nothing is recorded from the partial
    # pass. Gradients are the exception: a failed backward or step leaves the window's gradients
    # partial, so backward() and step() refuse to run until zero_grad() discards them; the next
    # step then equals a run that never had the failed one. When only some ranks raise, the
    # others cannot complete their next collective and get a CollectiveError after comm_timeout_s.
    # The ranks are then out of step for good: every later call raises at once, naming the
    # first failure, instead of pairing collectives wrongly or waiting again.
    def __call__(self, *args, **kwargs):
        self._check_usable("forward")
        self.lifecycle.begin_forward()
        try:
            out = self.module(*args, **kwargs)
        except BaseException as error:
            self._abort(error)
            raise
        self.lifecycle.end_forward()
        return out

    def backward(self, loss: torch.Tensor, *, boundary: bool = True, retain_graph: bool = False) -> None:
        """Backward of `loss` as it is (divide by the accumulation steps first). `boundary=False`
        accumulates without reducing at stages 0/1 (DDP's no_sync); stages 2/3 always reduce."""
        self._require_optimizer("backward")
        self._check_usable("backward")
        self.lifecycle.begin_backward(boundary)
        try:
            loss.backward(retain_graph=retain_graph)
            self.lifecycle.end_backward()
        except BaseException as error:
            self._grads_lost = f"backward raised {type(error).__name__}: {error}"
            self._abort(error)
            raise

    @contextlib.contextmanager
    def backward_by_caller(self, *, boundary: bool = True):
        """For code that runs forward and backward itself, several micro-batches at a time: a pipeline
        schedule (`torch.distributed.pipelining`) calls the stage module and autograd directly, never
        `backward()`. Gradients arriving inside the block are this step's micro-batches:

            with sharded.backward_by_caller():
                schedule.step(inputs, target=targets, losses=losses)
            sharded.step()

        Stages 0/1 accumulate the micro-batches' full gradients and reduce once when the block ends
        (DDP's no_sync, then one reduction); stages 2/3 reduce-scatter each unit after each
        micro-batch, as `backward()` would. `boundary=False` defers the reduction at stages 0/1 to a
        later block. At stage 3 a unit, once gathered, stays gathered until the block ends: the
        schedule interleaves micro-batches' forwards and backwards, and the activations saved in
        forward view the parameters (peak parameter memory inside the block is stage 2's)."""
        self.lifecycle.begin_backward(False)  # stages 2/3 force per-micro-batch reduction themselves
        self.lifecycle.hold_gathered = True
        try:
            yield
        except BaseException:
            self.lifecycle.phase = Phase.IDLE  # no collectives here: peers will time out, not hang
            raise
        finally:
            self.lifecycle.hold_gathered = False
        self.lifecycle.boundary = boundary or self.policy.shard_gradients
        self.lifecycle.end_backward()  # stages 0/1: every unit reduces its accumulated gradient now

    def step(self) -> bool:
        """Optimizer step on this rank's shards; False when an fp16 overflow skipped it."""
        self._require_optimizer("step")
        assert self.optimizer is not None  # _require_optimizer raised otherwise
        self._check_usable("step")
        self.lifecycle.release_retained()  # the shards change under them
        try:
            return self.optimizer.step()
        except BaseException as error:
            self._grads_lost = f"step raised {type(error).__name__}: {error}"
            if isinstance(error, CollectiveError):
                self._broken = str(error)
            raise

    def zero_grad(self) -> None:
        """Discard the gradients accumulated since the last step."""
        if self.optimizer is None:
            return
        self._finish_interrupted_backward()
        self.optimizer.zero_grad()
        self._grads_lost = None

    def _require_optimizer(self, what: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"{what}() on a model sharded without an optimizer (inference only): pass an "
                               "optimizer to shard() / initialize() to train")

    def _abort(self, error: BaseException | None) -> None:
        """See [Note: failed steps]."""
        if isinstance(error, CollectiveError):
            self._broken = str(error)
        links = [c for u in self.units for c in (u.comm, u.links.replica, u.links.secondary) if c is not None]
        for comm in {id(c): c for c in [self.comm, *self.norm_comms, *links]}.values():
            comm.verify_before_launch = True  # peers may still be in this pass: see its comment in comm.py
        parts: list[Lifecycle | DeferredGather] = [self.lifecycle]
        if self.deferred_gather is not None:
            parts.append(self.deferred_gather)
        for part in parts:
            try:
                part.abort(wait=self._broken is None)
            except CollectiveError as drained:
                self._broken = str(drained)
                note = f"rank {self.comm.rank}: completing the collectives in flight failed too: {drained}"
                if error is not None and sys.version_info >= (3, 11):
                    error.add_note(note)
                elif error is not None:  # Python 3.10 has no add_note: say it in the log instead
                    log.error("%s (while handling %s: %s)", note, type(error).__name__, error)

    def _finish_interrupted_backward(self) -> None:
        """A backward the engine did not call (loss.backward() on its outputs, compat/engine.py)
        that raised leaves the phase at BACKWARD, since autograd runs no callback after an error:
        the next call cleans up as after a failed backward() ([Note: failed steps])."""
        if self.lifecycle.phase is Phase.BACKWARD:
            self._grads_lost = "loss.backward() raised"
            self._abort(None)

    def _check_usable(self, what: str) -> None:
        self._finish_interrupted_backward()
        if self._broken is not None:
            raise CollectiveError(f"rank {self.comm.rank}: {what}() refused: an earlier collective failed and the "
                                  f"ranks are no longer in step; restart from the last checkpoint. It was: "
                                  f"{self._broken}")
        if self._grads_lost is not None and what != "forward":
            raise RuntimeError(f"rank {self.comm.rank}: {what}() refused: the last {self._grads_lost}; the "
                               "gradients accumulated since the last step are partial: call zero_grad() first")

    # -- parameters outside forward: gathered_parameters() and wait_parameters() (ParameterReaders) --
    def owns(self, param) -> bool:
        return id(param) in self._param_groups

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """A snapshot (copies) of this rank's shards: per flat group its fp32 master shard, and the
        optimizer state (`ZeroOptimizer.state_dict`). Loads back into the same layout with
        `load_state_dict`; to change world size or stage, use the checkpoint package, which re-slices
        by parameter."""
        self.wait_parameters()
        return {"masters": [group.master.detach().clone() for group in self.groups],
                "optimizer": copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.wait_parameters()
        masters = state["masters"]
        if [m.numel() for m in masters] != [g.master.numel() for g in self.groups]:
            raise ValueError("state_dict() of another layout (world size, stage or model): "
                             "load it through zeroshard's checkpoints, which re-slice by parameter")
        for group, master in zip(self.groups, masters):
            group.master.copy_(master)
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.refresh_parameters()

    def refresh_parameters(self) -> None:
        """After master weights changed outside a step: every rank's unsharded parameters follow."""
        self.wait_parameters()
        self.lifecycle.release_retained()  # gathered from the old shards
        refresh_parameters(self.groups, self.partition)

    # -- reports -------------------------------------------------------------------------------------
    def num_parameters(self) -> int:
        return sum(slot.numel for g in self.groups for slot in g.layout.slots)

    def memory_report(self) -> dict[str, int]:
        """Bytes of model states this rank holds in memory (counted from its tensors), by kind."""
        report = {"params": 0, "master": 0, "grads": 0}
        for group in self.groups:
            for key, value in group.state_bytes().items():
                report[key] += value
        stores = self.placement.stores()
        report["optimizer"] = self.optimizer.state_bytes(stores) if self.optimizer is not None else 0
        report["total"] = sum(report.values())
        report["offloaded_nvme"] = sum(s.offloaded_bytes for s in stores)
        report["step_snapshot"] = self.optimizer.snapshot_bytes() if self.optimizer is not None else 0  # not a state
        return report

    def communicators(self) -> dict[str, Communicator]:
        """The communicators the model states move over, by role ([Note: ZeRO++ and MiCS] in unit.py)."""
        named = {"world": self.comm, "partition": self.partition, "replica": self.links.replica,
                 "secondary": self.links.secondary}
        out, seen = {}, set()
        for name, comm in named.items():
            if comm is not None and id(comm) not in seen:
                seen.add(id(comm))
                out[name] = comm
        return out

    def comm_report(self) -> dict:
        """This rank's communication: per collective kind summed over every communicator, and under
        "groups" each communicator's own (with ZeRO++ / MiCS the model states move over several)."""
        groups = {name: comm.counter.snapshot() for name, comm in self.communicators().items()}
        report = dict(groups["world"])
        if len(groups) > 1:
            for key in ("paper_bytes", "wire_bytes", "inter_node_bytes", "calls"):
                total: dict = {}
                for snapshot in groups.values():
                    for kind, value in snapshot[key].items():
                        total[kind] = total.get(kind, 0) + value
                report[key] = total
            report["staged_bytes"] = sum(g["staged_bytes"] for g in groups.values())
            report["groups"] = groups
        return report

    def destroy(self) -> None:
        """Remove every hook and free every buffer; the module's parameters are released too."""
        self.lifecycle.remove_hooks()
        if self.deferred_gather is not None:
            self.deferred_gather.close(wait=self._broken is None)
        for unit in self.units:
            unit.destroy()
        if self.optimizer is not None:
            self.optimizer.optimizer.state.clear()
            self.optimizer.snapshot_buffers = None
            for param_group in self.optimizer.param_groups:
                param_group["params"] = []
        self.units, self.groups, self._param_groups = [], [], {}
        self.placement.destroy()
        for comm in [*self.norm_comms, *reversed(self.communicators().values())]:
            comm.destroy()


def _cast_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating buffers compute in the parameters' dtype, as in DeepSpeed's module.half()/bfloat16()."""
    for buffer in model.buffers():
        if buffer.is_floating_point() and buffer.dtype != dtype:
            buffer.data = buffer.data.to(dtype)
