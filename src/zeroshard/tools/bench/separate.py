"""Parent side of `zeroshard bench`: every configuration in launches of its own, one timed and one
measured for memory ([Note: measuring peak memory] in measure.py), merged into one result."""
from __future__ import annotations

import time
from collections.abc import Callable

from zeroshard.tools.bench import peers
from zeroshard.tools.bench.launch import launch
from zeroshard.tools.commands import CommandError

# Steps of a configuration's memory launch after its warm-up: the peak of a step is the same every
# step once the optimizer state is made and the unit orders are recorded.
MEMORY_STEPS = 2


def run_configurations(runs: list[dict], spec: dict, ranks: int, on_progress: Callable[[dict], None],
                       timeout_s: float, threads_per_rank: int | None) -> dict:
    """The worker's result for `runs` as one launch would give it: time, losses and communication from
    a launch with glibc's defaults (what a user's script runs with), memory and state bytes per rank
    from a second launch with its mmap threshold fixed. Peers that are not installed are skipped
    without a launch (the ranks run this interpreter). `timeout_s` bounds the whole."""
    deadline = time.monotonic() + timeout_s
    memory_steps = min(spec["steps"], MEMORY_STEPS)

    def one(run: dict, fixed_mmap_threshold: bool, **changes) -> dict:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommandError(f"--timeout {timeout_s:g} s ran out before the configuration {run['name']!r}")
        return launch("zeroshard.tools.bench.worker", {**spec, **changes, "runs": [run]}, ranks,
                      on_progress=on_progress, timeout_s=left, threads_per_rank=threads_per_rank,
                      fixed_mmap_threshold=fixed_mmap_threshold)

    results, launched = [], None
    for run in runs:
        if run["kind"] != "zeroshard" and not peers.available(run["kind"]):
            results.append({**run, "skipped": peers.unavailable_reason(run["kind"])})
            continue
        timed = one(run, fixed_mmap_threshold=False)
        memory = one(run, fixed_mmap_threshold=True, steps=memory_steps)
        results.append({**timed["runs"][0], "ranks": memory["runs"][0]["ranks"]})
        launched = launched or {**timed, "memory_method": memory["memory_method"]}
    if launched is None:
        raise CommandError("no configuration could run: " + "; ".join(f"{r['name']}: {r['skipped']}" for r in results))
    return {**launched, "spec": {**spec, "memory_steps": memory_steps}, "runs": results}
