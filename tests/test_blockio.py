"""The NVMe store's aligned I/O path (offload/blockio.py, offload/swapfile.py).

A tensor staged or frozen-prefetched is read with aligned direct reads into an anonymous buffer moved
in place of its mapping, and written back with aligned direct writes: values survive every round
trip bit for bit (a partial last block included), the tensor's address never changes, the bytes
bypass the page cache and count as anonymous memory (what RLIMIT_DATA bounds), a file system that
refuses O_DIRECT falls back to buffered requests and says so, and an I/O error is a StoreError that
names the file, raised by `ready`, not a hang. The training and inference parity suites
(tests/test_offload.py, tests/test_inference.py) run the same path end to end.
"""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from zeroshard.offload import NVMeStore, StoreError, blockio
from zeroshard.offload.blockio import ALIGN, BlockIOError, IOClock, IOPool, union_s
from zeroshard.offload.swapfile import Home

NUMEL = 3 * 2**20 // 4 + 3  # 3 MiB and 12 bytes of fp32: several requests and a partial last block


@pytest.fixture
def store(tmp_path):
    # Requests of 1 MiB so that one tensor is several requests in flight.
    made = NVMeStore(tmp_path, 0, 10 * 2**20, io=IOPool(depth=4, block_bytes=2**20))
    yield made
    made.destroy()


def _filled(store, key="t", numel=NUMEL):
    tensor = store.tensor(key, numel, torch.float32)
    tensor.copy_(torch.arange(numel, dtype=torch.float32))
    store.release([tensor])
    store.wait()
    return tensor


def _item(store, tensor):
    return store._files[id(tensor)]


def test_round_trip_partial_tail(store):
    tensor = _filled(store)
    address = tensor.data_ptr()
    assert os.path.getsize(_item(store, tensor).path) == -(-NUMEL * 4 // ALIGN) * ALIGN  # whole blocks
    store.stage([tensor])
    store.ready([tensor])
    assert _item(store, tensor).home is Home.BUFFER and tensor.data_ptr() == address
    assert torch.equal(tensor, torch.arange(NUMEL, dtype=torch.float32))  # the tail's 12 bytes too
    tensor[-1] = -1.0
    tensor[:5] += 10
    store.release([tensor])
    store.wait()
    assert _item(store, tensor).home is Home.MAPPING and tensor.data_ptr() == address
    expected = torch.arange(NUMEL, dtype=torch.float32)
    expected[-1], expected[:5] = -1.0, expected[:5] + 10
    assert torch.equal(tensor, expected)  # read back through the mapping: the direct write landed
    with open(_item(store, tensor).path, "rb") as handle:  # and on the file itself
        on_disk = torch.frombuffer(bytearray(handle.read(NUMEL * 4)), dtype=torch.float32)
    assert torch.equal(on_disk, expected)
    clock = store.io.clock.snapshot()
    assert clock["read_bytes"] == clock["write_bytes"] == -(-NUMEL * 4 // ALIGN) * ALIGN
    assert clock["busy_s"] > 0 and store.io_mode == "direct"


def test_buffer_is_anonymous_memory(store):
    """A staged tensor's pages are anonymous (RLIMIT_DATA counts them), not the file's cached pages."""
    tensor = _filled(store, numel=16 * 2**20 // 4)

    def rss(kind):
        status = open("/proc/self/status").read()
        return int(status.split(f"Rss{kind}:")[1].split()[0]) * 1024

    file_before, anon_before = rss("File"), rss("Anon")
    store.stage([tensor])
    store.ready([tensor])
    float(tensor.sum())
    assert rss("Anon") - anon_before >= 15 * 2**20
    assert rss("File") - file_before < 4 * 2**20
    store.release([tensor])
    store.wait()
    assert rss("Anon") - anon_before < 4 * 2**20  # the buffer went with the release


def test_frozen_reads_skip_write_back_and_a_write_faults(store, tmp_path):
    tensor = _filled(store)
    store.freeze([tensor])
    store.prefetch([tensor])
    store.ready([tensor])
    assert _item(store, tensor).home is Home.BUFFER
    written = store.io.clock.snapshot()["write_bytes"]
    store.release([tensor])
    store.wait()
    assert store.io.clock.snapshot()["write_bytes"] == written  # nothing written back
    assert torch.equal(tensor, torch.arange(NUMEL, dtype=torch.float32))
    # Unfreezing a buffer in place makes it writable and written back again.
    store.prefetch([tensor])
    store.freeze([tensor], False)
    tensor[0] = 7.0
    store.release([tensor])
    store.wait()
    assert tensor[0] == 7.0 and store.io.clock.snapshot()["write_bytes"] > written
    # A write to a frozen tensor's buffer is a fault that stops the process, never a lost write.
    script = (
        f"import torch; from zeroshard.offload import NVMeStore\n"
        f"s = NVMeStore({str(tmp_path / 'child')!r}, 0, 2**20); t = s.tensor('w', 1024, torch.float32)\n"
        f"s.release([t]); s.wait(); s.freeze([t]); s.prefetch([t]); s.ready([t]); t[0] = 1.0\n"
        f"print('write went through')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert child.returncode == -11 and "went through" not in child.stdout, (child.returncode, child.stderr[-500:])


def test_fallback_where_open_refuses_o_direct(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(blockio.os, "open", no_direct)
    store = NVMeStore(tmp_path, 0, 10 * 2**20)
    try:
        tensor = _filled(store)
        assert store.io_mode == "buffered"
        store.stage([tensor])
        store.ready([tensor])
        tensor.mul_(2)
        store.release([tensor])
        store.wait()
        assert torch.equal(tensor, 2 * torch.arange(NUMEL, dtype=torch.float32))
    finally:
        store.destroy()


class _FakeLibc:
    """blockio's libc with pread replaced by `pread` (errno through ctypes.set_errno)."""

    def __init__(self, pread):
        self._real, self.pread = blockio._LIBC, pread

    def __getattr__(self, name):
        return getattr(self._real, name)


def test_fallback_where_requests_refuse_o_direct(store, monkeypatch):
    tensor = _filled(store)
    refused = []

    def pread(fd, address, size, offset):
        if _item(store, tensor).direct.mode == "direct":
            refused.append(offset)
            ctypes.set_errno(errno.EINVAL)
            return -1
        return blockio._LIBC._real.pread(fd, address, size, offset)

    monkeypatch.setattr(blockio, "_LIBC", _FakeLibc(pread))
    store.stage([tensor])
    store.ready([tensor])
    assert refused and _item(store, tensor).direct.mode == "buffered"
    assert torch.equal(tensor, torch.arange(NUMEL, dtype=torch.float32))


@pytest.mark.parametrize("failure", ["EIO", "end of file"])
def test_read_error_is_named_not_a_hang(store, monkeypatch, failure):
    tensor = _filled(store)

    def pread(fd, address, size, offset):
        if failure == "EIO":
            ctypes.set_errno(errno.EIO)
            return -1
        return 0

    monkeypatch.setattr(blockio, "_LIBC", _FakeLibc(pread))
    store.stage([tensor])
    outcome = {}

    def wait_ready():
        try:
            store.ready([tensor])
            outcome["error"] = None
        except Exception as error:  # noqa: BLE001 - the test inspects it
            outcome["error"] = error

    waiter = threading.Thread(target=wait_ready, daemon=True)
    waiter.start()
    waiter.join(timeout=30)
    assert "error" in outcome, "ready() hung on a failed read"
    error = outcome["error"]
    assert isinstance(error, StoreError) and isinstance(error, BlockIOError), repr(error)
    assert str(_item(store, tensor).path) in str(error)
    assert ("Input/output error" if failure == "EIO" else "file ends there") in str(error)
    monkeypatch.undo()
    assert _item(store, tensor).home is Home.MAPPING  # the mapping stayed: the tensor is still valid
    assert torch.equal(tensor, torch.arange(NUMEL, dtype=torch.float32))


def test_write_error_is_named(store, monkeypatch):
    tensor = _filled(store)
    store.stage([tensor])
    store.ready([tensor])
    tensor.add_(1)

    class NoSpace(_FakeLibc):
        def pwrite(self, fd, address, size, offset):
            ctypes.set_errno(errno.ENOSPC)
            return -1

    monkeypatch.setattr(blockio, "_LIBC", NoSpace(None))
    store.release([tensor])
    with pytest.raises(StoreError, match="No space left on device") as info:
        store.wait()
    assert str(_item(store, tensor).path) in str(info.value)
    monkeypatch.undo()
    assert _item(store, tensor).home is Home.BUFFER  # the only current copy stays in memory
    assert torch.equal(tensor, torch.arange(NUMEL, dtype=torch.float32) + 1)
    store.release([tensor])
    store.wait()
    assert torch.equal(tensor, torch.arange(NUMEL, dtype=torch.float32) + 1)


def test_bad_arguments_are_named(tmp_path):
    for depth in (0, -1, True, 2.0):
        with pytest.raises(StoreError, match="depth must be a positive integer") as info:
            IOPool(depth=depth)
        assert repr(depth) in str(info.value)
    for block in (1000, ALIGN + 1, 0, "4096"):
        with pytest.raises(StoreError, match=f"multiple of {ALIGN} bytes") as info:
            IOPool(block_bytes=block)
        assert repr(block) in str(info.value)
    path = tmp_path / "f"
    path.write_bytes(b"\0" * ALIGN)
    pool = IOPool(depth=1)
    try:
        with pytest.raises(BlockIOError, match="not 4096-byte aligned"):
            blockio.DirectFile(path, pool).read_into(ALIGN + 8, ALIGN)
    finally:
        pool.shutdown()


def test_clock_counts_overlapping_requests_once():
    clock = IOClock(keep_spans=True)

    def request():
        with clock.request("read", 10):
            time.sleep(0.2)

    threads = [threading.Thread(target=request) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    snapshot = clock.snapshot()
    assert snapshot["read_bytes"] == 40
    assert 0.2 <= snapshot["read_busy_s"] < 0.6 and snapshot["busy_s"] == snapshot["read_busy_s"]
    assert len(clock.spans) == 1 and abs(union_s(clock.spans) - snapshot["busy_s"]) < 1e-9
    assert union_s([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
    assert union_s([(0, 2), (1, 3), (5, 6)], start=1.5, end=5.5) == 2


def test_nvme_io_setting(tmp_path):
    """`zeroshard.nvme_io` chooses the path; a bad value names the key, the value and the choices."""
    from zeroshard.config.parse import ConfigError, load_config
    from zeroshard.offload import build_placement

    with pytest.raises(ConfigError, match="nvme_io") as info:
        load_config({"zeroshard": {"nvme_io": "fast"}}, 1)
    assert "'fast'" in str(info.value) and "direct" in str(info.value) and "buffered" in str(info.value)
    with pytest.raises(
        StoreError, match=r"zeroshard.nvme_io must be one of \['direct', 'buffered', 'mapped'\], got 'fast'"
    ):
        IOPool(mode="fast")
    config = load_config(
        {
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}},
            "zeroshard": {"nvme_io": "buffered"},
        },
        1,
    )
    plan = build_placement(config.zero_optimization, config.aio, None, 1000, 0, 1, nvme_io=config.zeroshard.nvme_io)
    try:
        tensor = _filled(plan.param_store)
        assert plan.param_store.io_mode == "buffered"
        plan.param_store.stage([tensor])
        plan.param_store.ready([tensor])
        tensor.neg_()
        plan.param_store.release([tensor])
        plan.param_store.wait()
        assert torch.equal(tensor, -torch.arange(NUMEL, dtype=torch.float32))
    finally:
        plan.destroy()


def test_mapped_setting_keeps_the_mapping(tmp_path):
    """nvme_io "mapped" (training's default): stage and frozen prefetch read through the mapping."""
    store = NVMeStore(tmp_path, 0, 10 * 2**20, io=IOPool(mode="mapped"))
    try:
        tensor = _filled(store)
        store.stage([tensor])
        store.ready([tensor])
        assert _item(store, tensor).home is Home.MAPPING and store.io_mode == "mapped"
        tensor.add_(3)
        store.release([tensor])
        store.freeze([tensor])
        store.prefetch([tensor])
        store.ready([tensor])
        assert _item(store, tensor).home is Home.MAPPING
        store.release([tensor])
        store.wait()
        assert torch.equal(tensor, torch.arange(NUMEL, dtype=torch.float32) + 3)
        assert store.io.clock.snapshot()["read_bytes"] > 0  # the mapping's read-ahead is timed too
    finally:
        store.destroy()
