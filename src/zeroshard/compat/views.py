"""What both engines (training, compat/engine.py; inference, compat/inference.py) show of the core
object they wrap, `self.sharded`, read-only, and DeepSpeed's accessors that only read the config and
the process group. One place, so the two engines cannot drift apart."""

from __future__ import annotations

import os


def _core(name: str) -> property:
    return property(lambda self: getattr(self.sharded, name), doc=f"The core's `{name}` (read-only).")


class ShardedViews:
    comm = _core("comm")
    policy = _core("policy")
    precision = _core("precision")
    units = _core("units")
    groups = _core("groups")
    lifecycle = _core("lifecycle")
    placement = _core("placement")

    def zero_optimization_stage(self) -> int:
        return self.policy.stage

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    # -- reports ----------------------------------------------------------------------------------------
    def num_parameters(self) -> int:
        return self.sharded.num_parameters()

    def memory_report(self) -> dict[str, int]:
        """Bytes of model states this rank holds (counted from its tensors), by kind."""
        return self.sharded.memory_report()

    def comm_report(self) -> dict:
        return self.sharded.comm_report()
