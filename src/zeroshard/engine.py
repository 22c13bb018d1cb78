"""The engine: the facade users touch, with DeepSpeed's call shape. Composition only: it wires the
communicator, the units (sharding.py), their lifecycle and the optimizer, and keeps the counters of
gradient accumulation."""
from __future__ import annotations

import contextlib
import logging
import os

import torch
from torch import nn

from .checkpointing import configure_engine as configure_activation_checkpointing
from .comm import Communicator
from .config import warn_not_acted_on
from .lifecycle import Lifecycle, Phase
from .offload import StreamedStep, build_plan, split
from .policy import stage_policy
from .precision import DynamicLossScaler, PrecisionPolicy, cast_floating, check_supported
from .sharding import shard_module
from .zero.partition import register_engine
from .zero_optimizer import ZeroOptimizer, optimizer_group_index, repoint_optimizer

log = logging.getLogger(__name__)


class ZeroEngine(nn.Module):
    """Wraps a model for ZeRO training. Use through `zeroshard.initialize`.

    An `nn.Module` so that `engine(...)`, `engine.train()` and `engine.eval()` read as they do in
    DeepSpeed; the wrapped model is `engine.module`.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config, lr_scheduler=None):
        super().__init__()
        zero = config.zero_optimization
        _warn_knobs_not_acted_on(zero)
        self.config = config
        self.policy = stage_policy(zero.stage)
        extras = config.zeroshard
        self.comm = Communicator(extras.comm_timeout_s, extras.check_collectives)
        self.module = model
        self.precision = PrecisionPolicy.from_config(config)
        check_supported(self.precision.param_dtype, next(model.parameters(), torch.empty(0)).device)
        self.offload = build_plan(zero, config.aio, optimizer, sum(p.numel() for p in model.parameters()),
                                  self.comm.rank, self.comm.world_size)
        _cast_buffers(model, self.precision.param_dtype)
        self.units = shard_module(
            model, self.policy, self.comm, optimizer_groups=optimizer_group_index(optimizer),
            precision=self.precision, offload=self.offload,
            persistence_threshold=int(zero.stage3_param_persistence_threshold),
            wrap_modules=extras.wrap_modules)
        self.groups = [g for unit in self.units for g in unit.groups]
        self._param_groups = {id(p): (u, g) for u in self.units for g in u.groups for p in g.params}
        register_engine(self)  # for zero.GatheredParameters, which gets parameters and no engine
        repoint_optimizer(optimizer, self.groups)
        self.loss_scaler = DynamicLossScaler(config.fp16) if config.fp16.enabled else None
        self.optimizer = ZeroOptimizer(optimizer, self.groups, self.comm, self.policy,
                                       float(config.gradient_clipping or 0.0), self.loss_scaler,
                                       self._streamed_step(optimizer))
        self.lifecycle = Lifecycle(self.units, self.policy, self.comm.rank, self.comm.world_size,
                                   prefetch_numel=int(zero.stage3_prefetch_bucket_size),
                                   overlap_comm=bool(zero.overlap_comm))
        self.lifecycle.register()
        configure_activation_checkpointing(self)
        self.lr_scheduler = lr_scheduler
        self.micro_steps = 0
        self.global_steps = 0
        self._backward_done = False
        log.info("zeroshard engine: stage %d, %d ranks, %d units, %.3fM parameters",
                 self.policy.stage, self.comm.world_size, len(self.units), self.num_parameters() / 1e6)

    def _streamed_step(self, optimizer) -> StreamedStep | None:
        if self.offload.optimizer_store is None:
            return None
        trainable = [g for g in self.groups if g.trainable]
        subs = split(trainable, self.offload.sub_group_size)
        for index, param_group in enumerate(optimizer.param_groups):
            param_group["params"] = [s.param for s in subs if s.group.optimizer_group == index]
        return StreamedStep(optimizer, subs, self.offload.optimizer_store,
                            master_store=self.offload.param_store or None)

    # -- DeepSpeed's accessors ------------------------------------------------------------------------
    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def zero_optimization_stage(self) -> int:
        return self.policy.stage

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def get_global_grad_norm(self) -> float | None:
        return self.optimizer.last_grad_norm

    def get_loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        return self.optimizer.skipped_steps

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    def num_parameters(self) -> int:
        return sum(slot.numel for g in self.groups for slot in g.layout.slots)

    # -- training -------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            args, kwargs = cast_floating((args, kwargs), self.precision.param_dtype)
        self.lifecycle.begin_forward()
        try:
            return self.module(*args, **kwargs)
        finally:
            self.lifecycle.end_forward()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of `loss / gradient_accumulation_steps`, reducing gradients as units finish."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError("engine.backward(loss) needs a scalar loss tensor that requires grad, got "
                             f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        self.lifecycle.begin_backward(self.is_gradient_accumulation_boundary())
        scaled = loss / self.gradient_accumulation_steps()
        if self.loss_scaler is not None:
            scaled = scaled.float() * self.loss_scaler.scale
        try:
            scaled.backward(retain_graph=retain_graph)
        except BaseException:
            self.lifecycle.phase = Phase.IDLE  # no collectives here: peers will time out, not hang
            raise
        self.lifecycle.end_backward()
        self._backward_done = True
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Call after every micro step's backward; the optimizer steps at accumulation boundaries."""
        if not self._backward_done:
            raise RuntimeError(
                f"rank {self.comm.rank}: engine.step() called before engine.backward() (micro step {self.micro_steps}, global "
                f"step {self.global_steps}): call engine.backward(loss) first on every rank")
        self._backward_done = False
        if self.is_gradient_accumulation_boundary():
            applied = self.optimizer.step()
            if applied and self.lr_scheduler is not None:  # DeepSpeed skips it on overflow too
                self.lr_scheduler.step(**(lr_kwargs or {}))
            self.global_steps += 1
        self.micro_steps += 1

    # -- parameters outside forward -------------------------------------------------------------------
    @contextlib.contextmanager
    def gathered_parameters(self, params, modifier_rank: int | None = None):
        """Full parameters inside the block (stage 3 keeps only shards otherwise). With
        `modifier_rank`, that rank's changes are broadcast and re-partitioned on exit."""
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        unknown = [p for p in params if id(p) not in self._param_groups]
        if unknown:
            raise ValueError(f"{len(unknown)} tensor(s) passed to gathered_parameters are not parameters "
                             "of this engine's model")
        wanted = {id(self._param_groups[id(p)][0]) for p in params}
        units = [u for u in self.units if id(u) in wanted]  # engine order: the same on every rank
        for unit in units:
            unit.unshard("gathered parameters")
            unit.wait_unshard()
        try:
            yield
        finally:
            if modifier_rank is not None:
                for unit in units:
                    for group in unit.groups:
                        self.comm.broadcast(group.full, modifier_rank, f"modified parameters of '{unit.name}'")
                        start, end = group.opt_range
                        if not group.master_is_view_of_full():
                            group.master.copy_(group.full[start:end])
            if self.lifecycle.phase is Phase.IDLE:
                for unit in units:
                    unit.reshard()

    # -- checkpoints (checkpoint/ does the work) ------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True):
        from .checkpoint import save_checkpoint

        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state or {},
                               save_latest=save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, **kwargs):
        from .checkpoint import load_checkpoint

        return load_checkpoint(self, load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states, **kwargs)

    def save_16bit_model(self, save_dir, save_filename: str = "model.safetensors"):
        from .checkpoint import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename)

    # -- reports --------------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes of model states this rank holds (counted from its tensors), by kind."""
        report = {"params": 0, "master": 0, "grads": 0}
        for group in self.groups:
            for key, value in group.state_bytes().items():
                report[key] += value
        report["optimizer"] = self.optimizer.state_bytes(self.offload.stores())
        report["total"] = sum(report.values())
        report["offloaded_nvme"] = sum(s.bytes_held for s in self.offload.stores() if s.kind == "nvme")
        return report

    def comm_report(self) -> dict:
        return self.comm.counter.snapshot()

    def destroy(self) -> None:
        """Remove every hook and free every buffer; the module's parameters are released too."""
        self.lifecycle.remove_hooks()
        for unit in self.units:
            unit.destroy()
        self.optimizer.optimizer.state.clear()
        for param_group in self.optimizer.param_groups:
            param_group["params"] = []
        self.units, self.groups, self._param_groups = [], [], {}
        self.offload.destroy()
        self.comm.destroy()


def _warn_knobs_not_acted_on(zero) -> None:
    """Say, once each, which accepted DeepSpeed knobs change nothing here."""
    # Units are the communication granularity (one collective per flat group), so bucket sizes and
    # DeepSpeed's buffer-layout switches have nothing to act on.
    warn_not_acted_on(zero, "reduce_bucket_size", "allgather_bucket_size", "contiguous_gradients",
                      "reduce_scatter", "allgather_partitions", "round_robin_gradients",
                      "stage3_max_live_parameters", "stage3_max_reuse_distance")
    if zero.offload_optimizer is None or zero.offload_optimizer.device == "none":
        warn_not_acted_on(zero, "sub_group_size")  # only the streamed (offloaded) step uses it
    # The stores size themselves (offload/store.py): DeepSpeed's swap-buffer pools have no equivalent,
    # and everything the user chose to offload is offloaded (no partial ratio).
    if zero.offload_optimizer is not None:
        warn_not_acted_on(zero.offload_optimizer, "buffer_count", "ratio", "fast_init")
    if zero.offload_param is not None:
        warn_not_acted_on(zero.offload_param, "buffer_count", "buffer_size", "max_in_cpu")


def _cast_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating buffers compute in the parameters' dtype, as in DeepSpeed's module.half()/bfloat16()."""
    for buffer in model.buffers():
        if buffer.is_floating_point() and buffer.dtype != dtype:
            buffer.data = buffer.data.to(dtype)
