"""[Note: asynchronous save] (zeroshard/checkpoint/background.py): `save_checkpoint(async_save=True)`
returns once the shards are staged; the checkpoint it publishes holds what a synchronous save at the
same moment holds, although training changed every master while the thread wrote; a failure in the
thread is raised at the next call on every rank, naming the rank; `latest` moves only once the
checkpoint is whole. Fault injection and kills on the asynchronous path: tests/test_checkpoint_faults.py
and tests/test_checkpoint_crash.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint_helpers import (
    assert_equal_params,
    build_engine,
    checkpoint_states,
    full_params,
    state_difference,
    tiny_batches,
    train_micro_steps,
)
from tests.harness import run_distributed, subtests
from zeroshard.checkpoint import CheckpointError, save as save_module


def _equal_case(root: Path, stage: int, gas: int) -> None:
    """Mid-run (and mid-accumulation with gas 2), the asynchronous save equals the synchronous one."""
    engine = build_engine(stage, gas=gas)
    batches = tiny_batches()
    train_micro_steps(engine, batches, 0, 3)
    engine.save_checkpoint(root / f"sync-{stage}-{gas}", tag="t")
    path = engine.save_checkpoint(root / f"async-{stage}-{gas}", tag="t", async_save=True)
    train_micro_steps(engine, batches, 3, 2 * gas)  # changes every master while the thread writes
    assert engine.wait_checkpoint() == path
    assert (Path(path).parent / "latest").read_text() == "t"
    difference = state_difference(
        checkpoint_states(root / f"async-{stage}-{gas}"), checkpoint_states(root / f"sync-{stage}-{gas}")
    )
    assert difference is None, (stage, gas, difference)
    engine.destroy()


def _config_and_order_case(root: Path) -> None:
    """The config key turns it on; a second save waits for the first; destroy() finishes one in flight."""
    engine = build_engine(1, extras={"async_checkpoint": True})
    batches = tiny_batches()
    train_micro_steps(engine, batches, 0, 1)
    first = engine.save_checkpoint(root / "order", tag="a")
    train_micro_steps(engine, batches, 1, 1)
    second = engine.save_checkpoint(root / "order", tag="b")  # waits for "a" first
    assert Path(first).is_dir()
    expected = full_params(engine)
    train_micro_steps(engine, batches, 2, 1)
    engine.destroy()  # finishes "b"
    assert (Path(second).parent / "latest").read_text() == "b"
    probe = build_engine(1, seed=5)
    probe.load_checkpoint(root / "order")
    assert_equal_params(full_params(probe), expected, "the last asynchronous save, published by destroy()")
    probe.destroy()


def _failure_case(root: Path, rank: int, on_rank: int) -> None:
    """A shard write that fails in the thread: the call returned, the next call raises on every rank,
    naming the rank; `latest` still names the good checkpoint; the same save can be retried."""
    engine = build_engine(3)
    batches = tiny_batches()
    train_micro_steps(engine, batches, 0, 1)
    engine.save_checkpoint(root / f"fail{on_rank}", tag="good")
    original = save_module.write_safetensors

    def full_disk(path, *args, **kwargs):
        if Path(path).name.startswith("rank_"):
            raise OSError(28, "No space left on device")
        return original(path, *args, **kwargs)

    if rank == on_rank:
        save_module.write_safetensors = full_disk
    try:
        engine.save_checkpoint(root / f"fail{on_rank}", tag="bad", async_save=True)  # returns: the write is later
        train_micro_steps(engine, batches, 1, 1)
        with pytest.raises(
            CheckpointError,
            match=rf"asynchronous save .*bad failed: .*failed on rank \[{on_rank}\]: writing .*rank_0000{on_rank}.safetensors: .*No space",
        ):
            engine.wait_checkpoint()
    finally:
        save_module.write_safetensors = original
    assert (root / f"fail{on_rank}" / "latest").read_text() == "good"
    assert not list((root / f"fail{on_rank}").glob(".tmp-*"))
    engine.save_checkpoint(root / f"fail{on_rank}", tag="bad", async_save=True)  # the retry publishes
    assert engine.wait_checkpoint() == str(root / f"fail{on_rank}" / "bad")
    engine.destroy()


def _worker(rank: int, world: int, root: str) -> None:
    root = Path(root)
    subtests([dict(stage=s, gas=g) for s in (1, 3) for g in (1, 2)], lambda stage, gas: _equal_case(root, stage, gas))
    _config_and_order_case(root)
    subtests([dict(on_rank=r) for r in range(world)], lambda on_rank: _failure_case(root, rank, on_rank))


def test_asynchronous_saves_equal_synchronous_ones_and_report_failures_at_the_next_call(tmp_path):
    run_distributed(_worker, 2, timeout=300, root=str(tmp_path))
