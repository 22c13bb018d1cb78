"""Parent side of `zeroshard bench`: every configuration in launches of its own, timed in two halves
(the configurations in order, then in reverse) and measured for memory in a third ([Note: measuring
peak memory] in measure.py), merged into one result.

Why two halves: the configurations run one after another, and this machine's speed drifts by several
percent over the minutes that takes (the same code read 1.04x and 1.11x DDP at stage 0 in two runs
half an hour apart, DDP always timed after zeroshard's stages). Timing each configuration half in a
first pass and half in a reversed second pass puts every configuration, on average, at the middle of
the run, so a drift that is steady over it falls on all of them alike (profile_phases.py's --compare
orders its launches the same way). Before them one throwaway launch of the first configuration warms
the machine: the first launch of a run took 1.1 s for steps its second pass took in 0.7 s (stage 0,
the README's table), after the machine had run other work.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from zeroshard.tools.bench import measure, peers
from zeroshard.tools.bench.launch import launch
from zeroshard.tools.commands import CommandError

# Steps of a configuration's memory launch after its warm-up: the peak of a step is the same every
# step once the optimizer state is made and the unit orders are recorded.
MEMORY_STEPS = 2


def run_configurations(
    runs: list[dict],
    spec: dict,
    ranks: int,
    on_progress: Callable[[dict], None],
    timeout_s: float,
    threads_per_rank: int | None,
    warm_up: bool = True,
) -> dict:
    """The worker's result for `runs` as one launch would give it: time, losses and communication from
    launches with glibc's defaults (what a user's script runs with; the first pass gives the losses
    and communication, both passes the step times), memory and state bytes per rank from a launch
    with its mmap threshold fixed. Peers that are not installed are skipped without a launch (the
    ranks run this interpreter). `timeout_s` bounds the whole. `warm_up=False` leaves out the
    machine's warm-up launch, for a caller that has just kept the machine busy (`zeroshard train`)."""
    deadline = time.monotonic() + timeout_s
    memory_steps = min(spec["steps"], MEMORY_STEPS)
    first_half = (spec["steps"] + 1) // 2
    second_half = spec["steps"] - first_half  # 0 for a single step: one pass

    def one(run: dict, fixed_mmap_threshold: bool, steps: int, progress=on_progress) -> dict:
        """The worker's result for `run` alone."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommandError(f"--timeout {timeout_s:g} s ran out before the configuration {run['name']!r}")
        return launch(
            "zeroshard.tools.bench.worker",
            {**spec, "steps": steps, "runs": [run]},
            ranks,
            on_progress=progress,
            timeout_s=left,
            threads_per_rank=threads_per_rank,
            fixed_mmap_threshold=fixed_mmap_threshold,
        )

    ready = [run for run in runs if run["kind"] == "zeroshard" or peers.available(run["kind"])]
    if not ready:
        raise CommandError(
            "no configuration could run: "
            + "; ".join(f"{run['name']}: {peers.unavailable_reason(run['kind'])}" for run in runs)
        )
    # The machine's warm-up, discarded: a first launch ran up to 1.5x slower (the doc). Its progress is
    # marked, so that a count of configurations leaves it out.
    if warm_up:
        one(ready[0], False, 1, progress=lambda event: on_progress({**event, "warm_up": True}))
    timed, launched = {}, None
    for run in ready:
        launched = one(run, False, first_half)
        timed[run["name"]] = launched["runs"][0]
    assert launched is not None  # `ready` is not empty
    tokens_per_step = spec["batch"] * spec["shape"]["block_size"] * launched["world_size"]
    for run in reversed(ready) if second_half else ():
        merged = timed[run["name"]]
        merged["step_times"] += one(run, False, second_half)["runs"][0]["step_times"]
        merged["step_time"] = measure.step_stats(merged["step_times"])
        merged["tokens_per_s"] = tokens_per_step / merged["step_time"]["median_s"]
    results = []
    for run in runs:
        if run["name"] not in timed:
            results.append({**run, "skipped": peers.unavailable_reason(run["kind"])})
            continue
        memory = one(run, True, memory_steps)
        results.append({**timed[run["name"]], "ranks": memory["runs"][0]["ranks"]})
    return {
        **launched,
        "memory_method": memory["memory_method"],
        "runs": results,
        "spec": {**spec, "memory_steps": memory_steps, "timing_passes": 2 if second_half else 1},
    }
