"""Ranks that diverge fail — every one of them, within a bounded time, with a message naming the
unit or the rank — instead of hanging or silently exchanging wrong tensors. With the collective
check (the debug mode) each rank names the first diverging collective; by default the step's
fingerprint comparison ([Note: collective fingerprint] in core/consistency.py), a local check or
the collective timeout stops them."""

from __future__ import annotations

import time

import pytest
import torch

import zeroshard
from tests.hard_models import LM, VOCAB
from tests.harness import outcome, run_at_once, run_distributed_expect_failure
from tests.zs_common import make_config

COMM_TIMEOUT_S = 8


def _engine(stage: int, check: bool):
    torch.manual_seed(0)
    model = LM()
    config = make_config(stage)
    config["zeroshard"]["comm_timeout_s"] = COMM_TIMEOUT_S
    config["zeroshard"]["check_collectives"] = check
    engine, *_ = zeroshard.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    return engine


def _batch():
    tokens = torch.randint(0, VOCAB, (2, 9))
    return tokens[:, :-1], tokens[:, 1:]


def _train_step(engine, skip_backward=False):
    loss = engine(*_batch())
    if not skip_backward:
        engine.backward(loss)
    engine.step()


def _worker(rank: int, world: int, case: str, stage: int, check: bool = True) -> str:
    engine = _engine(stage, check)
    started = time.monotonic()
    try:
        if case == "unit order":  # rank 1 runs its blocks in another order from the first step on
            if rank == 1:
                engine.module.blocks = torch.nn.ModuleList(reversed(list(engine.module.blocks)))
            _train_step(engine)
        elif case == "order changes later":  # recorded on step 0, rank 1 deviates on step 2
            for step in range(3):
                if step == 2 and rank == 1:
                    blocks = engine.module.blocks
                    blocks[0], blocks[1] = blocks[1], blocks[0]
                _train_step(engine)
        elif case == "skipped backward":
            for step in range(3):
                _train_step(engine, skip_backward=(rank == 1 and step == 1))
        elif case == "rank raises":
            for step in range(3):
                if rank == 1 and step == 1:
                    raise ValueError("user code failed on rank 1")
                _train_step(engine)
        return "no error"
    finally:
        # Report how long the failure took to surface; the harness records the exception.
        elapsed = time.monotonic() - started
        assert elapsed < 3 * COMM_TIMEOUT_S, f"took {elapsed:.1f}s to fail"


CASES = [
    ("unit order", 3),
    ("unit order", 2),
    ("order changes later", 3),
    ("skipped backward", 3),
    ("skipped backward", 1),
    ("rank raises", 3),
]


DEFAULT_CASES = [("unit order", 3), ("order changes later", 3), ("skipped backward", 3), ("rank raises", 3)]


def _timed_run(case: str, stage: int, check: bool):
    started = time.monotonic()
    reports = run_distributed_expect_failure(
        _worker, 2, timeout=6 * COMM_TIMEOUT_S, case=case, stage=stage, check=check
    )
    return reports, time.monotonic() - started


@pytest.fixture(scope="module")
def outcomes():
    """Every case's reports and seconds, the cases run side by side (each on ranks of its own, most
    of their time spent waiting for a failure to surface)."""
    calls = {
        (case, stage, check): (lambda c=case, s=stage, k=check: _timed_run(c, s, k))
        for check, cases in ((True, CASES), (False, DEFAULT_CASES))
        for case, stage in cases
    }
    return run_at_once(calls)


def _reports(outcomes, key):
    reports, elapsed = outcome(outcomes, key)
    assert elapsed < 6 * COMM_TIMEOUT_S, f"{key}: {elapsed:.1f} s"
    return reports


@pytest.mark.parametrize("case,stage", CASES)
@pytest.mark.slow
def test_divergence_fails_every_rank(case, stage, outcomes):
    reports = _reports(outcomes, (case, stage, True))
    for report in reports:
        assert report.reported and not report.ok, f"rank {report.rank} did not fail: {report.describe()}"
        text = report.message
        assert "rank" in text, text
        if report.exc_type == "CollectiveError":
            assert "unit '" in text or "gradient" in text or "parameters" in text, text
    messages = " | ".join(r.message for r in reports)
    if case == "unit order":
        assert "diverged" in messages and "blocks." in messages, messages
    if case == "order changes later":
        assert "blocks.1" in messages and "recorded order" in messages, messages
    if case == "skipped backward":
        assert "before engine.backward()" in messages, messages


@pytest.mark.parametrize("case,stage", DEFAULT_CASES)
@pytest.mark.slow
def test_divergence_fails_every_rank_without_the_check(case, stage, outcomes):
    reports = _reports(outcomes, (case, stage, False))
    for report in reports:
        assert report.reported and not report.ok, f"rank {report.rank} did not fail: {report.describe()}"
        assert "rank" in report.message, report.message
    if case == "unit order":  # blocks of one shape, gathered in swapped order: only the fingerprint sees it
        for report in reports:
            assert report.exc_type == "CollectiveError" and "ranks diverged" in report.message, report.message
