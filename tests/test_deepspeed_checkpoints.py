"""DeepSpeed-written checkpoints (tests/data/deepspeed/, made by DeepSpeed 0.19.8 itself at 2 ranks,
stages 1-3, fp32/bf16/fp16) resumed by zeroshard at 2, 3 and 4 ranks and at every stage.

The oracle is DeepSpeed: make_checkpoints.py recorded the losses of the steps DeepSpeed trained after
its save; zeroshard, resuming from that save, must train the same steps to the same losses:
  * bit for bit at DeepSpeed's world size (2) in fp32, at its stage and at every other (at 2 ranks
    zeroshard is bit for bit DDP at every stage, and so is DeepSpeed, both stepping torch's AdamW);
  * bf16 at 2 ranks: bit for bit at the same stage (measured: at every stage);
  * fp16: within TOL_16 everywhere, the same world size and stage included. The first two steps
    after the load match bit for bit, the third differs by 3.7e-3. Cause, found: on a step where the
    loss scale grows, DeepSpeed 0.19.8 updates the scale *before* unscaling that step's gradients
    (stage_1_and_2.py / stage3.py step(): `_update_scale` precedes `unscale_and_clip_grads`, which
    divides by the new scale), so it applies half the gradient on that step; zeroshard divides by the
    scale the loss was multiplied with. With zeroshard's step changed to DeepSpeed's order (an
    experiment, not committed) all three fp16 checkpoints resume bit for bit. The loss scale itself
    moves exactly as DeepSpeed's (asserted);
  * at 3 and 4 ranks the global batch is the same 12 samples; only the order of the gradient sums
    changes: TOL_FP32 relative in fp32 (measured 0 at 3 ranks, 9.6e-8 at 4), TOL_16 in 16 bits.
The masters and Adam moments zeroshard holds after loading are DeepSpeed's exactly (compared with
zero_to_fp32's output, which make_checkpoints.py saved with DeepSpeed's own script).

A LoRA-style model with frozen parameters (tiny_model.AdapterNet, make_frozen_checkpoints.py):
DeepSpeed keeps them in the module state dict alone at stage 1, in `frozen_param_fragments` at
stages 2 and 3 ([Note: where DeepSpeed keeps frozen parameters]). Each of its stage 1-3 checkpoints
resumes in zeroshard at 2 and 4 ranks; the parameters and Adam moments after loading are the ones
DeepSpeed's running engine held (bit for bit, every world size), and the three steps after it give
DeepSpeed's losses and final parameters: bit for bit at 2 ranks; at 4 ranks the losses within
TOL_FP32 and the trainable parameters within FINAL_TOL (the order of the gradient sums changes),
the frozen ones exactly.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

import zeroshard
from tests.deepspeed_data import DATA, reference_weights, tm
from tests.harness import run_distributed, subtests
from zeroshard.checkpoint import CheckpointError, consolidate
from zeroshard.checkpoint.deepspeed import DeepSpeedCheckpoint, find
from zeroshard.checkpoint.deepspeed_convert import convert_deepspeed

EXPECTED = json.loads((DATA / "expected.json").read_text())
EXPECTED_FROZEN = json.loads((DATA / "expected_frozen.json").read_text())
CASES = list(tm.CASES)  # checkpoint names: stage<s>_<precision>[_<variant>]
TOL_FP32 = 1e-6
# fp32 at 2 ranks: bit for bit with DeepSpeed's recorded losses on the AMD EPYC box they were
# recorded on; on an Intel Xeon (2026-12-02, at 91db376 too, before that day's changes) the second
# loss of every fp32 checkpoint is 8e-8 relative from DeepSpeed's, at every stage, while the first
# (the loaded state) is exact. So there: the first loss exact, zeroshard's stages bit for bit alike,
# DeepSpeed's within TOL_FP32. The cause (a CPU-dependent kernel) was not isolated; DeepSpeed cannot
# be re-run here.
# Relative, per loss. Measured: bf16 7.8e-4 (3 ranks), 3.6e-4 (4 ranks), 0 at 2 ranks at any stage;
# fp16 3.7e-3 at every world size, the same stage included (DeepSpeed's unscale order, module doc).
TOL_16 = 1e-2
# The adapter model's trainable parameters after 3 steps at 4 ranks against DeepSpeed's at 2: Adam
# divides each moment by its square root, so a gradient that differs in its last bits (the sums'
# order) moves an element by up to a few ulps of the step. Absolute, lr = 0.01; measured: 6.0e-8.
FINAL_TOL = 1e-6


def _train(engine, precision: str, first: int, steps: int) -> list[float]:
    world, rank = engine.world_size, engine.global_rank
    losses = []
    for step in range(first, first + steps):
        x, y = tm.batch(step, rank, world, tm.DTYPES[precision])
        loss = tm.loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        every = engine.comm.all_gather_objects(loss.item(), "test: losses")
        losses.append(float(torch.tensor(every, dtype=torch.float32).sum() / world))
    return losses


def _resume(source: str, stage: int, precision: str, converted: str | None = None) -> dict:
    world = torch.distributed.get_world_size()
    variant = tm.CASES[source][2]
    config = tm.config(stage, precision, world, variant)
    config["zeroshard"] = {"comm_timeout_s": 60}
    if variant == "fp32grads":  # DeepSpeed's BF16_Optimizer accumulates and reduces in fp32
        config["communication_data_type"] = "fp32"
    model = tm.build_model(variant)
    engine, _, _, _ = zeroshard.initialize(
        model=model, model_parameters=tm.model_parameters(model, variant), config=config
    )
    path, client = engine.load_checkpoint(converted or str(DATA / source))
    loaded = {
        "global_steps": engine.global_steps,
        "lr": engine.get_lr(),
        "scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
    }
    with engine.gathered_parameters(list(model.parameters())):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    losses = _train(engine, precision, EXPECTED["steps_before_save"], tm.STEPS_AFTER_SAVE)
    final_scale = engine.get_loss_scale()
    engine.destroy()
    return {"losses": losses, "loaded": loaded, "params": params, "path": path, "final_scale": final_scale}


def _options(option: str) -> None:
    """load_checkpoint's options on a DeepSpeed checkpoint, and an engine unlike DeepSpeed's."""
    world = torch.distributed.get_world_size()
    config = tm.config(2, "fp32", world)
    config["zeroshard"] = {"comm_timeout_s": 60}
    if option == "fused":  # zeroshard's own default AdamW (torch's fused kernel) keeps its kernel
        del config["optimizer"]["params"]["torch_adam"]
    model = tm.build_model() if option != "other_model" else torch.nn.Linear(3, 3)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    source = str(DATA / "stage2_fp32")
    if option == "other_model":
        with pytest.raises(CheckpointError, match="incompatible model"):
            engine.load_checkpoint(source)
    elif option == "module_only":
        engine.load_checkpoint(source, load_module_only=True)
        assert engine.global_steps == 0 and all(not engine.optimizer.group_state(g) for g in engine.optimizer.groups)
    else:
        engine.load_checkpoint(source)
        group = engine.optimizer.param_groups[0]
        assert group["fused"] is True and group["lr"] == pytest.approx(0.0046) and engine.global_steps == 3
        state = engine.optimizer.group_state(engine.optimizer.groups[0])
        assert float(state["step"]) == 3.0 and state["exp_avg"].abs().sum() > 0
    engine.destroy()


def _resave_with_frozen(save_dir: str) -> None:
    """A DeepSpeed checkpoint with a frozen parameter, saved again by zeroshard and loaded back at
    another stage: the frozen parameter's group (no optimizer group) survives zeroshard's manifest."""

    def engine_at(stage):
        config = tm.config(stage, "fp32", torch.distributed.get_world_size(), "groups")
        config["zeroshard"] = {"comm_timeout_s": 60}
        model = tm.build_model("groups")
        return zeroshard.initialize(model=model, model_parameters=tm.model_parameters(model, "groups"), config=config)[
            0
        ]

    first = engine_at(2)
    first.load_checkpoint(str(DATA / "stage2_fp32_groups"))
    first.save_checkpoint(save_dir)
    first.destroy()
    second = engine_at(3)
    second.load_checkpoint(save_dir)
    with second.gathered_parameters(list(second.module.parameters())):
        params = {n: p.detach().clone() for n, p in second.module.named_parameters()}
    reference = reference_weights("stage2_fp32_groups")
    assert all(torch.equal(params[n], reference[n]) for n in params)
    second.destroy()


def _full_params(engine) -> dict:
    with engine.gathered_parameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def _resume_frozen(source: str, stage: int, strict: bool = True) -> dict:
    """A DeepSpeed checkpoint of the adapter model (frozen parameters) resumed at `stage`: the
    parameters and Adam moments after loading, the losses of the steps DeepSpeed trained after its
    save, and the parameters after them."""
    from zeroshard.utils import safe_get_full_optimizer_state

    world = torch.distributed.get_world_size()
    config = tm.config(stage, "fp32", world)
    config["zeroshard"] = {"comm_timeout_s": 60}
    model = tm.build_adapter_model()
    engine, _, _, _ = zeroshard.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config
    )
    engine.load_checkpoint(str(DATA / source), load_module_strict=strict)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    moments = {
        k: {n: safe_get_full_optimizer_state(p, k).clone() for n, p in trainable} for k in ("exp_avg", "exp_avg_sq")
    }
    loaded = _full_params(engine)
    losses = []
    for step in range(EXPECTED_FROZEN["steps_before_save"], EXPECTED_FROZEN["steps_before_save"] + tm.STEPS_AFTER_SAVE):
        tokens, y = tm.token_batch(step, engine.global_rank, world)
        loss = tm.loss_fn(engine(tokens), y)
        engine.backward(loss)
        engine.step()
        every = engine.comm.all_gather_objects(loss.item(), "test: losses")
        losses.append(float(torch.tensor(every, dtype=torch.float32).sum() / world))
    final = _full_params(engine)
    global_steps = engine.global_steps
    engine.destroy()
    return {"loaded": loaded, "moments": moments, "losses": losses, "final": final, "global_steps": global_steps}


def _worker(rank: int, world_size: int, cases: list[dict], save_dir: str, frozen: list[dict]):
    if world_size == 2:
        subtests([{"option": o} for o in ("fused", "module_only", "other_model")], _options)
        subtests([{}], lambda: _resave_with_frozen(save_dir))
    return subtests(cases, _resume), subtests(frozen, _resume_frozen)


CONVERTED = ["stage2_fp32", "stage3_bf16", "stage1_fp16"]  # also resumed through `zeroshard convert`


def _cases(world: int, converted_dir: Path | None = None) -> list[dict]:
    if world == 2:  # every checkpoint at every stage
        cases = [dict(source=name, stage=t, precision=tm.CASES[name][1]) for name in CASES for t in (0, 1, 2, 3)]
    else:
        cases = [
            dict(source=name, stage=t, precision=tm.CASES[name][1])
            for name in CASES
            for t in sorted({tm.CASES[name][0], 3 if tm.CASES[name][0] != 3 else 1})
        ]
    if converted_dir is not None:
        cases += [
            dict(source=name, stage=tm.CASES[name][0], precision=tm.CASES[name][1], converted=str(converted_dir / name))
            for name in CONVERTED
        ]
    return cases


def _frozen_cases(world: int) -> list[dict]:
    """The adapter model's stage-1 checkpoint at zeroshard's stages 1-3 (2 ranks) or 1 and 3 (4
    ranks), the stage-2 and stage-3 ones at their own stage; at 2 ranks also the one saved without
    its frozen parameters, loaded non-strictly (the model's own frozen values are the saved ones:
    frozen since initialisation)."""
    if world not in (2, 4):
        return []
    cases = [dict(source=name, stage=t) for name, s in tm.FROZEN_CASES.items() for t in ((1, 3) if s == 1 else (s,))]
    if world == 2:
        cases += [dict(source="stage1_fp32_frozen", stage=2), dict(source=tm.FROZEN_EXCLUDED, stage=1, strict=False)]
    return cases


def _check_frozen(cases: list[dict], world: int, results: list[dict]) -> tuple[float, float]:
    """Each resumed adapter model against DeepSpeed's run; returns the largest relative loss difference
    and the largest absolute difference of a trainable parameter after the steps."""
    worst, worst_loss = 0.0, 0.0
    for case, result in zip(cases, results):
        source = case["source"] if case["source"] != tm.FROZEN_EXCLUDED else "stage1_fp32_frozen"
        what = f"{case['source']} resumed at {world} ranks, stage {case['stage']}"
        reference = torch.load(DATA / source / "reference.pt", weights_only=True)
        after = EXPECTED_FROZEN["losses"][source][EXPECTED_FROZEN["steps_before_save"] :]
        assert result["global_steps"] == EXPECTED_FROZEN["steps_before_save"] + tm.STEPS_AFTER_SAVE, what
        assert result["loaded"].keys() == reference["saved"].keys(), what
        for name, value in result["loaded"].items():
            assert torch.equal(value, reference["saved"][name]), f"{what}: '{name}' is not DeepSpeed's after loading"
        for key, values in result["moments"].items():
            assert values.keys() == reference[key].keys(), what
            for name, value in values.items():
                assert torch.equal(value, reference[key][name]), f"{what}: {key} of '{name}' is not DeepSpeed's"
        exact = world == 2 and result["losses"] == after
        if world == 2 and not exact:  # a CPU-dependent kernel: see TOL_FP32
            assert result["losses"][0] == after[0], f"{what}: the loaded state is not DeepSpeed's"
            alike = {tuple(r["losses"]) for r in results}
            assert len(alike) == 1, f"{what}: the stages' losses differ: {alike}"
        error = _relative(result["losses"], after)
        assert error <= TOL_FP32, f"{what}: losses {result['losses']}, DeepSpeed's {after}"
        worst_loss = max(worst_loss, error)
        for name, value in result["final"].items():
            want = reference["final"][name]
            if name in tm.FROZEN_ADAPTER or exact:
                assert torch.equal(value, want), (
                    f"{what}: '{name}' after {tm.STEPS_AFTER_SAVE} steps is not DeepSpeed's"
                )
            else:
                worst = max(worst, float((value - want).abs().max()))
    assert worst <= FINAL_TOL, f"{worst:.2e}"
    return worst_loss, worst


def _relative(ours: list[float], theirs: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))


def _check(cases: list[dict], world: int, results: list[dict]) -> dict:
    worst = {}
    for case, result in zip(cases, results):
        source, stage, precision = case["source"], case["stage"], case["precision"]
        expected = EXPECTED["cases"][source]
        after = expected["losses"][EXPECTED["steps_before_save"] :]
        what = f"{source} resumed at {world} ranks, stage {stage}{' (converted)' if case.get('converted') else ''}"
        assert result["loaded"]["global_steps"] == EXPECTED["steps_before_save"], what
        reference = reference_weights(source)
        for name, value in result["params"].items():
            # The parameters zeroshard computes with are the masters rounded to the compute dtype.
            want = reference[name].to(tm.DTYPES[precision]).float()
            assert torch.equal(value, want), f"{what}: parameter '{name}' is not DeepSpeed's master"
        # BF16_Optimizer (fp32grads): the state loads exactly (the first loss is bit for bit), later
        # steps are within TOL_16 (measured 8e-5); its gradient path differs from zeroshard's with
        # fp32 communication in a way not identified here.
        exact = world == 2 and (
            precision == "fp32"
            or (precision == "bf16" and stage == tm.CASES[source][0] and tm.CASES[source][2] != "fp32grads")
        )
        if exact and precision == "fp32" and result["losses"] != after:  # see TOL_FP32
            assert result["losses"][0] == after[0], f"{what}: the loaded state is not DeepSpeed's"
            alike = {tuple(r["losses"]) for c, r in zip(cases, results) if c["source"] == source}
            assert len(alike) == 1, f"{what}: the stages' losses differ: {alike}"
            exact = False
        if tm.CASES[source][2] == "fp32grads" and stage == tm.CASES[source][0] and world == 2:
            assert result["losses"][0] == after[0], what
        error = _relative(result["losses"], after)
        if exact:
            assert result["losses"] == after, f"{what}: losses {result['losses']} != DeepSpeed's {after}"
        else:
            assert error <= (TOL_FP32 if precision == "fp32" else TOL_16), (
                f"{what}: {error:.2e} {result['losses']} {after}"
            )
        if precision == "fp16":  # DeepSpeed's scaler state as saved: scale, hysteresis, iteration, last overflow
            saved = DeepSpeedCheckpoint(find(DATA / source)).loss_scaler_state()
            assert saved["scale"] == 512.0 and result["loaded"]["scaler"] == saved, what
            assert result["final_scale"] == expected["loss_scale"], f"{what}: the scale did not move as DeepSpeed's"
        worst[precision] = max(worst.get(precision, 0.0), error)
    return worst


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.slow
def test_deepspeed_checkpoints_resume(world, tmp_path):
    for name in CONVERTED:
        convert_deepspeed(find(DATA / name), tmp_path / name)
    cases, frozen = _cases(world, tmp_path), _frozen_cases(world)
    results, frozen_results = run_distributed(
        _worker, world, timeout=300, cases=cases, save_dir=str(tmp_path / "resaved"), frozen=frozen
    )[0]
    worst = _check(cases, world, results)
    print(f"world {world}: worst relative loss difference from DeepSpeed per precision: {worst}")
    if frozen:
        loss, final = _check_frozen(frozen, world, frozen_results)
        print(
            f"world {world}: adapter model, worst relative loss difference {loss:.2e}, trainable parameters {final:.2e}"
        )


# -- single process: consolidate, convert, safe loading --------------------------------------------
@pytest.mark.parametrize("source", CASES)
@pytest.mark.parametrize("via", ["direct", "convert"])
def test_consolidate_equals_zero_to_fp32(tmp_path, source, via):
    """`zeroshard consolidate` of the DeepSpeed checkpoint, or of its `zeroshard convert` result."""
    output = tmp_path / "model.safetensors"
    if via == "convert":
        convert_deepspeed(find(DATA / source), tmp_path / "converted")
    summary = consolidate(DATA / source if via == "direct" else tmp_path / "converted", output, progress=False)
    from safetensors.torch import load_file

    ours = load_file(str(output))
    reference = reference_weights(source)
    assert ours.keys() == reference.keys()
    for name in reference:
        assert ours[name].dtype == reference[name].dtype and torch.equal(ours[name], reference[name]), name
    assert summary["tensors"] == len(reference)


def test_consolidate_in_hugging_face_layout_equals_zero_to_fp32(tmp_path):
    """`zeroshard consolidate --format hf` of a DeepSpeed checkpoint: the shards, read through their
    index, hold zero_to_fp32's tensors; each file at most the shard size unless one tensor is larger."""
    import json

    from safetensors.torch import load_file

    source = CASES[0]
    consolidate(DATA / source, tmp_path / "hf", fmt="hf", max_shard_size="4KB", progress=False)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    reference = reference_weights(source)
    assert index["weight_map"].keys() == reference.keys()
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in reference.values()
    )
    ours = {}
    for name in files:
        tensors = load_file(str(tmp_path / "hf" / name))
        big = max(t.numel() * t.element_size() for t in tensors.values())
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 4000, (name, big)
        ours.update(tensors)
    for name in reference:
        assert torch.equal(ours[name], reference[name]), name


@pytest.mark.parametrize("source", list(tm.FROZEN_CASES))
@pytest.mark.parametrize("via", ["direct", "convert"])
def test_consolidate_frozen_parameters(tmp_path, source, via):
    """`zeroshard consolidate` of the adapter model's checkpoints holds every parameter, the frozen
    ones wherever DeepSpeed kept them, equal to what DeepSpeed's running engine held."""
    from safetensors.torch import load_file

    output = tmp_path / "model.safetensors"
    if via == "convert":
        convert_deepspeed(find(DATA / source), tmp_path / "converted")
    consolidate(DATA / source if via == "direct" else tmp_path / "converted", output, progress=False)
    ours = load_file(str(output))
    reference = torch.load(DATA / source / "reference.pt", weights_only=True)["saved"]
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[n], reference[n]) for n in reference)


@pytest.mark.parametrize("source", list(tm.FROZEN_CASES))
def test_frozen_parameters_found_where_deepspeed_keeps_them(source):
    checkpoint = DeepSpeedCheckpoint(find(DATA / source))
    assert list(checkpoint.frozen()) == tm.FROZEN_ADAPTER
    where = "the module state dict" if checkpoint.stage == 1 else "'frozen_param_fragments'"
    assert where in checkpoint.frozen_source()
    model = tm.build_adapter_model()
    for name in tm.FROZEN_ADAPTER:  # frozen since initialisation
        assert torch.equal(checkpoint.frozen_param(name), model.get_parameter(name).detach()), name


def test_frozen_parameter_missing_or_wrong_is_an_error_naming_it():
    from zeroshard.checkpoint.deepspeed_load import check_model

    params = {n: list(p.shape) for n, p in tm.build_adapter_model().named_parameters()}
    excluded = DeepSpeedCheckpoint(find(DATA / tm.FROZEN_EXCLUDED))  # saved with exclude_frozen_parameters
    assert excluded.frozen() == {}
    with pytest.raises(CheckpointError) as error:
        check_model(excluded, params, strict=True)
    message = str(error.value)
    assert "4 parameter(s) of the model missing" in message and "'embed.weight'" in message, message
    assert "mp_rank_00_model_states.pt" in message and "load_module_strict=False" in message, message
    check_model(excluded, params, strict=False)

    checkpoint = DeepSpeedCheckpoint(find(DATA / "stage1_fp32_frozen"))
    module = checkpoint.model_states["module"]
    module["embed.weight"] = module["embed.weight"].to(torch.float64)
    with pytest.raises(
        CheckpointError,
        match=r"mp_rank_00_model_states.pt: frozen parameter 'embed.weight' in 'module' has dtype torch.float64",
    ):
        checkpoint.frozen_param("embed.weight")
    del module["blocks.1.norm.bias"]
    with pytest.raises(
        CheckpointError, match=r"mp_rank_00_model_states.pt: frozen parameter 'blocks.1.norm.bias' is not saved"
    ):
        checkpoint.frozen_param("blocks.1.norm.bias")
    stage3 = DeepSpeedCheckpoint(find(DATA / "stage3_fp32_frozen"))
    stage3._frozen["blocks.0.fc.base.bias"] = torch.Size([25])  # a fragment of 12 elements per rank
    with pytest.raises(
        CheckpointError,
        match=r"frozen parameter 'blocks.0.fc.base.bias' .* holds 24 elements, its shape \[25\] needs 25",
    ):
        stage3.frozen_param("blocks.0.fc.base.bias")


@pytest.mark.parametrize("source", [name for name in CASES if (DATA / name / "zero_to_fp32.pt").is_file()])
def test_fixture_references_agree(source):
    """DeepSpeed's two views of the same weights: zero_to_fp32 of the files, the live engine's masters."""
    files = torch.load(DATA / source / "zero_to_fp32.pt", weights_only=True)
    live = torch.load(DATA / source / "masters.pt", weights_only=True)
    assert files.keys() == live.keys()
    assert all(torch.equal(files[k], live[k]) for k in files)


def test_tampered_pickle_is_refused(tmp_path):
    copy = tmp_path / "stage1_fp32"
    shutil.copytree(DATA / "stage1_fp32", copy)
    model_file = copy / "global_step3" / "mp_rank_00_model_states.pt"
    with zipfile.ZipFile(model_file) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    tampered = tmp_path / "tampered.pt"
    _rewrite_global(model_file, tampered, pkl)
    shutil.move(tampered, model_file)
    with pytest.raises(CheckpointError) as error:
        DeepSpeedCheckpoint(find(copy))
    message = str(error.value)
    assert "mp_rank_00_model_states.pt" in message and "refused to load" in message, message
    assert "os.system" in message, message


def _rewrite_global(source: Path, target: Path, pkl: bytes) -> None:
    old, new = b"ccollections\nOrderedDict\n", b"cos\nsystem\n"  # protocol-2 GLOBAL opcodes
    assert old in pkl, "the fixture's pickle no longer names collections.OrderedDict as expected"
    with zipfile.ZipFile(source) as original, zipfile.ZipFile(target, "w") as copy:
        for item in original.infolist():
            data = original.read(item.filename)
            copy.writestr(item, data.replace(old, new, 1) if item.filename.endswith("data.pkl") else data)


def test_unreadable_and_incomplete_checkpoints_name_the_file(tmp_path):
    copy = tmp_path / "stage2_fp32"
    shutil.copytree(DATA / "stage2_fp32", copy)
    (copy / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="saved at 2 ranks"):
        DeepSpeedCheckpoint(find(copy))
    (copy / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        DeepSpeedCheckpoint(find(copy))


def test_cli_convert_and_consolidate(tmp_path, capsys):
    from safetensors.torch import load_file

    from zeroshard.tools.cli import main

    assert main(["convert", str(DATA / "stage3_fp32"), str(tmp_path / "zs"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["deepspeed_stage"] == 3 and summary["global_steps"] == EXPECTED["steps_before_save"]
    assert (tmp_path / "zs" / "latest").read_text() == "global_step3"
    assert main(["consolidate", str(DATA / "stage3_fp32"), str(tmp_path / "ds.safetensors"), "--quiet"]) == 0
    assert main(["consolidate", str(tmp_path / "zs"), str(tmp_path / "zs.safetensors"), "--quiet"]) == 0
    direct, converted = load_file(str(tmp_path / "ds.safetensors")), load_file(str(tmp_path / "zs.safetensors"))
    assert direct.keys() == converted.keys() and all(torch.equal(direct[k], converted[k]) for k in direct)
    assert main(["convert", str(tmp_path / "zs"), str(tmp_path / "again")]) == 2  # not a DeepSpeed checkpoint
    assert "no DeepSpeed checkpoint there" in capsys.readouterr().err
