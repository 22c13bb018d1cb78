"""The demo's stage table and the bench's progress count, from canned rows and events (no processes)."""

import logging

from zeroshard.tools.commands import bench as bench_command
from zeroshard.tools.commands.train import stage_cells


def _row(stage: int, states: int, predicted: int, peak_above: int) -> dict:
    return {
        "name": f"stage {stage}",
        "states_measured": {"total": states},
        "states_predicted": {"total": predicted},
        "peak_above_baseline": peak_above,
        "comm_measured": 100,
        "comm_predicted": 100,
        "step_time": {"median_s": 0.5},
    }


def test_stage_table_shows_memory_above_the_process_not_the_process():
    rows = [_row(0, 16_000_000, 16_000_000, 60_000_000), _row(3, 8_000_000, 8_000_000, 50_000_000)]
    rows.append({"name": "DeepSpeed stage 3", "skipped": "not installed"})
    header, stage0, stage3 = stage_cells(rows)
    assert header[1:3] == ["model states/rank meas/pred", "peak above baseline"]
    assert stage0[:3] == ["stage 0", "16.0 MB / 16.0 MB", "60.0 MB"]
    assert stage3[:3] == ["stage 3", "8.0 MB / 8.0 MB", "50.0 MB"]


def test_progress_counts_configurations_not_the_warm_up_launch(caplog):
    bars = bench_command.StepBars(total_runs=2)
    events = [
        {"event": "start", "run": "process warm-up", "total": 2, "warm_up": True},
        {"event": "start", "run": "stage 0", "total": 2, "warm_up": True},  # the machine's warm-up launch
        {"event": "start", "run": "process warm-up", "total": 2},
        {"event": "start", "run": "stage 0", "total": 2},
        {"event": "start", "run": "process warm-up", "total": 2},
        {"event": "start", "run": "stage 3", "total": 2},
    ]
    with caplog.at_level(logging.INFO, logger=bench_command.log.name):
        for event in events:
            bars(event)
        bars.close()
    counted = [r.getMessage() for r in caplog.records if "running" in r.getMessage()]
    assert counted == ["[1/2] running stage 0", "[2/2] running stage 3"]
