"""NVMe swap files do not outlive killed processes ([Note: swap files of dead
processes] in zeroshard/offload/cleanup.py).

  * a rank of a real 2-rank NVMe-offload run is SIGKILLed after a step: its swap files stay; the
    next run on the same path gets their space back, on a simulated disk (free space = capacity
    minus what is allocated under nvme_path) where it would not fit beside them;
  * a live process's directory is never reclaimed by a new store;
  * SIGTERM removes the files, and the process still dies by SIGTERM; a user's own SIGTERM handler
    is left in place and the files are removed on its sys.exit.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import zeroshard
from tests.harness import run_distributed_expect_failure
from tests.reference import gpt_batches
from tests.zs_common import adamw, gpt_model_fn, make_config
from zeroshard.offload import NVMeStore, StoreError
from zeroshard.tools.models.gpt import tiny_gpt_config

SRC = str(Path(zeroshard.__file__).resolve().parent.parent)


def _allocated(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def _killed_worker(rank: int, world: int, *, nvme: str) -> int:
    config = make_config(2)
    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
    model = gpt_model_fn()()
    engine, *_ = zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config=config)
    _, loss = engine(*gpt_batches(tiny_gpt_config(), batch_size=4)(0, 0, rank))
    engine.backward(loss)
    engine.step()
    engine.sharded.wait_parameters()  # the step's all-gathers, in flight until the next forward otherwise
    engine.comm.barrier("stepped")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # no destroy(), no atexit, no handler
    engine.destroy()
    return os.getpid()


def test_sigkilled_rank_leaves_files_the_next_run_reclaims(tmp_path, monkeypatch):
    nvme = tmp_path / "nvme"
    reports = run_distributed_expect_failure(_killed_worker, 2, timeout=120, nvme=str(nvme))
    assert reports[0].ok and not reports[1].reported, [r.describe() for r in reports]
    left = [p for p in nvme.iterdir() if p.name.startswith(f"zeroshard-{reports[1].pid}-rank1")]
    assert len(left) == 1, list(nvme.iterdir())
    stale = _allocated(nvme)
    assert stale > 0, "the killed rank's swap files are still there"

    # A disk that holds one run but not two: free = capacity - what is allocated under nvme_path.
    real = shutil.disk_usage
    capacity = stale + stale // 2
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=capacity - _allocated(nvme)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    store = NVMeStore(nvme, 1, stale)  # the next run's rank 1: needs what the dead one held
    try:
        assert not left[0].exists(), "the dead process's directory was reclaimed"
        assert [p.name for p in nvme.iterdir()] == [store.root.name]
    finally:
        store.destroy()
    assert not list(nvme.iterdir())
    print(f"SIGKILLed rank left {stale} bytes; the next run reclaimed them on a {capacity}-byte disk")


_HOLDER = textwrap.dedent("""
    import signal, sys, time
    sys.path.insert(0, {src!r})
    import torch
    if {user_handler!r}:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(7))
    from zeroshard.offload import NVMeStore
    store = NVMeStore({nvme!r}, 0, 1 << 20, threads=1)
    store.tensor("x", 1000, torch.float32)
    print(store.root, signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, flush=True)
    sys.stdin.readline()  # hold the store until told
""")


def _holder(nvme: Path, user_handler: bool = False) -> tuple[subprocess.Popen, Path]:
    script = _HOLDER.format(src=SRC, nvme=str(nvme), user_handler=user_handler)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    assert line, "the holder process did not start"
    return proc, Path(line[0])


def test_a_live_process_files_are_never_reclaimed(tmp_path):
    nvme = tmp_path / "nvme"
    proc, root = _holder(nvme)
    try:
        store = NVMeStore(nvme, 0, 1000)
        assert root.is_dir() and (root / "x.swp").is_file(), "a live process's files stay"
        store.destroy()
    finally:
        proc.communicate("\n", timeout=60)
    assert proc.returncode == 0 and not root.exists(), "normal exit: removed at exit"


@pytest.mark.parametrize("user_handler", [False, True])
def test_sigterm_removes_the_files(tmp_path, user_handler):
    proc, root = _holder(tmp_path / "nvme", user_handler)
    assert (root / "x.swp").is_file()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    # ours: the process still dies by SIGTERM; the user's handler exits 7 and atexit cleans up
    assert proc.returncode == (7 if user_handler else -signal.SIGTERM), proc.returncode
    assert not root.exists(), f"SIGTERM left {sorted(root.rglob('*'))}"


def test_full_disk_names_the_directories_that_hold_space(tmp_path, monkeypatch):
    nvme = tmp_path / "nvme"
    proc, root = _holder(nvme)
    try:
        real = shutil.disk_usage
        monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
        with pytest.raises(StoreError, match="GB free") as error:
            NVMeStore(nvme, 0, 10**9)
        assert root.name in str(error.value), str(error.value)
    finally:
        proc.communicate("\n", timeout=60)


def test_a_passing_store_counts_as_free_space(tmp_path, monkeypatch):
    """A model built under zero.Init(remote_device="nvme") holds its slices in a passing store, which
    the engine's store may count as free: its files go as the engine takes each parameter."""
    nvme = tmp_path / "nvme"
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    slices = NVMeStore(nvme, 0, 0, passing=True)
    try:
        piece = slices.tensor("zero_init.1", 2**20, torch.float32)  # 4 MiB
        real = shutil.disk_usage
        monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=2**20))
        NVMeStore(nvme, 0, 4 * 2**20).destroy()  # 1 MiB free + 4 MiB passing
        with pytest.raises(StoreError, match=r"GB free \(counting .* of zero.Init's slices") as error:
            NVMeStore(nvme, 0, 6 * 2**20)
        assert slices.root.name not in str(error.value), "the slices' directory listed as holding space"
        slices.drop([piece])  # the engine took it: nothing passes now
        assert slices.empty and not list(slices.root.glob("*.swp"))
        with pytest.raises(StoreError, match="GB free"):
            NVMeStore(nvme, 0, 4 * 2**20)
    finally:
        slices.destroy()
