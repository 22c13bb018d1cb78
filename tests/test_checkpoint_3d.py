"""Checkpoints across layouts ([Note: checkpoints across layouts] in checkpoint/layout.py).

Phase 1, four gloo ranks: dp2 x tp2 (DTensor, through the engine) and dp2 x pp2 (a GPipe schedule
over `zeroshard.shard`) at stages 1-3 train 3 steps, save, train 3 more and save again; the run
that never stopped. Also checkpoints before any step, dp2 x tp2 both ways (DTensor, Megatron-style).
Phase 2, two gloo ranks: dp1 x tp2 and dp1 x pp2 load the step-3 checkpoints and train the same 3
steps: the losses, and (read back from both final checkpoints) every master weight and Adam moment,
equal the uninterrupted run's bit for bit. dp 2 -> 1 keeps the math exact: one rank takes the two dp
ranks' batches as two accumulation micro-batches (x/2 + y/2 = (x + y)/2 in floating point), and no
clipping (a norm summed in another grouping differs in the last bit). There too: tp 2 -> 1 and
pp 2 -> 1 through the consolidated state dict, bit for bit, and the refusals of a direct load.
And 1 -> tp 2 / pp 2: the full weights load into each layout, each rank taking its slices.
In the parent: consolidation of dp2 x tp2 before any step equals the single-process model's
state dict bit for bit, and the zero_to_fp32 compat reads it too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import zeroshard
from tests import mesh_models as mm
from tests.harness import grid, run_distributed, subtests
from tests.tp_helpers import Mpu, dtensor_model, megatron_model
from zeroshard.checkpoint import CheckpointError, consolidate, load_checkpoint, load_full_weights, save_checkpoint
from zeroshard.checkpoint.contract import CheckpointableSharded
from zeroshard.checkpoint.manifest import FORMAT_VERSION, read_manifest
from zeroshard.checkpoint.reader import CheckpointReader
from zeroshard.compat.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from zeroshard.core.mesh import from_mpu

STAGES = [1, 2, 3]
SAVED_AT, STEPS = 3, 6


_MESHES: dict = {}


def _mesh(dp: int, other: str):
    """One DeviceMesh per shape for all sub-cases of a rank (each builds process groups)."""
    if (dp, other) not in _MESHES:
        _MESHES[(dp, other)] = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", other))
    return _MESHES[(dp, other)]


def _config(stage: int, gas: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": mm.BATCH,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage},
        "zeroshard": {"comm_timeout_s": 120},
    }


def _batch(step: int, dp_rank: int, micro: int, dp: int):
    """The batch that dp rank `dp_rank` of a dp-`dp` run takes as micro-batch `micro`: at dp 1 the
    micro-batches are the dp-2 run's ranks."""
    return mm.batches(step, 0, micro if dp == 1 else dp_rank)


# ---------------------------------------------------------------- tensor parallelism (engine)


def _tp_engine(mesh, stage: int):
    model = dtensor_model(mesh)
    gas = 2 // mesh["dp"].size()
    engine, *_ = zeroshard.initialize(
        model=model, optimizer=mm.adamw(model.parameters()), mesh=mesh, config=_config(stage, gas)
    )
    return engine


def _tp_steps(engine, mesh, first: int, last: int) -> list[list[float]]:
    dp, dp_rank, gas = mesh["dp"].size(), mesh.get_local_rank("dp"), engine.gradient_accumulation_steps()
    losses = []
    for step in range(first, last):
        row = []
        for micro in range(gas):
            loss = mm.mse(engine, *_batch(step, dp_rank, micro, dp))
            engine.backward(loss)
            engine.step()
            row.append(loss.item())
        losses.append(row)
    return losses


def _full_params(engine) -> dict:
    module = engine.module
    with engine.gathered_parameters(list(module.parameters())):
        return {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()
        }


# ---------------------------------------------------------------- pipeline parallelism (core)


def _pp_stage(mesh, stage: int):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe  # not at collection (tests/pp_helpers.py)

    pp_rank, stages = mesh.get_local_rank("pp"), mesh["pp"].size()
    part = mm.Part(mm.model_fn()(), pp_rank, stages)
    sharded = zeroshard.shard(
        part,
        mm.adamw(part.parameters()),
        stage=stage,
        mesh=mesh,
        communication=zeroshard.CommunicationPolicy(timeout_s=120),
    )
    pipe = PipelineStage(
        part, pp_rank, stages, torch.device("cpu"), group=mesh.get_group("pp"), input_args=torch.empty(mm.BATCH, mm.D)
    )
    micro = 2 // mesh["dp"].size()
    loss_fn = lambda out, y: F.mse_loss(out, y) / micro  # noqa: E731 - scale_grads=False: zeroshard's accumulation
    return CheckpointableSharded(sharded), ScheduleGPipe(pipe, n_microbatches=micro, loss_fn=loss_fn, scale_grads=False)


def _pp_steps(state, schedule, mesh, first: int, last: int) -> list[list[float]]:
    dp, dp_rank, pp_rank = mesh["dp"].size(), mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    micro = 2 // dp
    losses = []
    for step in range(first, last):
        pairs = [_batch(step, dp_rank, m, dp) for m in range(micro)]
        out: list[torch.Tensor] = []
        with state.sharded.backward_by_caller():
            if pp_rank == 0:
                schedule.step(torch.cat([x for x, _ in pairs]))
            else:
                schedule.step(target=torch.cat([y for _, y in pairs]), losses=out)
        state.sharded.step()
        state.global_steps += 1
        losses.append([float(loss.detach()) * micro for loss in out])
    return losses


# ---------------------------------------------------------------- phase 1: four ranks


def _phase1_case(root: str, layout: str, stage: int) -> dict:
    dims = ("dp", layout)
    mesh = _mesh(2, layout)
    where = f"{root}/{layout}{stage}"
    if layout == "tp":
        engine = _tp_engine(mesh, stage)
        losses = _tp_steps(engine, mesh, 0, SAVED_AT)
        engine.save_checkpoint(where, tag="resume")
        at_save = _full_params(engine)
        losses += _tp_steps(engine, mesh, SAVED_AT, STEPS)
        engine.save_checkpoint(where, tag="final")
        engine.destroy()
    else:
        state, schedule = _pp_stage(mesh, stage)
        losses = _pp_steps(state, schedule, mesh, 0, SAVED_AT)
        save_checkpoint(state, where, tag="resume")
        module = state.sharded.module
        with state.sharded.gathered_parameters(list(module.parameters())):
            at_save = {n: p.detach().clone() for n, p in module.named_parameters()}
        losses += _pp_steps(state, schedule, mesh, SAVED_AT, STEPS)
        save_checkpoint(state, where, tag="final")
        state.sharded.destroy()
    return {"losses": losses, "at_save": at_save, "coordinate": {d: mesh.get_local_rank(d) for d in dims}}


def _save_untrained(root: str, style: str) -> None:
    """dp2 x tp2 before any step: DTensor through the engine, Megatron-style (`partition_dim` set
    as Megatron sets it, or not) through the core with an mpu."""
    mesh = _mesh(2, "tp")
    if style == "dtensor":
        engine = _tp_engine(mesh, 3)
        engine.save_checkpoint(f"{root}/untrained_dtensor", tag="t")
        engine.destroy()
        return
    model = megatron_model(mesh)
    if style == "megatron":
        for block in model.blocks:
            block.up.weight.partition_dim = block.up.bias.partition_dim = 0
            block.down.weight.partition_dim = 1
    sharded = zeroshard.shard(
        model,
        mm.adamw(model.parameters()),
        stage=2,
        mesh=from_mpu(Mpu(mesh), model),
        communication=zeroshard.CommunicationPolicy(timeout_s=120),
    )
    save_checkpoint(CheckpointableSharded(sharded), f"{root}/untrained_{style}", tag="t")
    sharded.destroy()


def _failed_save_case(root: str) -> None:
    """One rank of the grid (dp 1, tp 1) cannot write its shard: every rank raises, naming it by its
    coordinate, and nothing is published."""
    from zeroshard.checkpoint import save as save_module

    mesh = _mesh(2, "tp")
    engine = _tp_engine(mesh, 2)
    original = save_module._write_rank_file

    def failing(*args, **kwargs):
        if (mesh.get_local_rank("dp"), mesh.get_local_rank("tp")) == (1, 1):
            raise OSError(28, "No space left on device")
        return original(*args, **kwargs)

    save_module._write_rank_file = failing
    try:
        with pytest.raises(CheckpointError, match=r"failed on rank \(dp 1, tp 1\): OSError: .*No space left"):
            engine.save_checkpoint(f"{root}/failed", tag="never")
    finally:
        save_module._write_rank_file = original
        engine.destroy()
    assert not list(Path(f"{root}/failed").iterdir()), "nothing published, the staging directory removed"


def _phase1(rank, world_size, root):
    cases = grid(layout=["tp", "pp"], stage=STAGES)
    results = subtests(cases, lambda layout, stage: _phase1_case(root, layout, stage))
    subtests(grid(style=["dtensor", "megatron", "megatron_unnamed"]), lambda style: _save_untrained(root, style))
    _failed_save_case(root)
    return {f"{c['layout']}{c['stage']}": r for c, r in zip(cases, results)}


# ---------------------------------------------------------------- phase 2: two ranks


def _phase2_case(root: str, layout: str, stage: int, expected: dict) -> None:
    """dp1 x <layout>2 resumes at step 3: the same losses as the run that never stopped."""
    mesh = _mesh(1, layout)
    where, me = f"{root}/{layout}{stage}", mesh.get_local_rank(layout)
    if layout == "tp":
        engine = _tp_engine(mesh, stage)
        engine.load_checkpoint(where, tag="resume")
        assert engine.global_steps == SAVED_AT
        losses = _tp_steps(engine, mesh, SAVED_AT, STEPS)
        engine.save_checkpoint(where, tag="resumed")
        engine.destroy()
    else:
        state, schedule = _pp_stage(mesh, stage)
        load_checkpoint(state, where, tag="resume")
        assert state.global_steps == SAVED_AT
        losses = _pp_steps(state, schedule, mesh, SAVED_AT, STEPS)
        save_checkpoint(state, where, tag="resumed")
        state.sharded.destroy()
    # the four-rank run's losses: dp rank d's loss of step s is micro-batch d of step s here
    if layout == "tp" or me == 1:  # the pipeline's losses are on its last stage
        never_stopped = [[expected[(d, me)]["losses"][s][0] for d in (0, 1)] for s in range(SAVED_AT, STEPS)]
        assert losses == never_stopped, f"{layout} stage {stage}: resumed losses {losses} != {never_stopped}"


def _consolidated_case(root: str, layout: str, expected: dict) -> None:
    """<layout> 2 -> 1 through the full state dict: dp2 (no tp/pp) loads the consolidated step-3
    checkpoint; its parameters equal the four-rank run's at the save, bit for bit."""
    full = f"{root}/{layout}1_full.safetensors"
    if torch.distributed.get_rank() == 0:
        consolidate(f"{root}/{layout}1", full, tag="resume", progress=False)
    torch.distributed.barrier()
    model = mm.model_fn()()
    engine, *_ = zeroshard.initialize(model=model, optimizer=mm.adamw(model.parameters()), config=_config(1, 1))
    load_full_weights(engine, full)
    ours = _full_params(engine)
    engine.destroy()
    saved = {}
    for value in expected.values():
        saved.update(value["at_save"])
    assert ours.keys() == saved.keys()
    for name, value in ours.items():
        assert torch.equal(value, saved[name]), f"{layout} 2 -> 1: {name} differs after the consolidated load"


def _into_layout_case(root: str, layout: str, expected: dict) -> None:
    """1 -> <layout> 2 through the full state dict: dp1 x <layout>2 takes the consolidated file (each
    tp rank its slices, each stage its parameters); the gathered parameters equal the saved ones."""
    mesh = _mesh(1, layout)
    full = f"{root}/{layout}1_full.safetensors"  # written by _consolidated_case
    if layout == "tp":
        engine = _tp_engine(mesh, 3)
        load_full_weights(engine, full)
        ours = _full_params(engine)
        engine.destroy()
    else:
        state, _ = _pp_stage(mesh, 3)
        load_full_weights(state, full)
        module = state.sharded.module
        with state.sharded.gathered_parameters(list(module.parameters())):
            ours = {n: p.detach().clone() for n, p in module.named_parameters()}
        state.sharded.destroy()
    saved = {}
    for value in expected.values():
        saved.update(value["at_save"])
    assert ours and all(torch.equal(value, saved[name]) for name, value in ours.items()), f"1 -> {layout} 2"


def _refusal_case(root: str) -> None:
    """A direct load at another tp or pp names the file and both layouts."""
    mesh = _mesh(1, "tp")
    engine = _tp_engine(mesh, 1)
    with pytest.raises(CheckpointError) as refused:
        engine.load_checkpoint(f"{root}/pp1", tag="resume")
    message = str(refused.value)
    assert f"{root}/pp1/resume/manifest.json" in message, message
    assert "saved at dp 2 x tp 1 x pp 2" in message and "this run is dp 1 x tp 2 x pp 1" in message, message
    engine.destroy()
    model = mm.model_fn()()
    plain, *_ = zeroshard.initialize(model=model, optimizer=mm.adamw(model.parameters()), config=_config(1, 1))
    with pytest.raises(CheckpointError, match=r"saved at dp 2 x tp 2 x pp 1, but this run is dp 2 x tp 1 x pp 1"):
        plain.load_checkpoint(f"{root}/tp1", tag="resume")
    plain.destroy()


def _phase2(rank, world_size, root, expected):
    subtests(
        grid(layout=["tp", "pp"], stage=STAGES),
        lambda layout, stage: _phase2_case(root, layout, stage, expected[f"{layout}{stage}"]),
    )
    subtests(grid(layout=["tp", "pp"]), lambda layout: _consolidated_case(root, layout, expected[f"{layout}1"]))
    subtests(grid(layout=["tp", "pp"]), lambda layout: _into_layout_case(root, layout, expected[f"{layout}1"]))
    _refusal_case(root)


# ---------------------------------------------------------------- the test


def _states(path) -> dict:
    """Every part's masters and Adam moments, whole per parameter: {(part, name, key): tensor}."""
    out = {}
    top = read_manifest(path)
    for part in top["parts"]:
        manifest = read_manifest(path / part["dir"])
        with CheckpointReader(path / part["dir"], manifest) as reader:
            for group in manifest["groups"]:
                for param in group["params"]:
                    for key in ("master", "exp_avg", "exp_avg_sq"):
                        value = torch.empty(param["numel"])
                        reader.read_param(param["name"], key, 0, param["numel"], value)
                        out[(part["dir"], param["name"], key)] = value
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt3d")
    per_rank = run_distributed(_phase1, 4, timeout=600, root=str(root))
    expected = {}
    for values in per_rank:
        for case, result in values.items():
            expected.setdefault(case, {})[tuple(result["coordinate"].values())] = result
    return root, expected


def test_manifest_records_mesh_and_every_shard_coordinate(saved):
    root, _ = saved
    top = json.loads((root / "tp2" / "resume" / "manifest.json").read_text())
    assert top["format_version"] == FORMAT_VERSION and top["mesh"] == {"dp": 2, "tp": 2, "pp": 1}
    assert [(p["tp"], p["pp"]) for p in top["parts"]] == [(0, 0), (1, 0)]
    assert top["shards"]["tp01_pp00/rank_00001.safetensors"] == {"dp": 1, "tp": 1, "pp": 0}
    part = read_manifest(root / "tp2" / "resume" / "tp01_pp00")
    splits = {p["name"]: p["tp_split_dim"] for g in part["groups"] for p in g["params"]}
    assert splits["blocks.0.up.weight"] == 0 and splits["blocks.0.down.weight"] == 1
    assert splits["blocks.0.down.bias"] is None and splits["blocks.0.norm.weight"] is None


def test_resume_at_another_dp_is_exact(saved):
    """dp2 -> dp1 at the same tp / pp, stages 1-3: losses (asserted in the ranks), masters and
    optimizer moments bit for bit; tp/pp 2 -> 1 through the consolidated state dict; refusals."""
    root, expected = saved
    run_distributed(_phase2, 2, timeout=600, root=str(root), expected=expected)
    for case in expected:
        never_stopped, resumed = _states(root / case / "final"), _states(root / case / "resumed")
        assert never_stopped.keys() == resumed.keys() and never_stopped
        for key, value in never_stopped.items():
            assert torch.equal(value, resumed[key]), f"{case}: {key} differs from the run that never stopped"


def test_consolidation_of_dp2_tp2_equals_the_single_process_model(saved, tmp_path):
    root, _ = saved
    reference = mm.model_fn()().state_dict()
    for style in ("dtensor", "megatron"):
        out = tmp_path / f"{style}.safetensors"
        summary = consolidate(root / f"untrained_{style}", out, tag="t", progress=False)
        assert summary["parts"] == 2
        from safetensors.torch import load_file

        full = load_file(out)
        assert full.keys() == reference.keys(), style
        for name, value in reference.items():
            assert torch.equal(full[name], value), f"{style}: {name} differs from the single-process model"
    compat = get_fp32_state_dict_from_zero_checkpoint(root / "untrained_dtensor", tag="t")
    assert compat.keys() == reference.keys() and all(torch.equal(compat[n], v) for n, v in reference.items())


def test_consolidate_command_and_a_damaged_part(saved, tmp_path, capsys):
    from zeroshard.tools import cli

    root, _ = saved
    code = cli.main(
        ["consolidate", str(root / "untrained_dtensor"), str(tmp_path / "m.pt"), "--tag", "t", "--json", "--quiet"]
    )
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["parts"] == 2 and summary["tensors"] == len(mm.model_fn()().state_dict())
    damaged = tmp_path / "damaged"
    shutil.copytree(root / "untrained_dtensor", damaged)
    shard = damaged / "t" / "tp01_pp00" / "rank_00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=r"tp01_pp00/rank_00001.safetensors: truncated"):
        consolidate(damaged, tmp_path / "x.safetensors", tag="t", progress=False)


def test_consolidation_names_what_a_megatron_parameter_lacks(saved, tmp_path):
    root, _ = saved
    with pytest.raises(CheckpointError, match=r"parameter 'blocks.0.up.weight' .*needs Megatron's `partition_dim`"):
        consolidate(root / "untrained_megatron_unnamed", tmp_path / "x.safetensors", tag="t", progress=False)


def test_consolidation_of_a_pipeline_checkpoint_joins_the_stages(saved, tmp_path):
    root, expected = saved
    out = tmp_path / "pp.pt"
    consolidate(root / "pp2", out, tag="resume", progress=False)
    full = torch.load(out, weights_only=True)
    at_save = {}
    for value in expected["pp2"].values():
        at_save.update(value["at_save"])
    assert full.keys() == at_save.keys()
    assert all(torch.equal(full[n], v) for n, v in at_save.items())
