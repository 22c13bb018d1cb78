"""In-memory snapshots on a buddy machine, and recovery from them without the disk ([Note: snapshots on
a buddy] in checkpoint/snapshot.py).

Kept ranks play machines: 4 ranks are 2 machines of 2 (LOCAL_WORLD_SIZE=2), and each machine's
snapshot directory (its /dev/shm) is a directory of its own. Losing machine 1 is deleting its
directory; the survivors are a 2-rank group on machine 0's directory. The oracle: after recovering
the snapshot of step s at 2 ranks, training goes on with the losses and parameters of a 2-rank run
that resumed the disk checkpoint of the same step, bit for bit. The data is a function of the global
sample index (tests/elastic_job.py), so the global batch is the same at every world size.
"""

from __future__ import annotations

import filecmp
import logging
import math
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import zeroshard
from tests.checkpoint_helpers import full_params
from tests.elastic_job import MICRO, micro_batch
from tests.harness import run_distributed
from tests.reference import gpt_loss
from tests.zs_common import adamw, gpt_model_fn
from zeroshard.checkpoint import snapshot
from zeroshard.checkpoint.manifest import rank_file
from zeroshard.checkpoint.pace import SnapshotPace
from zeroshard.core.comm import Communicator

BATCH = 8  # train_batch_size: 1 micro step per rank at 4 ranks, 2 at 2 ranks


def _engine(stage: int, snapshots: Path | None, every: int | str = 0, **zeroshard_keys):
    config = {
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "zeroshard": {
            "snapshot_every_steps": every,
            "snapshot_dir": None if snapshots is None else str(snapshots),
            **zeroshard_keys,
        },
    }
    model = gpt_model_fn()()
    engine, *_ = zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config=config)
    return engine


def _engine_on_machines(ranks_per_machine: int, stage: int, snapshots: Path, every: int = 0):
    """_engine with the ranks grouped into machines of `ranks_per_machine`: LOCAL_WORLD_SIZE is read
    when the communicator is made, and removed after, since a kept rank runs other cases."""
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_machine)
    try:
        return _engine(stage, snapshots, every)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


def _train(engine, first: int, count: int) -> list[float]:
    rank, world, gas = engine.global_rank, engine.world_size, engine.gradient_accumulation_steps()
    losses = []
    for step in range(first, first + count):
        for micro in range(gas):
            loss = gpt_loss(engine, *micro_batch(step, micro, rank, world, BATCH))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _machine(root: str, rank: int) -> Path:
    return Path(root) / f"machine{rank // 2}"


def _four_ranks_snapshot(rank: int, world: int, root: str, disk: str) -> None:
    """2 machines x 2 ranks, stage 3: a snapshot every 2 steps (steps 2 and 4, one kept), a disk
    checkpoint at step 4; machine 0 ends up with its own ranks' files and machine 1's."""
    engine = _engine_on_machines(2, 3, _machine(root, rank), every=2)
    assert engine.comm.ranks_per_node == 2
    _train(engine, 0, 4)
    engine.save_checkpoint(disk)
    _train(engine, 4, 1)  # step 5: no snapshot
    engine.save_checkpoint(f"{disk}-5")
    engine.destroy()
    mine = _machine(root, rank)
    # the newest only, nothing half-written; snapshot2's files kept for the next one to write over
    assert sorted(p.name for p in mine.iterdir()) == [".spare", "snapshot4"]
    held = sorted(p.name for p in (mine / "snapshot4").glob("rank_*"))
    assert held == [rank_file(r) for r in range(4)], held  # its own, and the other machine's


def _recovers_at_2_ranks(rank: int, world: int, root: str, disk: str, stage: int, replacement: bool = False) -> None:
    """Machine 1 is gone: the survivors recover snapshot4 at 2 ranks (another stage too) and train
    on exactly as the run that loaded the disk checkpoint of step 4; at stage 1 they go on taking a
    snapshot every step, each after the last micro step of its 2 (gradient accumulation).
    `replacement`: the 2 ranks are 2 machines of one rank, machine 0 and a new, empty one, to which
    recovery sends every file of the snapshot before loading it."""
    every = 1 if stage == 1 else 0
    if replacement:
        home = _machine(root, 0) if rank == 0 else Path(root) / "replacement"
        recovered = _engine_on_machines(1, stage, home, every)
    else:
        recovered = _engine(stage, _machine(root, rank), every)
    result = recovered.recover(checkpoint_dir=disk)
    assert (result.source, result.step, result.reason) == ("snapshot", 4, None), result
    if replacement:
        _assert_same_files(Path(root) / "replacement" / "snapshot4", _machine(root, 0) / "snapshot4")
    assert recovered.global_steps == 4 and recovered.gradient_accumulation_steps() == 2
    losses = _train(recovered, 4, 3)
    if stage == 1:
        recovered.wait_checkpoint()
        assert sorted(p.name for p in _machine(root, rank).iterdir()) == [".spare", "snapshot7"]
    params = full_params(recovered)
    recovered.destroy()
    from_disk = _engine(stage, None)
    from_disk.load_checkpoint(disk)
    assert _train(from_disk, 4, 3) == losses
    theirs = full_params(from_disk)
    assert all(torch.equal(theirs[name], value) for name, value in params.items())
    from_disk.destroy()
    if stage == 3 and not replacement:
        _keeps_client_state_and_generators(rank, root)


def _writes_over_the_replaced_snapshot(rank: int, world: int, root: str) -> None:
    """[Note: snapshot files written over]: the snapshot a new one replaces is kept as the spare, whose
    files the next snapshot writes over, a rank's own and the one its buddy sends alike; the snapshot
    written over them recovers the run's parameters."""
    engine = _engine_on_machines(2, 3, _machine(root, rank), every=1)
    mine, listed, inodes = _machine(root, rank), [], []
    for step in range(3):
        _train(engine, step, 1)
        engine.wait_checkpoint()
        engine.comm.barrier("snapshot published")  # by the first rank of each machine
        listed.append(sorted(p.name for p in mine.iterdir()))
        inodes.append({p.name: p.stat().st_ino for p in mine.glob(f"snapshot{step + 1}/rank_*")})
    assert listed == [["snapshot1"], [".spare", "snapshot2"], [".spare", "snapshot3"]], listed
    assert len(inodes[0]) == 4 and inodes[2] == inodes[0], inodes  # own and buddy's files: snapshot1's
    params = full_params(engine)
    engine.destroy()
    again = _engine_on_machines(2, 3, mine)
    assert again.recover().step == 3
    recovered = full_params(again)
    again.destroy()
    assert all(torch.equal(recovered[name], value) for name, value in params.items())


def _assert_same_files(copy: Path, original: Path) -> None:
    """`copy` holds the files of `original`, no more, no fewer, byte for byte."""
    names = sorted(p.name for p in original.iterdir())
    assert sorted(p.name for p in copy.iterdir()) == names
    assert all(filecmp.cmp(copy / n, original / n, shallow=False) for n in names)


def _fills_every_machine(rank: int, world: int, root: str) -> None:
    comm = Communicator(timeout_s=60)
    home = Path(root) / f"machine{rank}"
    inventories = comm.all_gather_objects(snapshot._inventory(home), "snapshot inventories")
    snapshot._fill(comm, home, "snapshot4", inventories, ranks_per_machine=1)
    comm.destroy()


def _keeps_client_state_and_generators(rank: int, root: str) -> None:
    """A snapshot taken by hand carries the caller's client state and every rank's random-number
    generators: recovering it hands the one back and puts the other where they were."""
    engine = _engine(3, _machine(root, rank))
    engine.recover()
    _train(engine, 4, 1)
    tag = engine.snapshot(async_snapshot=False, client_state={"next_sample": 32, "epoch": 1})
    following = (torch.rand(4), random.random())  # what the generators give after the snapshot
    engine.destroy()
    again = _engine(1, _machine(root, rank))  # builds a model: the generators move on
    result = again.recover()
    assert (result.source, result.path.endswith(tag), result.step) == ("snapshot", True, 5), result
    assert result.client_state == {"next_sample": 32, "epoch": 1}
    assert torch.equal(torch.rand(4), following[0]) and random.random() == following[1]
    again.destroy()


def _falls_back(rank: int, world: int, root: str, disk: str, case: str) -> None:
    """Where no complete snapshot survives, or the disk checkpoint is newer, the disk checkpoint is
    loaded and the reason logged; with neither, nothing is loaded and nothing pretends otherwise."""
    engine = _engine(3, _machine(root, rank))
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("zeroshard.checkpoint.snapshot").addHandler(handler)
    try:
        result = engine.recover(checkpoint_dir=disk if case != "nothing" else None)
    finally:
        logging.getLogger("zeroshard.checkpoint.snapshot").removeHandler(handler)
    expected = {
        "buddies lost": ("checkpoint", f"snapshot4 is incomplete: no survivor holds {rank_file(2)}"),
        "older": ("checkpoint", "snapshot4 is older than the disk checkpoint of step 5"),
        "nothing": ("nothing", "no snapshot on any surviving machine"),
    }[case]
    assert result.source == expected[0] and expected[1] in result.reason, result
    assert any(expected[1] in m for m in messages), messages
    assert engine.global_steps == (5 if case == "older" else 4 if case == "buddies lost" else 0)
    engine.destroy()


@pytest.mark.slow
def test_a_lost_machine_is_recovered_from_its_buddys_snapshot(tmp_path):
    root, disk = str(tmp_path / "shm"), str(tmp_path / "disk")
    run_distributed(_four_ranks_snapshot, 4, timeout=300, root=root, disk=disk)
    run_distributed(_writes_over_the_replaced_snapshot, 4, timeout=300, root=str(tmp_path / "over"))
    shutil.rmtree(_machine(root, 2))  # machine 1 is lost, with its host memory
    saved = tmp_path / "machine0-before"
    shutil.copytree(_machine(root, 0), saved)
    for stage in (3, 1):
        shutil.rmtree(_machine(root, 0))
        shutil.copytree(saved, _machine(root, 0))
        run_distributed(_recovers_at_2_ranks, 2, timeout=300, root=root, disk=disk, stage=stage)
    # Machine 1 replaced by an empty one: machine 0 fills it.
    shutil.rmtree(_machine(root, 0))
    shutil.copytree(saved, _machine(root, 0))
    run_distributed(_recovers_at_2_ranks, 2, timeout=300, root=root, disk=disk, stage=3, replacement=True)
    # Three machines of one rank, each lacking other rank files: the fill sends from several holders
    # to several machines at once, and every machine ends with the whole snapshot, byte for byte.
    holding = [[0, 1], [2], [3, 0]]
    for machine, ranks in enumerate(holding):
        partial = tmp_path / "partial" / f"machine{machine}" / "snapshot4"
        shutil.copytree(
            saved / "snapshot4", partial, ignore=lambda _, names: [n for n in names if n.startswith("rank_")]
        )
        for r in ranks:
            shutil.copy(saved / "snapshot4" / rank_file(r), partial / rank_file(r))
    run_distributed(_fills_every_machine, 3, timeout=300, root=str(tmp_path / "partial"))
    for machine in range(3):
        _assert_same_files(tmp_path / "partial" / f"machine{machine}" / "snapshot4", saved / "snapshot4")
    # Bad cases, each from machine 0's snapshot as it was.
    shutil.rmtree(_machine(root, 0))
    shutil.copytree(saved, _machine(root, 0))
    (_machine(root, 0) / "snapshot4" / rank_file(2)).unlink()  # rank 2 and its buddy's copy lost
    run_distributed(_falls_back, 2, timeout=300, root=root, disk=disk, case="buddies lost")
    shutil.rmtree(_machine(root, 0))
    shutil.copytree(saved, _machine(root, 0))
    run_distributed(_falls_back, 2, timeout=300, root=root, disk=f"{disk}-5", case="older")
    shutil.rmtree(_machine(root, 0))  # both machines' memory lost
    run_distributed(_falls_back, 2, timeout=300, root=root, disk=disk, case="nothing")


def test_take_snapshot_refuses_a_world_that_is_not_whole_machines():
    class Engine:
        comm = type("Comm", (), {"world_size": 3})()

        def counters(self):
            return type("C", (), {"backward_pending": False, "mid_accumulation": False})()

    with pytest.raises(zeroshard.checkpoint.CheckpointError, match="3 ranks are not machines of 2"):
        snapshot.take_snapshot(Engine(), "/nonexistent", ranks_per_machine=2)


def test_the_newest_complete_snapshot_is_chosen_and_incomplete_ones_named():
    inventories = [
        {"snapshot6": {"step": 6, "world": 2, "files": [rank_file(0), "objects.pt", "manifest.json"]}},
        {"snapshot4": {"step": 4, "world": 2, "files": [rank_file(0), rank_file(1), "objects.pt", "manifest.json"]}},
    ]
    tag, reason = snapshot._choose(inventories)
    assert tag == "snapshot4" and f"snapshot6 is incomplete: no survivor holds {rank_file(1)}" in reason
    assert snapshot._choose([{}, {}]) == (None, "no snapshot on any surviving machine")
    assert snapshot.buddy_of(1, 4, 2) == 3 and snapshot.buddy_of(3, 4, 2) == 1


def test_a_snapshot_of_the_same_step_is_replaced_without_a_moment_of_neither(tmp_path, monkeypatch):
    """Publishing over a snapshot of the same step sets the old one aside first: a crash before the
    new one takes its name leaves the old one whole, and recovery's inventory renames it back. Once
    the new one is in place, the old one is the spare."""

    def staged(text: str) -> Path:
        staging = tmp_path / f".partial-snapshot5-{text}"
        staging.mkdir()
        (staging / "manifest.json").write_text(text)
        return staging

    snapshot._publish(tmp_path, staged("first"), "snapshot5", keep=1)
    renames = []
    real_rename = Path.rename

    def crash_at_the_second_rename(self, target):
        renames.append(self.name)
        if len(renames) == 2:
            raise OSError("the process died here")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", crash_at_the_second_rename)
    with pytest.raises(OSError, match="died"):
        snapshot._publish(tmp_path, staged("second"), "snapshot5", keep=1)
    monkeypatch.undo()
    assert renames == ["snapshot5", ".partial-snapshot5-second"] and not (tmp_path / "snapshot5").exists()
    snapshot._restore_set_aside(tmp_path)
    assert (tmp_path / "snapshot5" / "manifest.json").read_text() == "first"
    snapshot._publish(tmp_path, tmp_path / ".partial-snapshot5-second", "snapshot5", keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".spare", "snapshot5"]
    assert (tmp_path / "snapshot5" / "manifest.json").read_text() == "second"
    # The one it replaced is the spare the next snapshot writes over: [Note: snapshot files written over]
    assert (tmp_path / ".spare" / "manifest.json").read_text() == "first"
    snapshot._publish(tmp_path, staged("third"), "snapshot5", keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".spare", "snapshot5"]
    assert (tmp_path / ".spare" / "manifest.json").read_text() == "second"


def test_auto_pace_snapshots_as_often_as_the_budget_allows():
    """[Note: snapshot pace], on a clock the test sets: steps of 1 s, a snapshot that blocks 0.5 s
    and slows the next step by 0.2 s while it is written. The first is taken after 3 steps, the
    second 8 later (nothing measured yet), and each interval then follows from what the snapshot
    before it cost: its copy, its writing beside the steps, and any wait for it."""
    pace, clock, taken, steps = SnapshotPace(0.03), [0.0], [], [0]

    def step(duration: float, writing: bool, waited: float = 0.0) -> None:
        clock[0] += duration
        steps[0] += 1
        pace.step_ended(clock[0], writing)
        if pace.due(steps[0]):
            pace.previous_written(waited)
            every = pace.proposal()
            pace.snapshot_taken(steps[0], every)
            taken.append((steps[0], every))

    for _ in range(3):
        step(1.0, writing=False)  # the third is due; nothing measured, so the next comes 8 later
    assert taken == [(3, 8)] and pace.cost is None
    step(1.0 + 0.5, writing=True)  # the copy at the end of step 3 lands in step 4's time
    step(1.0 + 0.2, writing=False)  # slowed by the writer, which then finishes
    assert pace.cost == pytest.approx(0.5 + 0.2) and pace.baseline() == 1.0
    while steps[0] < 10:
        step(1.0, writing=False)
    step(1.0, writing=True)  # step 11 ends; the snapshot due now waits 0.3 s for nothing: measured
    assert taken[-1] == (11, 24) and 0.7 / (24 * 1.0) <= 0.03  # the smallest k within 3% of step time
    # A snapshot still being written when the next is due: the wait is its cost, and k grows.
    pace, clock, taken, steps = SnapshotPace(0.03), [0.0], [], [0]
    for _ in range(3):
        step(1.0, writing=False)
    for _ in range(7):
        step(1.5, writing=True)  # a writer slower than 8 steps
    step(1.5, writing=True, waited=4.0)  # the snapshot due at step 11 waits 4 s for the first
    assert pace.cost == pytest.approx(8 * 0.5 + 4.0) and taken[-1] == (11, math.ceil(8.0 / 0.03))
    with pytest.raises(ValueError, match="snapshot_overhead must be in"):
        SnapshotPace(1.0)


def _paces_itself(rank: int, world: int, root: str) -> dict:
    engine = _engine(2, Path(root), "auto", snapshot_overhead=0.5)
    if rank == 1:  # this rank's steps look slower: every rank takes the longer interval it proposes
        engine._pace.proposal = lambda: 12
    _train(engine, 0, 15)
    engine.wait_checkpoint()
    seen = {"every": engine.snapshot_every, "measured": engine._pace.cost is not None}
    seen["snapshots"] = sorted(p.name for p in Path(root).iterdir())
    engine.destroy()
    return seen


def test_auto_snapshots_are_taken_at_the_same_steps_on_every_rank(tmp_path):
    seen = run_distributed(_paces_itself, 2, timeout=300, root=str(tmp_path / "shm"))
    assert seen[0]["every"] == seen[1]["every"] >= 12, seen  # agreed at step 3: the next at step 15
    assert all(s["snapshots"] == [".spare", "snapshot15"] for s in seen), seen
    assert seen[0]["measured"], seen  # rank 0 measured what its snapshot of step 3 cost


@pytest.fixture
def tmpfs(tmp_path):
    """A tmpfs of its own (host memory that can run out, as /dev/shm can), unmounted afterwards."""
    where = tmp_path / "shm"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"needs root to mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def _first_snapshot(rank: int, world: int, root: str) -> None:
    engine = _engine(3, Path(root))
    _train(engine, 0, 1)
    engine.snapshot(async_snapshot=False)
    engine.destroy()


def _memory_runs_out(rank: int, world: int, root: str) -> None:
    """The machine's snapshot memory holds one snapshot, not two: the next fails on every rank with an
    error that names the snapshot and the cause, and the one before stays whole and recoverable."""
    engine = _engine(3, Path(root))
    assert engine.recover().step == 1
    _train(engine, 1, 1)
    with pytest.raises(zeroshard.checkpoint.CheckpointError) as failed:
        engine.snapshot(async_snapshot=False)
    message = str(failed.value)
    assert (
        message.startswith("snapshot snapshot2: ")
        and f"No space left on device (host memory: {root} is full" in message
    )
    engine.destroy()
    assert sorted(p.name for p in Path(root).iterdir() if not p.name.startswith(".")) == ["snapshot1"]
    again = _engine(3, Path(root))
    result = again.recover()
    assert (result.source, result.step, result.reason) == ("snapshot", 1, None), result
    again.destroy()


def test_full_host_memory_fails_the_snapshot_and_keeps_the_previous_one(tmpfs):
    run_distributed(_first_snapshot, 2, timeout=300, root=str(tmpfs))
    usage = os.statvfs(tmpfs)
    used = (usage.f_blocks - usage.f_bfree) * usage.f_frsize  # one snapshot, in pages
    subprocess.run(["mount", "-o", f"remount,size={used * 3 // 2}", str(tmpfs)], check=True)
    run_distributed(_memory_runs_out, 2, timeout=300, root=str(tmpfs))


def test_a_file_arrives_into_its_place_or_not_at_all(tmpfs):
    """[Note: receiving into the file]: the bytes land in a mapping of a temporary file that is renamed
    to the file's name once they match the sender's record; a mismatch or a full tmpfs leaves no file
    and no temporary behind, and a full tmpfs still gives the exchange a buffer of the right size."""
    from zeroshard.checkpoint.files import record_of

    data = torch.arange(3_000_000, dtype=torch.int32).view(torch.uint8)
    target = tmpfs / "snapshot4" / rank_file(1)
    with snapshot._Arrival(target, data.numel()) as arrival:
        assert arrival.error is None and not target.exists()
        arrival.tensor.copy_(data)  # what the exchange does
        assert arrival.finish(record_of(data.numpy().data), "rank 1's file") is None
    assert target.read_bytes() == data.numpy().tobytes() and os.listdir(target.parent) == [target.name]
    # A reader of the file already there (a directory two ranks share) keeps the bytes it opened.
    with open(target, "rb") as reader, snapshot._Arrival(target, 4) as again:
        again.tensor.copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
        assert again.finish(record_of(b"\x01\x02\x03\x04"), "rank 1's file") is None
        assert reader.read(4) == data.numpy().tobytes()[:4]
    assert target.read_bytes() == b"\x01\x02\x03\x04"
    wrong = snapshot._Arrival(tmpfs / "snapshot4" / rank_file(2), 4)
    with wrong:
        error = wrong.finish(record_of(b"\x00\x00\x00\x01"), "snapshot file rank 2 arrived from its rank")
    assert error == "snapshot file rank 2 arrived from its rank with another checksum than it was sent with"
    assert os.listdir(target.parent) == [target.name]
    too_big = 80 * 2**20  # the tmpfs holds 64 MiB
    with snapshot._Arrival(tmpfs / "snapshot4" / rank_file(3), too_big) as full:
        assert full.tensor.numel() == too_big and "No space left on device (host memory:" in full.error
        assert full.finish(record_of(b""), "rank 3's file") == full.error
    assert os.listdir(target.parent) == [target.name]


@pytest.mark.parametrize("spare_bytes", [0, 1_000, 9_000])
def test_a_spare_file_written_over_keeps_only_the_new_bytes(tmp_path, spare_bytes):
    """[Note: snapshot files written over]: a rank's own file and an arriving one take the spare's
    file of their name, shorter, longer or the same size, and end as the new bytes alone; the spare
    file is gone, moved, and without a spare the files are made anew."""
    from zeroshard.checkpoint.files import SafetensorsReader, record_of

    spare = tmp_path / snapshot.SPARE
    spare.mkdir()
    staging = tmp_path / ".partial-snapshot2-x"
    tensors = {"a": torch.arange(700, dtype=torch.float32), "b": torch.ones(3, 5)}
    for name in (rank_file(0), rank_file(1)):
        if spare_bytes:
            (spare / name).write_bytes(b"\xff" * spare_bytes)
    record = snapshot._write_own(tmp_path, staging, rank_file(0), tensors, {"rank": "0"})
    own = staging / rank_file(0)
    header = int.from_bytes(own.read_bytes()[:8], "little")
    assert own.stat().st_size == record["bytes"] == 8 + header + 4 * (700 + 15)
    with SafetensorsReader(own) as reader:
        assert torch.equal(reader.read("a").view(700), tensors["a"])
        assert torch.equal(reader.read("b").view(3, 5), tensors["b"])
    data = torch.arange(3_000, dtype=torch.int16).view(torch.uint8)  # 6,000 bytes
    with snapshot._Arrival(staging / rank_file(1), data.numel(), spare / rank_file(1)) as arrival:
        arrival.tensor.copy_(data)
        assert arrival.finish(record_of(data.numpy().data), "rank 1's file") is None
    assert (staging / rank_file(1)).read_bytes() == data.numpy().tobytes()
    assert os.listdir(spare) == [] and sorted(os.listdir(staging)) == [rank_file(0), rank_file(1)]
