"""How often to snapshot: `snapshot_every_steps: "auto"`.

[Note: snapshot pace]
A snapshot costs the training thread what it blocks for (copying the shards, and waiting for the
previous snapshot if that is still being written) and, while the writer thread sends and writes it,
whatever that takes from the steps beside it (cores, memory bandwidth, the network). Neither is
known before it runs: it depends on the model, the machine and what else runs there. So the
engine measures it. Every optimizer step is timed from the end of one step() to the end of the
next. A step is *quiet* when no snapshot was taken at its start (a snapshot blocks at the end of
step(), so its copy lands in the next step's time) and none was being written when it began; the
baseline is the median of the last QUIET_KEPT quiet steps. A snapshot's cost is the excess over
the baseline of the steps it touched, plus what the next snapshot had to wait for it. With a budget
b (the share of step time snapshots may take, `snapshot_overhead`) the interval to the next
snapshot is the smallest k with cost <= b * k * baseline: snapshots then take about b of the
training time, and a snapshot that cannot be written within k steps lengthens k by itself (the
wait is part of its cost), which is the back-pressure. k errs long rather than short: a step's
excess is counted from zero up, so the noise of the steps a snapshot touches adds to its cost, and
an asynchronous disk checkpoint in flight also makes steps not quiet, its cost counted as the
snapshot's.
The first snapshot is taken after FIRST_AFTER steps (the first step, which creates the optimizer's
states, is not timed) and the second UNMEASURED_EVERY steps later, time for the first to be written
and measured as it would be in the run (a second one at once would wait for the first and measure
two snapshots back to back); each later one sets the interval from the cost of the one before it.
Ranks time their own steps, so each proposes an interval and all take the largest (one small
all-gather at the snapshot, which is collective anyway): every rank snapshots at the same steps.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

FIRST_AFTER = 3  # the engine's steps before the first snapshot: two timed quiet ones, a median
QUIET_KEPT = 16  # quiet steps the baseline's median is taken over
UNMEASURED_EVERY = 8  # from the first snapshot to the second, whose interval the first's cost sets
MAX_EVERY = 10_000  # the longest interval: a bad measurement cannot turn snapshots off


class SnapshotPace:
    """Times optimizer steps and proposes the interval to the next snapshot ([Note: snapshot pace])."""

    def __init__(self, budget: float) -> None:
        if not 0.0 < budget < 1.0:
            raise ValueError(f"zeroshard.snapshot_overhead must be in (0, 1), got {budget!r}")
        self.budget = budget
        self.quiet: deque[float] = deque(maxlen=QUIET_KEPT)
        self.touched: list[float] = []  # durations of the steps the snapshot being measured touched
        self.cost: float | None = None  # seconds, of the last snapshot measured whole
        self.every: int | None = None  # the interval the ranks agreed on at the last snapshot
        self.next_at: int | None = None  # the step count at which the next snapshot is due
        self._last_end: float | None = None
        self._touching = False  # the step now running carries a snapshot's copy or its writing
        self._waited = 0.0  # of the step now running: time spent waiting for the previous snapshot

    def step_ended(self, now: float, writing: bool) -> None:
        """An optimizer step ended at `now` (before any snapshot taken at this step); `writing`: a
        snapshot is still being written."""
        if self._last_end is not None:
            duration = now - self._last_end - self._waited  # the wait is the previous one's cost
            (self.touched if self._touching else self.quiet).append(duration)
        self._last_end, self._waited = now, 0.0
        if self.touched and not writing:
            self._close(0.0)
        self._touching = writing

    def previous_written(self, waited_s: float) -> None:
        """A snapshot is being taken, and the one before it is written: it took `waited_s` of waiting.
        Where that one was written before this step ended, it is measured already."""
        if self.touched:
            self._close(waited_s)
        self._waited = waited_s

    def snapshot_taken(self, steps: int, every: int) -> None:
        """The snapshot at step count `steps` was taken; the ranks agreed on `every` steps to the next."""
        self.every, self.next_at, self._touching = every, steps + every, True

    def due(self, steps: int) -> bool:
        if self.next_at is None:  # counted from this engine's first step, whatever step it resumed at
            self.next_at = steps - 1 + FIRST_AFTER
        return steps >= self.next_at

    def baseline(self) -> float | None:
        return statistics.median(self.quiet) if len(self.quiet) >= 2 else None

    def proposal(self) -> int:
        """This rank's interval from the snapshot being taken to the next."""
        base = self.baseline()
        if self.cost is None or base is None or base <= 0.0:
            return UNMEASURED_EVERY  # nothing measured yet: this one will be, before the next
        return max(1, min(MAX_EVERY, math.ceil(self.cost / (self.budget * base))))

    def _close(self, waited_s: float) -> None:
        base = self.baseline()
        if base is not None:
            self.cost = sum(max(0.0, d - base) for d in self.touched) + waited_s
        self.touched = []
