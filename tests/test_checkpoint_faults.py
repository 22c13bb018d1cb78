"""Checkpoints under injected faults, as torch's DCP tests do.

One process group of 2 ranks, many sub-cases. An exception is injected at each phase of a save
(synchronous, and asynchronous: [Note: asynchronous save], raised by the next call) and of a load, on rank 0 and on rank 1; a full disk (ENOSPC after part of a shard is written) during a
save; files deleted between save and load (with and without verification); ENOSPC in the NVMe
write-back in the middle of a step. In every case:
  * every rank raises a named error (CheckpointError, or StoreError for the NVMe store) that says
    what failed and on which rank, within a bounded time (well under the collective timeout);
  * `latest` still names the previous checkpoint and it loads, bit for bit;
  * the in-memory training state (masters, optimizer state, counters, scheduler) is unchanged, and
    the save or the load can be retried (the NVMe case: see its test's docstring).
Saves run on `engine` (trained 3 steps); loads run on `probe`, which holds checkpoint "good" and is
made to load "other" (one step later), so a half-done load would show as changed weights.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import shutil
import time
from pathlib import Path

import torch

from tests.checkpoint_helpers import assert_equal_params, build_engine, full_params, tiny_batches, train_micro_steps
from tests.harness import run_distributed, subtests
from zeroshard.checkpoint import CheckpointError, files as files_module, load as load_module, save as save_module
from zeroshard.core.comm import CollectiveError
from zeroshard.offload import StoreError, store as store_module

BOUND_S = 15.0  # the process group's timeout is 30 s (checkpoint_helpers): a hang would exceed this


class Injected(RuntimeError):
    pass


def _raise(*args, **kwargs):
    raise Injected("injected fault")


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@contextlib.contextmanager
def _patched(owner, name, replacement, active: bool):
    original = getattr(owner, name)
    if active:
        setattr(owner, name, replacement(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _after(count: int, fault):
    """A replacement that lets `count` calls through, then faults."""

    def wrap(original):
        calls = [0]

        def patched(*args, **kwargs):
            calls[0] += 1
            if calls[0] > count:
                fault()
            return original(*args, **kwargs)

        return patched

    return wrap


def _named(name: str, fault=_raise):
    """Fault when write_atomic / the writer is asked for the file called `name`."""

    def wrap(original):
        def patched(path, *args, **kwargs):
            if Path(path).name == name:
                fault()
            return original(path, *args, **kwargs)

        return patched

    return wrap


SAVE_FAULTS = {  # phase -> (object, attribute, replacement, ranks it can run on)
    "optimizer state": (None, "group_state", _after(0, _raise), (0, 1)),
    "prepare": (save_module, "_prepare", _after(0, _raise), (0,)),
    "shard file": (save_module, "_write_rank_file", _after(0, _raise), (0, 1)),
    "disk full in a shard": (files_module.SafetensorsWriter, "_emit", _after(2, _full_disk), (0, 1)),
    "objects file": (save_module, "write_atomic", _named("objects.pt"), (0,)),
    "manifest": (save_module, "write_atomic", _named("manifest.json"), (0,)),
    "disk full in the manifest": (save_module, "write_atomic", _named("manifest.json", _full_disk), (0,)),
    "publish": (save_module, "_rename", _after(0, _raise), (0,)),
    "latest": (save_module, "write_atomic", _named("latest"), (0,)),
}
LOAD_FAULTS = {
    "find": (load_module, "find_checkpoint", _after(0, _raise), (0, 1)),
    "verify": (load_module, "check_files", _after(0, _raise), (0, 1)),
    "objects": (load_module, "_read_objects", _after(0, _raise), (0, 1)),
    "half-way through reading": (load_module.CheckpointReader, "read_param", _after(3, _raise), (0, 1)),
}


def _snapshot(engine) -> dict:
    def copied(value):
        return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)

    return {
        "masters": [g.master.detach().clone() for g in engine.groups],
        "optimizer": [
            {k: copied(v) for k, v in engine.optimizer.group_state(g).items()} for g in engine.groups if g.trainable
        ],
        "param_groups": [{k: copied(v) for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups],
        "counters": engine.counters(),
        "scheduler": copy.deepcopy(engine.lr_scheduler.state_dict()) if engine.lr_scheduler else None,
        "params": full_params(engine),
    }


def _differences(a: dict, b: dict) -> list[str]:
    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return isinstance(y, (list, tuple)) and len(x) == len(y) and all(same(p, q) for p, q in zip(x, y))
        return x == y

    return [key for key in a if not same(a[key], b[key])]


def _raised(fn, *args, **kwargs) -> tuple[str, str, float]:
    started = time.monotonic()
    try:
        fn(*args, **kwargs)
    except (CheckpointError, StoreError, CollectiveError) as error:
        return type(error).__name__, str(error), time.monotonic() - started
    raise AssertionError(f"{fn.__name__} did not raise a named error")


def _check_failure(what: str, raised, on_rank: int | None, world: int, expect: str) -> float:
    kind, message, elapsed = raised
    assert elapsed < BOUND_S, f"{what}: the error took {elapsed:.1f} s"
    assert expect in message, f"{what}: {message}"
    if on_rank is not None and world > 1:
        assert f"rank [{on_rank}]" in message or f"rank {on_rank}" in message, f"{what}: {message}"
    return elapsed


def _faults_worker(rank: int, world: int, *, root: str) -> dict:
    root = Path(root)
    engine = build_engine(2)
    batches = tiny_batches()
    train_micro_steps(engine, batches, 0, 2)
    engine.save_checkpoint(root, tag="good")
    good = full_params(engine)
    train_micro_steps(engine, batches, 2, 1)
    engine.save_checkpoint(root, tag="other", save_latest=False)
    probe = build_engine(2, seed=7)
    probe.load_checkpoint(root)
    timings = {}

    def latest_is_good() -> None:
        assert (root / "latest").read_text() == "good"
        path, _ = probe.load_checkpoint(root)
        assert Path(path).name == "good"
        assert_equal_params(full_params(probe), good, "latest after the fault")

    def save_and_wait(asynchronous: bool) -> None:
        engine.save_checkpoint(root, tag="new", async_save=asynchronous)
        engine.wait_checkpoint()  # [Note: asynchronous save]: the thread's error is raised here

    def save_case(phase: str, on_rank: int, asynchronous: bool = False) -> None:
        owner, name, replacement, _ = SAVE_FAULTS[phase]
        owner = engine.optimizer if owner is None else owner
        before = _snapshot(engine)
        with _patched(owner, name, replacement, rank == on_rank):
            raised = _raised(save_and_wait, asynchronous)
        expect = "No space left on device" if "disk full" in phase else "injected fault"
        label = f"{'async ' if asynchronous else ''}save {phase} on rank {on_rank}"
        timings[label] = _check_failure(phase, raised, on_rank, world, expect)
        assert not _differences(before, _snapshot(engine)), f"save {phase}: training state changed"
        assert not list(root.glob(".tmp-*")), f"save {phase}: staging left behind"
        latest_is_good()
        assert engine.save_checkpoint(root, tag="new", save_latest=False) == str(root / "new"), "retry"

    def load_case(phase: str, on_rank: int) -> None:
        owner, name, replacement, _ = LOAD_FAULTS[phase]
        before = _snapshot(probe)
        with _patched(owner, name, replacement, rank == on_rank):
            raised = _raised(probe.load_checkpoint, root, tag="other")
        timings[f"load {phase} on rank {on_rank}"] = _check_failure(phase, raised, on_rank, world, "injected fault")
        assert not _differences(before, _snapshot(probe)), (
            f"load {phase}: a failed load changed {_differences(before, _snapshot(probe))}"
        )
        latest_is_good()

    def deleted_case(name: str, verify: bool) -> None:
        checkpoint = root / "other"
        if rank == 0:
            shutil.copy(checkpoint / name, root / f"saved-{name}")
            (checkpoint / name).unlink()
        engine.comm.barrier("deleted")
        before = _snapshot(probe)
        try:
            raised = _raised(probe.load_checkpoint, root, tag="other", verify=verify)
        finally:
            engine.comm.barrier("loaded")
            if rank == 0:
                shutil.move(root / f"saved-{name}", checkpoint / name)
            engine.comm.barrier("restored")
        expect = "manifest is missing" if name == "manifest.json" else "file is missing"
        timings[f"deleted {name} verify={verify}"] = _check_failure(name, raised, None, world, expect)
        assert str(checkpoint / name) in raised[1], raised[1]
        assert not _differences(before, _snapshot(probe)), f"deleted {name}: a failed load changed the state"
        latest_is_good()

    cases = [dict(kind="save", phase=p, on_rank=r) for p, f in SAVE_FAULTS.items() for r in f[3] if r < world]
    cases += [dict(kind="async save", phase=p, on_rank=r) for p, f in SAVE_FAULTS.items() for r in f[3] if r < world]
    cases += [dict(kind="load", phase=p, on_rank=r) for p, f in LOAD_FAULTS.items() for r in f[3] if r < world]
    cases += [
        dict(kind="deleted", phase=n, on_rank=v)
        for n in ("rank_00001.safetensors", "objects.pt")
        for v in (True, False)
    ] + [dict(kind="deleted", phase="manifest.json", on_rank=True)]
    run = {
        "save": save_case,
        "async save": lambda phase, on_rank: save_case(phase, on_rank, asynchronous=True),
        "load": load_case,
        "deleted": deleted_case,
    }
    subtests(cases, lambda kind, phase, on_rank: run[kind](phase, on_rank))
    probe.destroy()
    engine.destroy()
    return timings


def test_checkpoint_faults_are_named_and_change_nothing(tmp_path):
    timings = run_distributed(_faults_worker, 2, timeout=300, root=str(tmp_path / "ckpt"))
    slowest = max(max(t.values()) for t in timings)
    assert slowest < BOUND_S, slowest
    print(f"faults: {len(timings[0])} cases, slowest error after {slowest:.2f} s")


# ---------------------------------------------------------------- NVMe write-back, mid-step


def _write_back_worker(rank: int, world: int, *, nvme: str, on_rank: int) -> dict:
    engine = build_engine(
        2, scheduler=False, zero={"offload_optimizer": {"device": "nvme", "nvme_path": nvme}, "sub_group_size": 1000}
    )
    engine.sharded.optimizer.on_failed_update = "copy"  # as "zeroshard": {"transactional_step": "copy"} sets it
    batches = tiny_batches()
    train_micro_steps(engine, batches, 0, 1)
    before = _snapshot(engine)
    # the last system call of a write-back fails as a full thin-provisioned disk would (this rank only)
    with _patched(store_module.os, "posix_fadvise", _after(0, _full_disk), rank == on_rank):
        # two micro steps: the healthy rank's step only issues its all-gathers, and its next forward,
        # which waits for them, meets the error ([Note: deferred parameter gather])
        raised = _raised(train_micro_steps, engine, batches, 1, 2)
    kind, message, elapsed = raised
    report = {
        "kind": kind,
        "message": message.splitlines()[0],
        "elapsed": elapsed,
        "changed": _differences(before, _snapshot(engine)),
    }
    engine.destroy()
    return report


def test_full_disk_in_nvme_write_back_is_named(tmp_path):
    """The faulting rank raises StoreError naming the swap file at once; the other rank learns it at
    its next collective wait (CollectiveError; by default its next forward, which waits for the step's
    all-gathers), both well within the collective timeout. With `zeroshard.transactional_step:
    "copy"` ([Note: failed optimizer steps]) the faulting rank's masters and optimizer state are as they were:
    the step is undone although the write-back failed after every sub-group was updated. The other
    rank's step completed, so the ranks are no longer in step: every later call raises."""
    for on_rank in (0, 1):
        reports = run_distributed(
            _write_back_worker, 2, timeout=120, nvme=str(tmp_path / f"nvme{on_rank}"), on_rank=on_rank
        )
        for rank, report in enumerate(reports):
            assert report["elapsed"] < BOUND_S, report
            if rank == on_rank:
                assert report["kind"] == "StoreError", report
                assert not report["changed"], report
                assert "No space left on device" in report["message"] and ".swp" in report["message"], report
            else:
                assert report["kind"] in ("StoreError", "CollectiveError"), report
