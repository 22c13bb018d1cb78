"""What the checkpoint package needs from a training object, and nothing more.

`Checkpointable` is satisfied by the DeepSpeed engine (compat/engine.py); anything else that offers
the same can be checkpointed too. Checkpoint code reads and writes model states only through these
names: the communicators (`comm`, and under MiCS `partition` and `replica`), the core's flat groups
and units, the sharded optimizer's per-group state (`group_state` / `load_group_state`, which hide
how an offloaded step cuts a group into sub-groups), the loss scaler, the scheduler, and a
`Counters` view of the step counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Counters:
    global_steps: int  # optimizer steps taken (skipped fp16 steps included, as DeepSpeed counts)
    micro_steps: int  # forward/backward passes taken
    gradient_accumulation_steps: int
    skipped_steps: int  # fp16 steps skipped on overflow
    backward_pending: bool = False  # backward() ran, step() not yet: gradients in flight

    @property
    def mid_accumulation(self) -> bool:
        return self.micro_steps % self.gradient_accumulation_steps != 0


class Checkpointable(Protocol):
    comm: Any  # zeroshard.core.comm.Communicator: every rank the model states are spread over
    # The flat groups' layouts are sliced over `partition` (their `rank` is a partition rank), and
    # `replica` joins the ranks that hold the same shard in the other partition groups: MiCS
    # ([Note: ZeRO++ and MiCS] in core/unit.py). Without MiCS, `partition` is `comm` and `replica`
    # None; a Checkpointable that lacks them is read that way (common.partition_of / replica_of).
    partition: Any
    replica: Any
    groups: list  # zeroshard.core.group.FlatGroup, in unit order
    units: list  # zeroshard.core.unit.Unit
    module: Any  # the wrapped nn.Module
    policy: Any  # zeroshard.core.policy.StagePolicy
    optimizer: Any  # zeroshard.core.optim.optimizer.ZeroOptimizer
    loss_scaler: Any  # DynamicLossScaler or None
    lr_scheduler: Any  # anything with state_dict()/load_state_dict(), or None
    config: Any  # the parsed config: written to the manifest for readers (never read back); its
    # zero_optimization.stage3_gather_16bit_weights_on_model_save decides save_16bit_model at stage 3
    model_parallel: Any  # zeroshard.core.mesh.ModelParallel or None: the tp/pp grid around `comm`
    model_parallel_comms: list  # Communicators over its groups of size > 1 (tp, then pp)

    def counters(self) -> Counters: ...

    def restore_counters(self, counters: Counters) -> None: ...

    def refresh_parameters(self) -> None: ...


class CheckpointableSharded:
    """A `zeroshard.shard()` result as a Checkpointable, for loops that drive the core without an
    engine (a pipeline schedule, examples/pp_zero.py). The loop counts its optimizer steps in
    `global_steps` (one micro step per step: micro-batches inside a step are not checkpoint
    boundaries); a learning-rate scheduler, when given, is saved and restored with it.

        checkpointable = CheckpointableSharded(sharded)
        ... sharded.step(); checkpointable.global_steps += 1
        save_checkpoint(checkpointable, "ckpt")"""

    config = None  # the manifest then records no config

    def __init__(self, sharded, global_steps: int = 0, lr_scheduler=None):
        self.sharded = sharded
        self.global_steps = global_steps
        self.lr_scheduler = lr_scheduler

    # Checkpointable's names -> the Sharded attributes holding them (its parts are private to it).
    _FROM_SHARDED = {
        "comm": "comm",
        "partition": "_partition",
        "groups": "_groups",
        "units": "_units",
        "module": "module",
        "policy": "policy",
        "optimizer": "optimizer",
        "loss_scaler": "loss_scaler",
        "model_parallel": "model_parallel",
    }

    def __getattr__(self, name: str):
        if name in CheckpointableSharded._FROM_SHARDED:
            return getattr(self.sharded, CheckpointableSharded._FROM_SHARDED[name])
        raise AttributeError(name)

    @property
    def replica(self):
        return self.sharded._links.replica

    @property
    def model_parallel_comms(self) -> list:
        return self.sharded._norm_comms

    def counters(self) -> Counters:
        return Counters(self.global_steps, self.global_steps, 1, self.sharded.optimizer.skipped_steps)

    def restore_counters(self, counters: Counters) -> None:
        self.global_steps = counters.global_steps
        self.sharded.optimizer.skipped_steps = counters.skipped_steps

    def refresh_parameters(self) -> None:
        self.sharded.refresh_parameters()
