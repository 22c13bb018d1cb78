"""`zeroshard.shard`: ZeRO applied to a model and its optimizer, with no config and no engine.

Like FSDP2's `fully_shard`, one call turns a plain model and a plain torch optimizer into their
sharded form, configured by a few policy objects; what comes back owns everything ZeRO adds (the
units and their flat groups, the lifecycle hooks, the sharded optimizer, the offload stores and
the communicator) and trains as a plain torch loop does:

    sharded = zeroshard.shard(model, torch.optim.AdamW(model.parameters()), stage=3)
    loss = sharded(batch).loss       # forward through the model (gathers units at stage 3)
    loss.backward()                  # reduces each unit's gradients as its backward finishes
    sharded.step()                   # optimizer step on this rank's shards, parameters refreshed
    sharded.zero_grad()              # only needed to discard gradients (they are cleared by step)

Runtime knobs are methods: `set_gradient_clipping`, `set_loss_scaler` (fp16),
`set_requires_gradient_sync` (accumulate without reducing at stages 0/1, as DDP's no_sync) and
`set_gradient_scale`. The DeepSpeed engine (compat/engine.py) is this object plus a config,
accessors, gradient accumulation counters and checkpoints. With `optimizer=None` (ZeRO-Inference,
inference/sharded.py) nothing is trainable: no gradient buffers, no optimizer state, and at stage 3
the parameter shards are the only copy of the weights.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys

import torch
from torch import nn

from zeroshard.core.comm import CollectiveError, Communicator
from zeroshard.core.lifecycle import Lifecycle, Phase, tensors_in
from zeroshard.core.mesh import ModelParallel, NormScope, zero_groups
from zeroshard.core.optim.groups import optimizer_group_index, repoint_optimizer
from zeroshard.core.optim.muon import as_one_optimizer
from zeroshard.core.optim.optimizer import ZeroOptimizer
from zeroshard.core.optim.streamed import StreamedStep, split
from zeroshard.core.optim.whole import whole_param_groups
from zeroshard.core.owners import OwnerPlan
from zeroshard.core.param_gather import DeferredGather, refresh_parameters
from zeroshard.core.placement import Placement, place
from zeroshard.core.policy import (
    CommunicationPolicy,
    GatheringPolicy,
    OffloadPolicy,
    PrecisionPolicy,
    StagePolicy,
    stage_policy,
)
from zeroshard.core.precision import DynamicLossScaler, check_supported
from zeroshard.core.registry import register_engine
from zeroshard.core.sequence import SequenceParallel
from zeroshard.core.shard import shard_module
from zeroshard.core.unit import build_links

log = logging.getLogger(__name__)


def shard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
    *,
    stage: int | StagePolicy = 3,
    mesh=None,
    precision: PrecisionPolicy | None = None,
    offload: OffloadPolicy | None = None,
    gathering: GatheringPolicy | None = None,
    communication: CommunicationPolicy | None = None,
) -> Sharded:
    """Shard `model`'s states, and `optimizer`'s, over the data-parallel ranks at `stage` (0-3).

    `optimizer`: a torch optimizer over `model`'s parameters with an elementwise update (SGD, Adam,
    AdamW, ...); it is kept (class, hyper-parameters, param-group dicts) and re-pointed at this
    rank's fp32 master shards. Muon (`torch.optim.Muon`, or `MuonWithAdamW`'s `use_muon` groups, or
    a list `[muon, adamw]`) updates whole matrices: each is owned whole by one rank, which alone
    updates it ([Note: whole-parameter ownership] in core/owners.py). None: for inference only
    (forward passes; `backward` and `step` raise).
    `mesh`: where ZeRO shards: None (the world), a ProcessGroup, or a DeviceMesh with dimensions
    named 'dp' and 'tp' and/or 'pp' (ZeRO shards over 'dp' and completes the gradient norm over the
    others; ZeroGroups from `zeroshard.core.mesh.from_mpu` for a Megatron mpu), see [Note: ZeRO
    over the data-parallel dimension] in core/mesh.py; or 'dp' and 'sp' (sequence parallelism: ZeRO
    shards over dp x sp, `Sharded.sequence_parallel` is the sp group, [Note: Ulysses sequence
    parallelism] in core/sequence.py).
    The policies (core/policy.py; None: their defaults): `precision`, the compute and reduce dtypes
    (masters are fp32); `offload`, where optimizer states and stage-3 parameter shards live
    (`zeroshard.CPUOffload()`, `zeroshard.NVMeOffload(path)`, or a `Placement` of stores);
    `gathering`, which modules become units and how much stage 3 gathers ahead ([Note: bounded
    gathering] in core/gathered.py); `communication`, timeouts, overlap, the debug check, ZeRO++ and
    MiCS.
    Rank 0's parameter values are broadcast first, as DDP does.
    """
    for name, value, kind in (
        ("precision", precision, PrecisionPolicy),
        ("gathering", gathering, GatheringPolicy),
        ("communication", communication, CommunicationPolicy),
    ):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"shard({name}={value!r}): a zeroshard.{kind.__name__}, or None for its defaults")
    if offload is not None and not isinstance(offload, OffloadPolicy):
        raise TypeError(
            f"shard(offload={offload!r}): zeroshard.CPUOffload(), zeroshard.NVMeOffload(path), a "
            "zeroshard.Placement of stores, or None (nothing offloaded)"
        )
    groups = zero_groups(mesh, model)
    communication = communication or CommunicationPolicy()
    communicator = Communicator(communication.timeout_s, communication.check_collectives, group=groups.dp)
    policy = stage if isinstance(stage, StagePolicy) else stage_policy(stage)
    sequence = None
    if groups.sp is not None:
        sp = Communicator(communication.timeout_s, communication.check_collectives, group=groups.sp)
        sequence = SequenceParallel(sp)
    one_optimizer = as_one_optimizer(optimizer)
    coordinate = groups.model_parallel.coordinate if groups.model_parallel is not None else None
    placement = place(
        offload, model, communicator.rank, communicator.world_size, one_optimizer, policy.shard_parameters, coordinate
    )
    return Sharded(
        model,
        one_optimizer,
        communicator,
        policy,
        precision or PrecisionPolicy(),
        placement,
        gathering=gathering or GatheringPolicy(),
        communication=communication,
        model_parallel=groups.model_parallel,
        sequence_parallel=sequence,
    )


class Sharded:
    """A model and its optimizer under ZeRO; build it with `shard()`.

    Its public surface, kept stable: calling it (the model's forward), `backward`, `step`,
    `zero_grad`, `backward_by_caller`; the runtime knobs `set_gradient_clipping`, `set_loss_scaler`,
    `set_requires_gradient_sync`, `set_gradient_scale`, `set_on_failed_update`; `gathered_parameters`,
    `gathered_model`, `wait_parameters`, `refresh_parameters`, `owns`; `state_dict` /
    `load_state_dict` (this rank's shards); `num_parameters`, `memory_report`, `comm_report`,
    `communicators`; `destroy`. Attributes, to read: `module` (the model), `optimizer` (the sharded
    optimizer; None for inference), `comm` (the data-parallel Communicator: `rank`, `world_size`),
    `policy` (the StagePolicy), `precision` (the PrecisionPolicy), `loss_scaler`, `model_parallel`
    (the tp/pp grid, or None), `sequence_parallel` (the sp group, or None) and `completed_backwards`
    (backwards that ended, by `backward()` or `loss.backward()`). Its parts (units,
    flat groups, lifecycle, links, stores, the policies it was given) are private to zeroshard: the
    DeepSpeed engine and the checkpoint package read them; a user's code does not.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        comm: Communicator,
        policy: StagePolicy,
        precision: PrecisionPolicy,
        placement: Placement,
        *,
        gathering: GatheringPolicy,
        communication: CommunicationPolicy,
        model_parallel: ModelParallel | None = None,
        whole_parameters: bool = False,
        sequence_parallel: SequenceParallel | None = None,
    ):
        """`whole_parameters`: the frozen parameters' resharding groups too are laid out whole, with
        uneven slices (the quantized weight store packs whole rows: [Note: quantized weight store]
        in inference/store.py)."""
        self.module = model
        self.model_parallel = model_parallel
        # The sp group inside `comm`'s ranks: [Note: Ulysses sequence parallelism] in core/sequence.py
        self.sequence_parallel = sequence_parallel
        self.comm = comm
        self.policy = policy
        self.precision = precision
        self._placement = placement
        self._gathering = gathering
        self._communication = communication
        device = next(model.parameters(), torch.empty(0)).device
        check_supported(precision.param_dtype, comm.device if device.type == "meta" else device)
        _cast_buffers(model, precision.param_dtype)
        optimizer_groups = optimizer_group_index(optimizer) if optimizer is not None else {}
        self._partition, self._links = build_links(comm, policy, communication)
        whole = whole_param_groups(optimizer)
        # [Note: whole-parameter ownership] in core/owners.py
        # Stage 3 without qwZ, qgZ and hpZ (which cut slices into equal blocks or rows): uneven slices.
        uneven = policy.shard_parameters and not (
            self._links.quantize_weights or self._links.quantize_gradients or self._links.secondary is not None
        )
        whole_groups: frozenset[int | None] = frozenset(whole)
        if whole_parameters:
            whole_groups |= {None}  # the frozen parameters' groups
        self._owner_plan = OwnerPlan(self._partition.world_size, whole_groups, uneven=uneven) if whole_groups else None
        self._units = shard_module(
            model,
            policy,
            comm,
            optimizer_groups=optimizer_groups,
            precision=precision,
            placement=placement,
            persistence_threshold=gathering.persistence_threshold,
            wrap_modules=list(gathering.wrap) if gathering.wrap else None,
            partition=self._partition,
            links=self._links,
            owner_plan=self._owner_plan,
        )
        self._groups = [g for unit in self._units for g in unit.groups]
        self._param_groups = {id(p): (u, g) for u in self._units for g in u.groups for p in g.params}
        register_engine(self)  # for zero.GatheredParameters, which gets parameters and nothing else
        self.loss_scaler: DynamicLossScaler | None = None
        self.optimizer: ZeroOptimizer | None = None
        self._norm_comms = self._model_parallel_comms(comm)
        if optimizer is not None:
            matrices = repoint_optimizer(optimizer, self._groups)
            norm = NormScope.build(model_parallel, self._groups, self._norm_comms)
            self.optimizer = ZeroOptimizer(
                optimizer,
                self._groups,
                self._partition,
                policy,
                0.0,
                None,
                self._streamed_step(optimizer),
                norm=norm,
                replica=self._links.replica,
                matrices=matrices,
                whole_store=self._placement.optimizer_store,
            )
        # overlap_comm: off, each unit's reduction is waited for before backward goes on (none in
        # flight); on, one is in flight while the next unit's backward computes ([Note: one
        # reduction in flight] in lifecycle.py).
        overlap = communication.overlap_comm
        self._lifecycle = Lifecycle(
            self._units,
            policy,
            comm.rank,
            comm.world_size,
            limits=gathering,
            overlap_comm=overlap,
            max_inflight_reductions=1 if overlap else 0,
        )
        self._lifecycle.register()
        self._deferred_gather = DeferredGather.attach(
            self._units, model, self.optimizer, policy, communication.overlap_param_gather
        )
        self._grads_lost: str | None = None  # [Note: failed steps]
        self._broken: str | None = None
        self._requires_gradient_sync = True  # set_requires_gradient_sync
        self._gradient_scale = 1.0  # set_gradient_scale
        self.completed_backwards = 0  # backwards that ended, by backward() or loss.backward()
        self._placement.trim_heap()  # what building it freed: [Note: trimming the heap] in heap.py

    # -- runtime knobs ---------------------------------------------------------------------------------
    def set_gradient_clipping(self, max_norm: float) -> None:
        """Clip the global gradient norm to `max_norm` at each step (0: no clipping), as
        torch.nn.utils.clip_grad_norm_ over the whole model would."""
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or max_norm < 0:
            raise ValueError(f"set_gradient_clipping({max_norm!r}): a norm >= 0 (0: no clipping)")
        self._require_optimizer("set_gradient_clipping")
        assert self.optimizer is not None
        self.optimizer.clip = float(max_norm)

    def set_loss_scaler(self, scaler: DynamicLossScaler | None) -> None:
        """fp16's dynamic loss scaling: `backward(loss)` scales the loss, and a step whose gradients
        overflowed on any rank is skipped on every rank."""
        self._require_optimizer("set_loss_scaler")
        if scaler is not None and self._norm_comms:  # its overflow vote runs over dp only: stages would disagree
            raise ValueError(
                "fp16 dynamic loss scaling is not supported with tensor or pipeline parallelism: "
                "use bf16 (no loss scaling) or fp32"
            )
        self.loss_scaler = scaler
        assert self.optimizer is not None
        self.optimizer.loss_scaler = scaler

    def set_on_failed_update(self, mode: str) -> None:
        """What a step that raises during its update leaves: "fail_stop" (the default: no copy, every
        later call refuses until a checkpoint is loaded) or "copy" (masters and optimizer state are
        copied before each group's update and put back): [Note: failed optimizer steps] in core/optim/rollback.py."""
        self._require_optimizer("set_on_failed_update")
        assert self.optimizer is not None
        self.optimizer.on_failed_update = mode

    def set_requires_gradient_sync(self, sync: bool) -> None:
        """Whether the next backward reduces gradients (True) or, at stages 0/1, only accumulates
        them on this rank for a later backward to reduce (DDP's no_sync). Stages 2/3 always reduce."""
        self._requires_gradient_sync = bool(sync)

    def set_gradient_scale(self, factor: float) -> None:
        """A `loss.backward()` multiplies each gradient by `factor` as it is taken (1 / the
        accumulation steps, when the loss is not divided by them)."""
        self._gradient_scale = float(factor)

    def _model_parallel_comms(self, comm: Communicator) -> list[Communicator]:
        if self.model_parallel is None or not self.model_parallel.norm_groups:
            return []
        return [Communicator(comm.timeout_s, comm.check_collectives, group=g) for g in self.model_parallel.norm_groups]

    def _streamed_step(self, optimizer) -> StreamedStep | None:
        """The offloaded step of the elementwise groups (whole-parameter groups step one flat group at
        a time, their states in memory or, with an NVMe store, in its files: ZeroOptimizer._apply,
        [Note: whole-parameter states in a store] in core/optim/stored.py)."""
        if self._placement.optimizer_store is None:
            return None
        whole = whole_param_groups(optimizer)
        elementwise = [g for g in self._groups if g.trainable and g.optimizer_group not in whole]
        if not elementwise:
            return None
        subs = split(elementwise, self._placement.sub_group_size)
        for index, param_group in enumerate(optimizer.param_groups):
            if index not in whole:  # those keep the views of their matrices (repoint_optimizer)
                param_group["params"] = [s.param for s in subs if s.group.optimizer_group == index]
        return StreamedStep(optimizer, subs, self._placement.optimizer_store)

    # -- one training step ---------------------------------------------------------------------------
    # [Note: failed steps]
    # A forward or backward that raises leaves parameters, masters, optimizer state and loss scaler
    # as they were before it; so does a step that raises before its update begins. One that raises
    # during the update refuses every later call until a checkpoint is loaded, unless the update
    # was copied ("copy"): [Note: failed optimizer steps] in core/optim/rollback.py. What
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
        self._lifecycle.begin_forward()
        try:
            out = self.module(*args, **kwargs)
        except BaseException as error:
            self._abort(error)
            raise
        self._lifecycle.end_forward()
        if torch.is_grad_enabled() and self.optimizer is not None:
            self._hook_outputs(out)
        return out

    def backward(self, loss: torch.Tensor, *, boundary: bool | None = None, retain_graph: bool = False) -> None:
        """Backward of `loss` as it is (divide by the accumulation steps first); `loss.backward()`
        does the same. `boundary=False` accumulates without reducing at stages 0/1 (DDP's no_sync);
        None: as `set_requires_gradient_sync` says; stages 2/3 always reduce."""
        self._require_optimizer("backward")
        self._check_usable("backward")
        self._lifecycle.begin_backward(self._requires_gradient_sync if boundary is None else boundary)
        try:
            loss.backward(retain_graph=retain_graph)
            self._lifecycle.end_backward()
        except BaseException as error:
            self._grads_lost = f"backward raised {type(error).__name__}: {error}"
            self._abort(error)
            raise
        self.completed_backwards += 1

    # [Note: loss.backward() on the outputs]
    # A torch loop calls `loss.backward()` on what the forward returned. The first gradient that
    # reaches one of the outputs (or, at stage 3, the unit that produced it: the lifecycle's
    # `backward_opener`) opens this object's backward, and a callback queued on autograd's engine
    # closes it when the whole backward is done. Each gradient is multiplied by `gradient_scale`
    # as it is taken (the engine's 1 / accumulation steps, which is what dividing the loss gives,
    # bit for bit when the steps are a power of two). Inside `backward(loss)` the hooks do nothing.
    # fp16 needs the loss scaled before backward, so there it is refused.
    def _hook_outputs(self, output) -> None:
        hooked = [t.register_hook(self._output_grad) for t in tensors_in(output) if t.requires_grad]
        if hooked:
            self._lifecycle.backward_opener = self._open_torch_backward

    def _output_grad(self, grad: torch.Tensor) -> None:
        if self._lifecycle.phase is not Phase.BACKWARD:
            self._open_torch_backward()

    def _open_torch_backward(self) -> None:
        if self.loss_scaler is not None:
            raise RuntimeError(
                "loss.backward() with fp16 loss scaling: the loss must be scaled before backward; "
                "call backward(loss) instead"
            )
        self._check_usable("backward")
        self._lifecycle.begin_backward(self._requires_gradient_sync)
        self._lifecycle.grad_factor = self._gradient_scale
        torch.autograd.Variable._execution_engine.queue_callback(self._end_torch_backward)

    def _end_torch_backward(self) -> None:
        self._lifecycle.grad_factor = 1.0
        self._lifecycle.end_backward()
        self.completed_backwards += 1

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
        self._lifecycle.begin_backward(False)  # stages 2/3 force per-micro-batch reduction themselves
        self._lifecycle.hold_gathered = True
        try:
            yield
        except BaseException:
            self._lifecycle.phase = Phase.IDLE  # no collectives here: peers will time out, not hang
            raise
        finally:
            self._lifecycle.hold_gathered = False
        self._lifecycle.boundary = boundary or self.policy.shard_gradients
        self._lifecycle.end_backward()  # stages 0/1: every unit reduces its accumulated gradient now
        self.completed_backwards += 1

    def step(self) -> bool:
        """Optimizer step on this rank's shards; False when an fp16 overflow skipped it."""
        self._require_optimizer("step")
        self._check_usable("step")
        self._lifecycle.release_retained()  # the shards change under them
        assert self.optimizer is not None  # _require_optimizer raised otherwise
        try:
            stepped = self.optimizer.step()
        except BaseException as error:
            self._grads_lost = f"step raised {type(error).__name__}: {error}"
            if isinstance(error, CollectiveError):
                self._broken = str(error)
            raise
        self._placement.trim_heap()  # the step's temporaries: [Note: trimming the heap] in heap.py
        return stepped

    def zero_grad(self) -> None:
        """Discard the gradients accumulated since the last step."""
        if self.optimizer is None:
            return
        self._finish_interrupted_backward()
        self.optimizer.zero_grad()
        self._grads_lost = None

    def _require_optimizer(self, what: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(
                f"{what}() on a model sharded without an optimizer (inference only): pass an "
                "optimizer to shard() / initialize() to train"
            )

    def _abort(self, error: BaseException | None) -> None:
        """See [Note: failed steps]."""
        if isinstance(error, CollectiveError):
            self._broken = str(error)
        links = [c for u in self._units for c in (u.comm, u.links.replica, u.links.secondary) if c is not None]
        for comm in {id(c): c for c in [self.comm, *self._norm_comms, *links]}.values():
            comm.verify_before_launch = True  # peers may still be in this pass: see its comment in comm.py
        parts: list[Lifecycle | DeferredGather] = [self._lifecycle]
        if self._deferred_gather is not None:
            parts.append(self._deferred_gather)
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
        if self._lifecycle.phase is Phase.BACKWARD:
            self._grads_lost = "loss.backward() raised"
            self._abort(None)

    def _check_usable(self, what: str) -> None:
        self._finish_interrupted_backward()
        if self.optimizer is not None:
            self.optimizer.check_usable(what)  # an update that failed half-way: [Note: failed optimizer steps]
        if self._broken is not None:
            raise CollectiveError(
                f"rank {self.comm.rank}: {what}() refused: an earlier collective failed and the "
                f"ranks are no longer in step; restart from the last checkpoint. It was: "
                f"{self._broken}"
            )
        if self._grads_lost is not None and what != "forward":
            raise RuntimeError(
                f"rank {self.comm.rank}: {what}() refused: the last {self._grads_lost}; the "
                "gradients accumulated since the last step are partial: call zero_grad() first"
            )

    # -- parameters outside forward and backward: every reader waits for the deferred gather first -----
    @contextlib.contextmanager
    def gathered_parameters(self, params, modifier_rank: int | None = None):
        """Full parameters inside the block (stage 3 keeps only shards otherwise). With
        `modifier_rank`, that rank's changes are broadcast and re-partitioned on exit."""
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        unknown = [p for p in params if id(p) not in self._param_groups]
        if unknown:
            raise ValueError(f"{len(unknown)} tensor(s) passed to gathered_parameters are not parameters of this model")
        self.wait_parameters()
        wanted = {id(self._param_groups[id(p)][0]) for p in params}
        units = [u for u in self._units if id(u) in wanted]  # unit order: the same on every rank
        for unit in units:
            unit.unshard("gathered parameters")
            unit.wait_unshard()
        try:
            yield
        finally:
            if modifier_rank is not None:
                for unit in units:
                    for group in unit.groups:
                        assert group.full is not None  # gathered above
                        self.comm.broadcast(group.full, modifier_rank, f"modified parameters of '{unit.name}'")
                        group.copy_full_into_master()
            if self._lifecycle.phase is Phase.IDLE:
                for unit in units:
                    unit.reshard(release=True)  # what the block took from them stays valid

    @contextlib.contextmanager
    def gathered_model(self):
        """Every unit gathered once for the block and kept through any number of forwards without
        autograd, then freed: generation's many short forwards cost one all-gather of the model instead
        of one per unit per token, and no collective per token (TRL's `ds3_gather_for_generation`). The
        whole model is on every rank inside the block."""
        if self._lifecycle.phase is not Phase.IDLE:
            raise RuntimeError("gathered_model() inside a forward or backward: use it between steps")
        self._check_usable("forward")
        self.wait_parameters()
        self._lifecycle.release_retained()
        for unit in self._units:  # issued together, then waited for
            unit.unshard("gathered parameters")
        try:
            for unit in self._units:
                unit.wait_unshard()
            self._lifecycle.keep_gathered = True
            yield
        finally:
            self._lifecycle.keep_gathered = False
            for unit in self._units:
                unit.reshard()

    def wait_parameters(self) -> None:
        """Complete the all-gathers of updated parameters still in flight after a step: call it
        before a script reads parameter values between step() and the next forward ([Note: reads
        before the next forward] in param_gather.py); zeroshard's own readers do. A failure is a failed collective ([Note: failed
        steps] in sharded.py): every later call refuses."""
        gather = self._deferred_gather
        if gather is None or not gather.pending:
            return
        if self._broken is not None:  # the gathers may never complete: drop them, refuse
            gather.abort(wait=False)
            self._check_usable("reading parameters")
        try:
            gather.wait_all()
        except CollectiveError as error:
            self._broken = str(error)
            gather.abort(wait=False)
            raise

    def owns(self, param) -> bool:
        return id(param) in self._param_groups

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """A snapshot (copies) of this rank's shards: per flat group its fp32 master shard, and the
        optimizer state (`ZeroOptimizer.state_dict`). Loads back into the same layout with
        `load_state_dict`; to change world size or stage, use the checkpoint package, which re-slices
        by parameter."""
        self.wait_parameters()
        return {
            "masters": [group.master.detach().clone() for group in self._groups],
            "optimizer": copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.wait_parameters()
        masters = state["masters"]
        if [m.numel() for m in masters] != [g.master.numel() for g in self._groups]:
            raise ValueError(
                "state_dict() of another layout (world size, stage or model): "
                "load it through zeroshard's checkpoints, which re-slice by parameter"
            )
        for group, master in zip(self._groups, masters):
            group.master.copy_(master)
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.refresh_parameters()

    def refresh_parameters(self) -> None:
        """After master weights changed outside a step (a checkpoint or state dict loaded): every
        rank's unsharded parameters follow, and an update that had failed half-way is replaced."""
        if self.optimizer is not None:
            self.optimizer.reloaded()
        self.wait_parameters()
        self._lifecycle.release_retained()  # gathered from the old shards
        refresh_parameters(self._groups, self._partition)

    # -- reports -------------------------------------------------------------------------------------
    def num_parameters(self) -> int:
        return sum(slot.numel for g in self._groups for slot in g.layout.slots)

    def memory_report(self) -> dict[str, int]:
        """Bytes of model states this rank holds in memory (counted from its tensors), by kind."""
        report = {"params": 0, "master": 0, "grads": 0}
        for group in self._groups:
            for key, value in group.state_bytes().items():
                report[key] += value
        stores = self._placement.stores()
        report["optimizer"] = self.optimizer.state_bytes(stores) if self.optimizer is not None else 0
        report["total"] = sum(report.values())
        report["offloaded_nvme"] = sum(s.offloaded_bytes for s in stores)
        return report

    def communicators(self) -> dict[str, Communicator]:
        """The communicators the model states move over, by role ([Note: ZeRO++ and MiCS] in unit.py)."""
        named = {
            "world": self.comm,
            "partition": self._partition,
            "replica": self._links.replica,
            "secondary": self._links.secondary,
        }
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
        self._lifecycle.remove_hooks()
        if self._deferred_gather is not None:
            self._deferred_gather.close(wait=self._broken is None)
        for unit in self._units:
            unit.destroy()
        if self.optimizer is not None:
            self.optimizer.optimizer.state.clear()
            for param_group in self.optimizer.param_groups:
                param_group["params"] = []
        self._units, self._groups, self._param_groups = [], [], {}
        self._placement.destroy()
        for comm in [*self._norm_comms, *reversed(self.communicators().values())]:
            comm.destroy()


def _cast_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating buffers compute in the parameters' dtype, as in DeepSpeed's module.half()/bfloat16()."""
    for buffer in model.buffers():
        if buffer.is_floating_point() and buffer.dtype != dtype:
            buffer.data = buffer.data.to(dtype)
