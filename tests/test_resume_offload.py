"""Resume and reshard with an offloaded optimizer lose nothing.

With `offload_optimizer` the streamed step cuts each flat group's shard into sub-groups, and the
optimizer state is keyed by those pieces; a checkpoint must still hold all of it. Matrix, in one
process group of 2 ranks: offload device (cpu, nvme) x sub_group_size (smaller than every shard
and dividing none, dividing the block shard, equal to the block shard, larger than every shard)
x stage 1-3. Each case trains 3 steps, saves, loads into a fresh engine with other initial
weights, trains 2 more steps: losses and parameters equal, bit for bit, those of a straight run of
5 steps without offload (offload itself is bit-exact, tests/test_offload.py). Reshard: every
checkpoint is then loaded at 1 rank with another sub-group size and saved again there; the
re-saved checkpoint holds, per parameter, the same master weights and optimizer state, bit for
bit. A checkpoint whose optimizer state is missing is an error naming the file.

Block shard at 2 ranks: 6352 elements (12704 at 1 rank); root shard: 1312.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoint_helpers import (
    build_engine,
    checkpoint_states,
    full_params,
    state_difference,
    tiny_batches,
    train_micro_steps,
)
from tests.harness import run_distributed, subtests
from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.files import hash_file

BEFORE, AFTER = 3, 2
SUB_GROUP_SIZES = {
    "smaller, not dividing": 1000,
    "dividing the block shard": 3176,
    "equal to the block shard": 6352,
    "larger": 10**9,
}
DEVICES = ["cpu", "nvme"]
STAGES = [1, 2, 3]


def _engine(stage: int, device: str | None, sub_group_size: int | None, nvme: str, seed: int = 0):
    zero = {}
    if device is not None:
        zero = {"offload_optimizer": {"device": device, "nvme_path": nvme}, "sub_group_size": sub_group_size}
    return build_engine(stage, seed=seed, scheduler=False, zero=zero)


def _case_dir(root: str, stage: int, device: str, size: int) -> str:
    return f"{root}/s{stage}-{device}-{size}"


def _straight(stage: int, nvme: str) -> dict:
    engine = _engine(stage, None, None, nvme)
    out = train_micro_steps(engine, tiny_batches(), 0, BEFORE + AFTER)
    out["params"] = full_params(engine)
    engine.destroy()
    return out


def _resume_worker(rank: int, world: int, *, root: str) -> dict:
    nvme = os.path.join(root, f"nvme-rank{rank}")
    straight = {stage: _straight(stage, nvme) for stage in STAGES}

    def case(stage, device, size):
        engine = _engine(stage, device, size, nvme)
        train_micro_steps(engine, tiny_batches(), 0, BEFORE)
        engine.save_checkpoint(_case_dir(root, stage, device, size), tag="saved")
        engine.destroy()
        resumed = _engine(stage, device, size, nvme, seed=5)  # other weights: all must come from the file
        resumed.load_checkpoint(_case_dir(root, stage, device, size))
        rest = train_micro_steps(resumed, tiny_batches(), BEFORE, AFTER)
        params = full_params(resumed)
        resumed.destroy()
        reference = straight[stage]
        assert rest["losses"] == reference["losses"][BEFORE:], (rest["losses"], reference["losses"][BEFORE:])
        for name, value in reference["params"].items():
            assert torch.equal(params[name], value), f"'{name}' differs by {(params[name] - value).abs().max()}"

    subtests([dict(stage=s, device=d, size=z) for s in STAGES for d in DEVICES for z in SUB_GROUP_SIZES.values()], case)


def _reshard_worker(rank: int, world: int, *, root: str) -> None:
    """At 1 rank: load each 2-rank checkpoint with another sub-group size, save it again, compare."""
    nvme = os.path.join(root, "nvme-one")
    sizes = list(SUB_GROUP_SIZES.values())

    def case(stage, device, size):
        other = sizes[(sizes.index(size) + 1) % len(sizes)]
        engine = _engine(stage, device, other, nvme, seed=5)
        source = _case_dir(root, stage, device, size)
        engine.load_checkpoint(source)
        again = engine.save_checkpoint(f"{source}-at-one", tag="again")
        engine.destroy()
        problem = state_difference(checkpoint_states(again), checkpoint_states(f"{source}/saved"))
        assert problem is None, problem

    subtests([dict(stage=s, device=d, size=z) for s in STAGES for d in DEVICES for z in SUB_GROUP_SIZES.values()], case)


@pytest.mark.slow
def test_offloaded_resume_and_reshard_are_bit_exact(tmp_path):
    root = str(tmp_path)
    run_distributed(_resume_worker, 2, timeout=600, root=root)
    run_distributed(_reshard_worker, 1, timeout=600, root=root)


# ---------------------------------------------------------------- a checkpoint without its state


def _rewrite_manifest(path: Path, change) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def _drop_state_key(path: Path) -> None:
    """A consistent checkpoint (checksums updated) whose rank files lack `exp_avg` of group 0."""

    def drop(manifest):
        for name in list(manifest["files"]):
            if name.startswith("rank_"):
                tensors = load_file(path / name)
                tensors.pop("g0/state/exp_avg")
                save_file(tensors, path / name, metadata={"format": "zeroshard.checkpoint"})
                manifest["files"][name] = hash_file(path / name)

    _rewrite_manifest(path, drop)


def _empty_state_lists(path: Path) -> None:
    """What the defect wrote: every group's state list empty although the optimizer had stepped."""

    def empty(manifest):
        for group in manifest["groups"]:
            group["state"] = []

    _rewrite_manifest(path, empty)


def _missing_state_worker(rank: int, world: int, *, root: str) -> list:
    def case(damage):
        target = Path(root) / damage
        engine = build_engine(2, scheduler=False)
        train_micro_steps(engine, tiny_batches(), 0, 2)
        engine.save_checkpoint(target, tag="t")
        engine.comm.barrier("test: saved")
        if rank == 0:
            {"no state in the manifest": _empty_state_lists, "no exp_avg in the files": _drop_state_key}[damage](
                target / "t"
            )
        engine.comm.barrier("test: damaged")
        fresh = build_engine(2, seed=3, scheduler=False)
        masters = [g.master.clone() for g in fresh.groups]
        with pytest.raises(CheckpointError) as error:
            fresh.load_checkpoint(target)
        assert all(torch.equal(a, g.master) for a, g in zip(masters, fresh.groups)), "nothing loaded"
        # Without the optimizer it loads: the weights alone were asked for.
        fresh.load_checkpoint(target, load_optimizer_states=False)
        fresh.destroy()
        engine.destroy()
        return str(error.value)

    return subtests([dict(damage=d) for d in ("no state in the manifest", "no exp_avg in the files")], case)


def test_missing_optimizer_state_is_an_error_naming_the_file(tmp_path):
    manifest_case, files_case = run_distributed(_missing_state_worker, 2, timeout=300, root=str(tmp_path))[0]
    assert "manifest.json" in manifest_case and "optimizer state" in manifest_case, manifest_case
    assert "rank_0000" in files_case and "exp_avg" in files_case, files_case
