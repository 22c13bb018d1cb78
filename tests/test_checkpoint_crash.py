"""A rank SIGKILLed in the middle of a save never costs the previous checkpoint.

Three crash points of [Note: atomic publication] (zeroshard/checkpoint/save.py), each in its own
process group, each followed by fresh processes that load what `latest` names:
  1. rank 1 dies half-way through writing its shard of a new tag;
  2. rank 0 dies between renaming the old copy of a tag away and renaming the new one in (a save
     that replaces the tag `latest` names): loading falls back on the old copy;
  3. rank 0 dies after publishing a new tag, before moving `latest`.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from tests.checkpoint_helpers import assert_equal_params, build_engine, full_params, tiny_batches, train_micro_steps
from tests.harness import run_distributed, run_distributed_expect_failure
from zeroshard.checkpoint import save as save_module
from zeroshard.checkpoint.files import SafetensorsWriter


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _dying_shard_write(path, tensors, metadata=None):
    """Write half of the tensors, then die (the file is on disk, incomplete)."""
    writer = SafetensorsWriter(path, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], metadata)
    for index, (name, tensor) in enumerate(tensors.items()):
        if index == len(tensors) // 2:
            writer._file.flush()
            _die()
        writer.write(name, tensor)


def _arm(rank: int, crash: str) -> None:
    """Make this rank die at the crash point (the module is patched inside this rank only)."""
    if crash == "shard" and rank == 1:
        save_module.write_safetensors = _dying_shard_write
    elif crash == "rename" and rank == 0:
        calls, rename = [0], save_module._rename

        def dying_rename(source, target):
            calls[0] += 1
            if calls[0] == 2:  # the old copy is already renamed away
                _die()
            rename(source, target)

        save_module._rename = dying_rename
    elif crash == "latest" and rank == 0:
        write_atomic = save_module.write_atomic

        def dying_write_atomic(path, data):
            if Path(path).name == "latest":
                _die()
            return write_atomic(path, data)

        save_module.write_atomic = dying_write_atomic


def _crash_worker(
    rank: int,
    world: int,
    *,
    root: str,
    load: str | None,
    tag: str,
    step: int,
    crash: str,
    crash_tag: str,
    asynchronous: bool = False,
) -> str:
    """Load the checkpoint `latest` names (it must hold the weights recorded when it was saved),
    train a step, save `tag` cleanly, train a step, then save `crash_tag` and die in it (`asynchronous`:
    in the thread that writes it, while this rank trains on: [Note: asynchronous save])."""
    root = Path(root)
    engine = build_engine(2, seed=5)
    batches = tiny_batches()
    if load is not None:
        _check_loads(engine, root, None, load)
    train_micro_steps(engine, batches, step, 1)
    _record(engine, root, tag)
    engine.save_checkpoint(root, tag=tag)
    train_micro_steps(engine, batches, step + 1, 1)
    if crash_tag != tag:  # re-saving `tag`: its published copy keeps the weights recorded above
        _record(engine, root, crash_tag)
    _arm(rank, crash)
    try:
        engine.save_checkpoint(root, tag=crash_tag, async_save=asynchronous)
        if asynchronous:
            train_micro_steps(engine, batches, step + 2, 1)
            engine.wait_checkpoint()
    except Exception as error:  # noqa: BLE001 - the survivor reports what it saw
        return f"{type(error).__name__}: {error}"
    return "save finished"


def _record(engine, root: Path, tag: str) -> None:
    expected = full_params(engine)
    if engine.global_rank == 0:
        torch.save(expected, root / f"expected-{tag}.pt")
    engine.comm.barrier("expected weights written")


def _check_loads(engine, root: Path, tag: str | None, expected: str) -> None:
    path, _ = engine.load_checkpoint(root, tag=tag)
    assert Path(path).name == expected or Path(path).name.startswith(f".old-{expected}-"), path
    assert_equal_params(full_params(engine), torch.load(root / f"expected-{expected}.pt"), f"loaded {expected}")


def _verify_worker(rank: int, world: int, *, root: str, latest: str, tags: list[str]) -> None:
    engine = build_engine(1, seed=6)
    _check_loads(engine, Path(root), None, latest)
    for tag in tags:
        _check_loads(engine, Path(root), tag, tag)
    engine.destroy()


def _run_crash(root: Path, **kwargs) -> None:
    reports = run_distributed_expect_failure(_crash_worker, 2, timeout=120, root=str(root), **kwargs)
    survivors = [r for r in reports if r.reported]
    assert len(survivors) == 1, [r.describe() for r in reports]
    assert survivors[0].ok, survivors[0].describe()
    assert "Error" in survivors[0].value, f"the survivor's save must fail, not finish: {survivors[0].value}"


@pytest.mark.slow
def test_killed_rank_leaves_the_previous_checkpoint_loadable(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    # 1. rank 1 dies writing its shard of "b": "a" stays latest, "b" never appears.
    _run_crash(root, load=None, tag="a", step=0, crash="shard", crash_tag="b")
    assert (root / "latest").read_text() == "a"
    assert (root / "a").is_dir() and not (root / "b").exists()
    assert list(root.glob(".tmp-b-*")), "the crashed save's staging directory is left behind"

    # 2. "c" is saved, then saved again (same tag) and rank 0 dies between the two renames.
    _run_crash(root, load="a", tag="c", step=2, crash="rename", crash_tag="c")
    assert (root / "latest").read_text() == "c"
    assert not (root / "c").exists() and list(root.glob(".old-c-*"))
    assert not list(root.glob(".tmp-b-*")), "the next save removed the crashed save's staging directory"

    # 3. loading "c" falls back on its old copy; rank 0 dies after publishing "e", before `latest`.
    _run_crash(root, load="c", tag="d", step=4, crash="latest", crash_tag="e")
    assert (root / "latest").read_text() == "d"
    assert (root / "c").is_dir() and not list(root.glob(".old-c-*")), "the next save restored 'c'"
    assert (root / "e" / "manifest.json").is_file()

    # 4. fresh processes: `latest` loads "d"; the published "e" is complete and loads too.
    run_distributed(_verify_worker, 2, timeout=120, root=str(root), latest="d", tags=["e", "a"])


@pytest.mark.slow
def test_a_rank_killed_in_an_asynchronous_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    """The same crash points, met by the writer thread while the ranks train on."""
    root = tmp_path / "ckpt"
    root.mkdir()
    # rank 1 dies writing its shard of "b" in the background: "a" stays latest
    _run_crash(root, load=None, tag="a", step=0, crash="shard", crash_tag="b", asynchronous=True)
    assert (root / "latest").read_text() == "a" and not (root / "b").exists()
    # rank 0 dies after publishing "d", before moving `latest`: "c" stays latest, "d" is whole
    _run_crash(root, load="a", tag="c", step=2, crash="latest", crash_tag="d", asynchronous=True)
    assert (root / "latest").read_text() == "c" and (root / "d" / "manifest.json").is_file()
    run_distributed(_verify_worker, 2, timeout=120, root=str(root), latest="c", tags=["d", "a"])
