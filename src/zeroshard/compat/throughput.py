"""`engine.tput_timer`: DeepSpeed's ThroughputTimer, reduced to what scripts read.

The engine starts it when a forward begins and stops it at every `engine.step()`; an optimizer step
(an accumulation boundary) counts one global step of `batch_size` samples (the global batch).
Timing starts after `start_step` global steps, so the first, slow steps do not count (DeepSpeed's
default: 2). Scripts call `update_epoch_count()` at the end of an epoch and read
`avg_samples_per_sec()`, `total_elapsed_time`, `global_step_count`.
"""

from __future__ import annotations

import time


class ThroughputTimer:
    def __init__(self, batch_size: int, start_step: int = 2, steps_per_output: int | None = None):
        self.batch_size = max(1, int(batch_size))
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self.started = False
        self._start_time = 0.0

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        if not self.started:
            self.started = True
            self._start_time = time.perf_counter()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        elapsed = time.perf_counter() - self._start_time
        if self.global_step_count > self.start_step:
            self.total_elapsed_time += elapsed
            self.step_elapsed_time += elapsed

    def avg_samples_per_sec(self) -> float:
        """Global samples per second over the timed steps (after `start_step`); 0 before any."""
        timed_steps = self.global_step_count - self.start_step
        if timed_steps <= 0 or self.total_elapsed_time <= 0:
            return 0.0
        return self.batch_size * timed_steps / self.total_elapsed_time
