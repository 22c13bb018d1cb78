"""The engine: the facade DeepSpeed users touch. A DeepSpeed config becomes policies for the
composable core (`zeroshard.core.sharded.Sharded`), which does all the work; the engine adds
DeepSpeed's accessors, the gradient-accumulation counters, the learning-rate scheduler and
checkpoints."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch
from torch import nn

from zeroshard.checkpoint import load_checkpoint, save_16bit_model, save_checkpoint, save_hf_model
from zeroshard.checkpoint.background import BackgroundSaves
from zeroshard.checkpoint.contract import Counters
from zeroshard.checkpoint.dcp import load_dcp, save_dcp
from zeroshard.checkpoint.pace import SnapshotPace
from zeroshard.checkpoint.snapshot import (
    Recovered,
    default_directory as default_snapshot_directory,
    recover,
    take_snapshot,
)
from zeroshard.compat import policies
from zeroshard.compat.activation_checkpointing import configure_engine as configure_activation_checkpointing
from zeroshard.compat.client_optimizer import ClientOptimizerLink, returns_basic_optimizer
from zeroshard.compat.ds_params import register as register_ds_metadata, unregister as unregister_ds_metadata
from zeroshard.compat.engine_base import EngineBase
from zeroshard.compat.throughput import ThroughputTimer
from zeroshard.compat.ulysses_sp import attach_model, detach
from zeroshard.core.comm import CollectiveError, Communicator
from zeroshard.core.optim.rollback import UpdateFailed
from zeroshard.core.policy import stage_policy
from zeroshard.core.precision import cast_floating
from zeroshard.core.sequence import SequenceParallel
from zeroshard.core.sharded import Sharded
from zeroshard.offload import build_placement

log = logging.getLogger(__name__)


class ZeroEngine(EngineBase):
    """Wraps a model for ZeRO training. Use through `zeroshard.initialize`.

    An `nn.Module` so that `engine(...)`, `engine.train()` and `engine.eval()` read as they do in
    DeepSpeed; the wrapped model is `engine.module`, and attributes the engine does not have are
    looked up on it (`engine.model` of a transformers model, `engine.gradient_checkpointing_enable()`), as
    DeepSpeed's engine forwards them.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config,
        lr_scheduler=None,
        *,
        group=None,
        model_parallel=None,
        sequence=None,
    ):
        """`group`/`model_parallel`: ZeRO's data-parallel group and the tp/pp dimensions around it
        (core/mesh.py), from `initialize(mesh=...)` or `initialize(mpu=...)`; default: the world.
        `sequence`: the sequence-parallel group inside `group` (Ulysses; a transformers model's
        attention is wired to it: compat/ulysses_sp.py)."""
        super().__init__(model, config)
        zero = config.zero_optimization
        extras = config.zeroshard
        comm_policy = policies.communication_policy(zero, extras)
        comm = Communicator(comm_policy.timeout_s, comm_policy.check_collectives, group=group)
        if zero.stage < 3 and zero.offload_param is not None:  # DeepSpeed ignores it below stage 3
            zero = zero.model_copy(update={"offload_param": None})
        if zero.stage == 0 and zero.offload_optimizer is not None:  # and this one at stage 0
            zero = zero.model_copy(update={"offload_optimizer": None})
        placement = build_placement(
            zero,
            config.aio,
            optimizer,
            sum(p.numel() for p in model.parameters()),
            comm.rank,
            comm.world_size,
            model_parallel.coordinate if model_parallel is not None else None,
            nvme_io=extras.nvme_io or "mapped",
        )
        with policies.config_terms():
            self.sharded = Sharded(
                model,
                optimizer,
                comm,
                stage_policy(zero.stage),
                policies.precision_policy(config),
                placement,
                gathering=policies.gather_policy(zero, extras),
                communication=comm_policy,
                model_parallel=model_parallel,
                sequence_parallel=(
                    None
                    if sequence is None
                    else SequenceParallel(
                        Communicator(comm_policy.timeout_s, comm_policy.check_collectives, group=sequence)
                    )
                ),
            )
        if self.sharded.sequence_parallel is not None:
            attach_model(model, self.sharded.sequence_parallel)
        register_ds_metadata(self.sharded)  # ds_id, ds_status, ... at stage 3 (compat/ds_params.py)
        if self.sharded.optimizer is not None:
            self.sharded.set_gradient_clipping(float(config.gradient_clipping or 0.0))
            with policies.config_terms():
                self.sharded.set_loss_scaler(policies.loss_scaler(config))
            self.sharded.set_on_failed_update(extras.transactional_step)
        configure_activation_checkpointing(self)
        self.lr_scheduler = lr_scheduler
        self._backwards_at_step = 0  # sharded.completed_backwards when the last micro step ended
        self.tput_timer = ThroughputTimer(config.train_batch_size)
        self._background_saves = BackgroundSaves()  # [Note: asynchronous save] in checkpoint/background.py
        auto = self.config.zeroshard.snapshot_every_steps == "auto"  # [Note: snapshot pace] in checkpoint/pace.py
        self._pace = SnapshotPace(self.config.zeroshard.snapshot_overhead) if auto else None
        # [Note: the optimizer initialize returns] in compat/client_optimizer.py
        self._client_link = (
            ClientOptimizerLink(optimizer, self.sharded.optimizer)
            if self.sharded.optimizer is not None and returns_basic_optimizer(config)
            else None
        )
        log.info(
            "zeroshard engine: stage %d, %d ranks, %d units, %.3fM parameters",
            self.policy.stage,
            self.comm.world_size,
            len(self.units),
            self.num_parameters() / 1e6,
        )

    # -- the core's parts, read-only (EngineBase has the rest) ------------------------------------------
    @property
    def returned_optimizer(self) -> torch.optim.Optimizer | None:
        """What `initialize` returns as the optimizer: the basic optimizer at stage 0 in fp32, else
        `self.optimizer` ([Note: the optimizer initialize returns] in compat/client_optimizer.py)."""
        return self._client_link.basic if self._client_link is not None else self.optimizer

    # -- DeepSpeed's accessors: compat/engine_base.py; the wrapped model's attributes ------------------
    def __getattr__(self, name: str):
        """nn.Module's lookup (parameters, buffers, submodules), then the wrapped model's attributes."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            return getattr(module, name)

    # -- training -------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            args, kwargs = cast_floating((args, kwargs), self.precision.param_dtype)
        self.tput_timer.start()
        autocast = self.config.torch_autocast  # never a disabled autocast: it would undo the script's own
        context = (
            torch.autocast(self.device.type, dtype=autocast.torch_dtype)
            if autocast.enabled
            else contextlib.nullcontext()
        )
        # A loss.backward() on the outputs ([Note: loss.backward() on the outputs] in core/sharded.py)
        # reduces at the accumulation boundary and divides each gradient by the accumulation steps.
        self.sharded.set_requires_gradient_sync(self._reduce_in_this_backward())
        self.sharded.set_gradient_scale(1.0 / self.gradient_accumulation_steps())
        with context:
            return self.sharded(*args, **kwargs)

    def get_sequence_parallel_group(self):
        """The sequence-parallel process group (Ulysses), or None without sequence parallelism."""
        sequence = self.sharded.sequence_parallel
        return sequence.comm.group if sequence is not None else None

    def _reduce_in_this_backward(self) -> bool:
        return self.is_gradient_accumulation_boundary() and not self._in_no_sync

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of `loss / gradient_accumulation_steps`, reducing gradients as units finish."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError(
                "engine.backward(loss) needs a scalar loss tensor that requires grad, got "
                f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}"
            )
        scaled = loss / self.gradient_accumulation_steps()
        if self.loss_scaler is not None:
            scaled = scaled.float() * self.loss_scaler.scale
        self.sharded.backward(scaled, boundary=self._reduce_in_this_backward(), retain_graph=retain_graph)
        return loss

    @property
    def _backward_done(self) -> bool:
        """Has a backward (engine.backward or loss.backward()) ended since the last micro step?"""
        return self.sharded.completed_backwards > self._backwards_at_step

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Call after every micro step's backward; the optimizer steps at accumulation boundaries."""
        if self._in_no_sync:
            raise RuntimeError("engine.step() inside engine.no_sync(): leave the context first (as in DeepSpeed)")
        if not self._backward_done:
            raise RuntimeError(
                f"rank {self.comm.rank}: engine.step() called before engine.backward() (micro step {self.micro_steps}, global "
                f"step {self.global_steps}): call engine.backward(loss) first on every rank, or loss.backward() on a "
                "loss computed through engine(...) (gradients of a loss computed by calling the model itself stay "
                "in the parameters' .grad, as in torch)"
            )
        self._backwards_at_step = self.sharded.completed_backwards
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            try:
                self._step_applied = self.sharded.step()  # a failure: [Note: failed steps], core/sharded.py
            except (UpdateFailed, CollectiveError) as error:  # they name what to set: in the config's words
                error.args = (policies.in_config_terms(error),)
                raise
            if self._step_applied and self.lr_scheduler is not None:  # DeepSpeed skips it on overflow too
                self.lr_scheduler.step(**(lr_kwargs or {}))
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
        self.tput_timer.stop(global_step=boundary)
        self.micro_steps += 1
        every = self.config.zeroshard.snapshot_every_steps
        if boundary and self._pace is not None:  # once the step is counted whole
            self._pace.step_ended(time.monotonic(), self._background_saves.busy)
            if self._pace.due(self.global_steps):
                self.snapshot()
        elif boundary and every and self.global_steps % every == 0:
            self.snapshot()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients accumulated since the last optimizer step (DeepSpeed's meaning) and
        go back to the start of the accumulation window."""
        self.sharded.zero_grad()
        for param in self.module.parameters():  # gradients that arrived outside this engine's backward
            param.grad = None
        self.micro_steps = self.global_steps * self.gradient_accumulation_steps()
        self._backwards_at_step = self.sharded.completed_backwards

    # -- parameters outside forward -------------------------------------------------------------------
    def gathered_parameters(self, params, modifier_rank: int | None = None):
        """Full parameters inside the block (stage 3 keeps only shards otherwise)."""
        return self.sharded.gathered_parameters(params, modifier_rank)

    def wait_parameters(self) -> None:
        """Stages 1/2: complete the all-gather of updated parameters that step() leaves in flight.
        Call it before reading parameter values between step() and the next forward (an EMA
        update): [Note: reads before the next forward] in core/param_gather.py."""
        self.sharded.wait_parameters()

    # -- checkpoints (checkpoint/ does the work; checkpoint/contract.py says what it reads) ------------
    def counters(self) -> Counters:
        return Counters(
            self.global_steps,
            self.micro_steps,
            self.gradient_accumulation_steps(),
            self.skipped_steps,
            backward_pending=self._backward_done,
        )

    def restore_counters(self, counters: Counters) -> None:
        self.global_steps, self.micro_steps = counters.global_steps, counters.micro_steps
        if self.optimizer is not None:
            self.optimizer.skipped_steps = counters.skipped_steps

    def refresh_parameters(self) -> None:
        self.sharded.refresh_parameters()

    @property
    def model_parallel(self):
        """The tp/pp dimensions around ZeRO's dp group (core/mesh.py ModelParallel), or None."""
        return self.sharded.model_parallel

    @property
    def model_parallel_comms(self) -> list:
        """Communicators over the model-parallel groups of size > 1 (tp, then pp)."""
        return self.sharded._norm_comms

    @property
    def partition(self):
        """The communicator the flat groups are sliced over: a MiCS partition group, else `comm`."""
        return self.sharded._partition

    @property
    def replica(self):
        """MiCS: the ranks holding this rank's shards in the other partition groups; else None."""
        return self.sharded._links.replica

    def save_checkpoint(
        self, save_dir, tag=None, client_state=None, save_latest: bool = True, async_save: bool | None = None
    ):
        """Write a checkpoint (collective). `async_save` (default: the config's
        ``zeroshard.async_checkpoint``): return once the shards are copied to host memory and write the
        files in the background ([Note: asynchronous save] in checkpoint/background.py)."""
        self._background_saves.wait()  # one save at a time; a failed one raises here
        self.sharded.wait_parameters()  # [Note: deferred parameter gather] in core/param_gather.py
        background = self.config.zeroshard.async_checkpoint if async_save is None else async_save
        if not isinstance(background, bool):
            raise TypeError(f"save_checkpoint(async_save=...) takes True, False or None, got {async_save!r}")
        return save_checkpoint(
            self,
            save_dir,
            tag=tag,
            client_state=client_state or {},
            save_latest=save_latest,
            background=self._background_saves if background else None,
        )

    def snapshot(self, async_snapshot: bool = True, client_state=None) -> str:
        """Write a snapshot of this step into host memory, each rank's also on a buddy machine
        (collective; [Note: snapshots on a buddy] in checkpoint/snapshot.py), with every rank's
        random-number generators and `client_state` (the data position, an epoch: what `recover()`
        hands back; rank 0's is kept, as by save_checkpoint). Returns its tag. The config's
        ``zeroshard.snapshot_every_steps`` calls it from step() without client state: the engine's
        counters (global_steps, global_samples) are then the data position. `async_snapshot`:
        return once the rank's shards are copied and let the checkpoint writer's thread send and
        write them while training goes on (the next snapshot, save, load, wait_checkpoint() and
        destroy() wait for it and raise its error); False: all of it before returning."""
        waiting = time.monotonic()
        self._background_saves.wait()
        if self._pace is not None:
            self._pace.previous_written(time.monotonic() - waiting)
        self.sharded.wait_parameters()  # [Note: deferred parameter gather] in core/param_gather.py
        background = self._background_saves if async_snapshot else None
        tag = take_snapshot(
            self, self._snapshot_dir(), self.comm.ranks_per_node, background=background, client_state=client_state
        )
        if self._pace is not None:  # the ranks agree on the interval to the next: [Note: snapshot pace]
            every = max(self.comm.all_gather_objects(self._pace.proposal(), "snapshot pace"))
            if every != self._pace.every:
                log.info(
                    "zeroshard: snapshots every %d steps (the last cost %s over a %s step; budget %g of step time)",
                    every,
                    "n/a" if self._pace.cost is None else f"{self._pace.cost:.3f} s",
                    "n/a" if self._pace.baseline() is None else f"{self._pace.baseline():.3f} s",
                    self._pace.budget,
                )
            self._pace.snapshot_taken(self.global_steps, every)
        return tag

    @property
    def snapshot_every(self) -> int | None:
        """The steps between snapshots: ``zeroshard.snapshot_every_steps``, or with "auto" the
        interval the ranks agreed on at the last snapshot (None before the first, or with snapshots
        off)."""
        if self._pace is not None:
            return self._pace.every
        return self.config.zeroshard.snapshot_every_steps or None

    def recover(self, checkpoint_dir=None) -> Recovered:
        """At start, after a restart: load the newest complete snapshot the surviving machines hold,
        resharded to this world size and stage, or the newest disk checkpoint under `checkpoint_dir`
        where that is newer or no snapshot is complete (collective; a warning says why)."""
        self._background_saves.wait()
        self.sharded.wait_parameters()
        return recover(self, self._snapshot_dir(), self.comm.ranks_per_node, checkpoint_dir)

    def _snapshot_dir(self) -> Path:
        configured = self.config.zeroshard.snapshot_dir
        return Path(configured) if configured is not None else default_snapshot_directory()

    def wait_checkpoint(self) -> str | None:
        """Wait until an asynchronous save is published (no-op without one); raise its error, on every
        rank. Returns the checkpoint directory of the last save, None before the first."""
        return self._background_saves.wait()

    def load_checkpoint(
        self, load_dir, tag=None, load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True, **kwargs
    ):
        self._background_saves.wait()
        self.sharded.wait_parameters()  # [Note: deferred parameter gather] in core/param_gather.py
        return load_checkpoint(
            self,
            load_dir,
            tag=tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            **kwargs,
        )

    def save_16bit_model(self, save_dir, save_filename: str = "model.safetensors"):
        sizes = self.model_parallel.sizes if self.model_parallel is not None else {}
        if sizes.get("tp", 1) * sizes.get("pp", 1) > 1:
            # Each dp group holds another tp slice or pipeline stage: one file from each would
            # overwrite the others'.
            raise ValueError(
                "save_16bit_model under tensor/pipeline parallelism (mesh= or mpu=): save a "
                "checkpoint (engine.save_checkpoint) and consolidate it (`zeroshard consolidate`), "
                "which joins the tp slices and pipeline stages into the full model"
            )
        self.sharded.wait_parameters()
        return save_16bit_model(self, save_dir, save_filename)

    def save_hf_model(self, save_dir, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None) -> str:
        """The full model in Hugging Face's layout (sharded safetensors, their index, the module's
        config.json when it has one), streamed unit by unit at every stage; collective. See
        zeroshard.checkpoint.save_hf_model."""
        self._background_saves.wait()
        self.sharded.wait_parameters()
        return save_hf_model(self, save_dir, max_shard_size=max_shard_size, dtype=dtype)

    def save_dcp(self, directory, model_key: str = "model", optim_key: str = "optim") -> str:
        """The model and optimizer state as a torch.distributed.checkpoint checkpoint that FSDP2 loads
        (`{model_key: model_sd, optim_key: optim_sd}`, as torch's get_state_dict gives them); collective.
        See [Note: DCP checkpoints] in checkpoint/dcp.py."""
        self._background_saves.wait()
        self.sharded.wait_parameters()
        return save_dcp(self, directory, model_key=model_key, optim_key=optim_key)

    def load_dcp(
        self, directory, model_key: str = "model", optim_key: str = "optim", load_optimizer_states: bool = True
    ) -> str:
        """Load a DCP checkpoint FSDP2 wrote (or save_dcp), at any stage and world size; collective."""
        self._background_saves.wait()
        self.sharded.wait_parameters()
        return load_dcp(
            self, directory, model_key=model_key, optim_key=optim_key, load_optimizer_states=load_optimizer_states
        )

    # (num_parameters, memory_report, comm_report: compat/engine_base.py)
    def destroy(self) -> None:
        """Remove every hook and free every buffer; the module's parameters are released too. An
        asynchronous save in flight is finished first (its error raised after the rest is freed)."""
        try:
            self._background_saves.close()
        finally:
            self._destroy()

    def _destroy(self) -> None:
        unregister_ds_metadata(self.sharded)
        detach(self.module)
        if self._client_link is not None:
            self._client_link.remove()
            self._client_link = None
        self.sharded.destroy()


DeepSpeedEngine = ZeroEngine  # DeepSpeed's class name, for isinstance checks in scripts and tests
