"""Checkpoints on 2 gloo ranks: exact resume at every stage, full weights in and out, damage reported.

Exact resume: 10 steps straight == 5 steps, save, *fresh processes*, load, 5 steps, bit for bit
(losses, learning rates, parameters; fp32), with gradient accumulation, clipping, a warmup schedule
and saves in the middle of an accumulation.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file

from tests.checkpoint_helpers import assert_equal_params, build_engine, full_params, tiny_batches, train_micro_steps
from tests.harness import run_distributed, subtests
from zeroshard.checkpoint import CheckpointError, consolidate, full_state_dict, load_full_weights
from zeroshard.checkpoint.files import SafetensorsReader
from zeroshard.tools import cli
from zeroshard.tools.models.gpt import GPT, tiny_gpt_config

STEPS = 10
# split: micro steps done before the save; split % gas != 0 saves in the middle of an accumulation.
# Mixed precision cases: bf16 parameters, fp16 with a dynamic loss scale whose state must resume too.
RESUME_CASES = [
    dict(stage=0, gas=1, clip=0.0, split=5),
    dict(stage=1, gas=2, clip=0.05, split=10),
    dict(stage=2, gas=1, clip=0.05, split=5),
    dict(stage=3, gas=2, clip=0.0, split=10),
    dict(stage=1, gas=2, clip=0.0, split=11),
    dict(stage=3, gas=2, clip=0.05, split=9),
    dict(stage=2, gas=1, clip=0.0, split=5, precision="bf16"),
    dict(stage=3, gas=1, clip=0.0, split=5, precision="fp16"),
]


def _case_dir(root: str, case: dict) -> str:
    return "{}/resume-{}".format(root, "-".join(f"{k}{v}" for k, v in case.items()))


def _first_half(rank: int, world: int, *, root: str) -> list:
    def case(stage, gas, clip, split, precision="fp32"):
        batches = tiny_batches()
        straight = build_engine(stage, gas=gas, clip=clip, precision=precision)
        reference = train_micro_steps(straight, batches, 0, STEPS * gas)
        reference["params"] = full_params(straight)
        reference["scale"] = _loss_scale(straight)
        straight.destroy()
        half = build_engine(stage, gas=gas, clip=clip, precision=precision)
        train_micro_steps(half, batches, 0, split)
        case = dict(stage=stage, gas=gas, clip=clip, split=split)
        half.save_checkpoint(
            _case_dir(root, case if precision == "fp32" else {**case, "precision": precision}),
            client_state={"split": split, "note": ("any", "picklable")},
        )
        half.destroy()
        return reference

    return subtests(RESUME_CASES, case)


def _second_half(rank: int, world: int, *, root: str, references: list) -> None:
    def case(index):
        stage, gas, clip, split = (RESUME_CASES[index][k] for k in ("stage", "gas", "clip", "split"))
        precision = RESUME_CASES[index].get("precision", "fp32")
        reference = references[rank][index]
        # other initial weights: everything must come from the checkpoint
        engine = build_engine(stage, seed=1, gas=gas, clip=clip, precision=precision)
        path, client_state = engine.load_checkpoint(_case_dir(root, RESUME_CASES[index]))
        assert Path(path).name == f"global_step{split // gas}"
        assert client_state == {"split": split, "note": ("any", "picklable")}
        assert (engine.global_steps, engine.micro_steps) == (split // gas, split)
        rest = train_micro_steps(engine, tiny_batches(), split, STEPS * gas - split)
        assert rest["losses"] == reference["losses"][split:], (rest["losses"], reference["losses"][split:])
        assert rest["lrs"] == reference["lrs"][split:]
        assert_equal_params(full_params(engine), reference["params"], f"case {RESUME_CASES[index]}")
        assert _loss_scale(engine) == reference["scale"]
        engine.destroy()

    subtests([dict(index=i) for i in range(len(RESUME_CASES))], case)


def _loss_scale(engine):
    scaler = getattr(engine, "loss_scaler", None)
    return scaler.state_dict() if scaler is not None else None


@pytest.mark.slow
def test_resume_is_bit_exact_at_every_stage(tmp_path):
    references = run_distributed(_first_half, 2, timeout=300, root=str(tmp_path))
    run_distributed(_second_half, 2, timeout=300, root=str(tmp_path), references=references)


# ---------------------------------------------------------------- full weights out and in


def _count_reads(counter: list):
    original = SafetensorsReader._read_raw

    def counting(self, name, lo, hi, out):
        counter[0] += hi - lo
        return original(self, name, lo, hi, out)

    return original, counting


def _full_weights_case(rank: int, root: str, stage: int) -> dict:
    # At stage 3 save_16bit_model writes only with this key (DeepSpeed's behaviour; test_config_table.py)
    engine = build_engine(stage, zero={"stage3_gather_16bit_weights_on_model_save": True})
    batches = tiny_batches()
    train_micro_steps(engine, batches, 0, 2)
    checkpoint = engine.save_checkpoint(f"{root}/fw{stage}")
    expected = full_params(engine)
    inputs, _ = batches(99, 0, 0)
    with torch.no_grad():
        logits = engine(inputs)
    state = full_state_dict(engine)
    sixteen = engine.save_16bit_model(f"{root}/fw{stage}", "model16.safetensors")
    out = Path(root) / f"fw{stage}" / "full.safetensors"
    if rank == 0:
        plain = GPT(tiny_gpt_config())
        assert list(state) == list(plain.state_dict()), "keys and order of model.state_dict()"
        assert state["lm_head.weight"] is state["tok_emb.weight"], "tied alias included, sharing storage"
        assert_equal_params({k: state[k] for k in expected}, expected, "full_state_dict")
        consolidate(Path(checkpoint).parent, out, progress=False)
        for file in (sixteen, out):
            plain.load_state_dict(load_file(file), strict=True)
            with torch.no_grad():
                assert torch.equal(plain(inputs), logits), f"{file}: the plain model must compute as the engine"
        bf16 = consolidate(checkpoint, Path(root) / f"fw{stage}" / "bf16.pt", dtype=torch.bfloat16, progress=False)
        loaded = torch.load(bf16["output"])
        assert loaded["blocks.0.mlp.fc.weight"].dtype == torch.bfloat16
        assert torch.equal(loaded["blocks.0.mlp.fc.weight"], expected["blocks.0.mlp.fc.weight"].bfloat16())
        plain.load_state_dict(loaded, strict=True)
        by_cli = Path(root) / f"fw{stage}" / "cli.safetensors"
        assert cli.main(["consolidate", str(Path(checkpoint).parent), str(by_cli), "--quiet"]) == 0
        assert by_cli.read_bytes() == out.read_bytes(), "the CLI writes what consolidate() writes"
    engine.comm.barrier("consolidated file written")
    engine.destroy()

    target_stage = (stage + 1) % 4
    fresh = build_engine(target_stage, seed=2)
    counter = [0]
    original, counting = _count_reads(counter)
    SafetensorsReader._read_raw = counting
    try:
        load_full_weights(fresh, out)
    finally:
        SafetensorsReader._read_raw = original
    assert_equal_params(full_params(fresh), expected, "load_full_weights from safetensors")
    own = sum(g.master.numel() for g in fresh.groups)
    assert counter[0] <= own, f"rank {rank} read {counter[0]} elements, its masters hold {own}"

    shifted = {k: v + 1 for k, v in expected.items() if k != "tok_emb.weight"}
    shifted["lm_head.weight"] = expected["tok_emb.weight"] + 1  # a tied weight under its other name
    load_full_weights(fresh, shifted)
    assert_equal_params(full_params(fresh), {k: v + 1 for k, v in expected.items()}, "from a state dict")
    with pytest.raises(CheckpointError, match=r"1 parameter\(s\) missing .*ln_f.bias"):
        load_full_weights(fresh, {k: v for k, v in expected.items() if k != "ln_f.bias"})
    with pytest.raises(CheckpointError, match=r"1 unexpected key\(s\) .*'extra'"):
        load_full_weights(fresh, {**expected, "extra": torch.zeros(1)})
    fresh.destroy()
    return {"read": counter[0], "own": own}


def _full_weights_worker(rank: int, world: int, *, root: str) -> list:
    return subtests([dict(stage=s) for s in range(4)], lambda stage: _full_weights_case(rank, root, stage))


def test_full_weights_consolidate_and_load(tmp_path):
    reports = run_distributed(_full_weights_worker, 2, timeout=300, root=str(tmp_path))
    # Each rank read no more than its own masters hold (checked in the ranks): at stages 1-3 that
    # is about half of the model, at stage 0 all of it.
    model_numel = GPT(tiny_gpt_config()).num_parameters()
    for stage, per_rank in enumerate(zip(*reports)):
        sharded = (stage + 1) % 4 != 0
        for report in per_rank:
            assert 0 < report["read"] and (report["own"] < model_numel) == sharded, (stage, report)


# ---------------------------------------------------------------- damage is reported, not loaded


def _damage(path: Path, case: str) -> None:
    tag = path / "global_step2"
    if case == "missing_shard":
        (tag / "rank_00001.safetensors").unlink()
    elif case == "truncated":
        data = (tag / "rank_00000.safetensors").read_bytes()
        (tag / "rank_00000.safetensors").write_bytes(data[: len(data) // 2])
    elif case in ("corrupted", "corrupted_objects", "corrupted_sha256"):
        if case == "corrupted_sha256":
            _as_format_version_2(tag)
        file = tag / ("rank_00001.safetensors" if case != "corrupted_objects" else "objects.pt")
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size, one byte differs
        file.write_bytes(bytes(data))
    elif case == "manifest_missing":
        (tag / "manifest.json").unlink()
    elif case == "manifest_garbled":
        (tag / "manifest.json").write_text('{"format": "zeroshard.checkpoint", ')
    elif case == "latest_dangling":
        (path / "latest").write_text("global_step99")
    elif case == "record_without_checksum":
        manifest = json.loads((tag / "manifest.json").read_text())
        del manifest["files"]["objects.pt"]["xxh3_128"]
        (tag / "manifest.json").write_text(json.dumps(manifest))


def _as_format_version_2(tag: Path) -> None:
    """Rewrite a checkpoint's manifest as format version 2 wrote it: each file recorded by sha256."""
    manifest = json.loads((tag / "manifest.json").read_text())
    manifest["format_version"] = 2
    for name, record in manifest["files"].items():
        data = (tag / name).read_bytes()
        assert record == {"xxh3_128": xxhash.xxh3_128(data).hexdigest(), "bytes": len(data)}, name
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (tag / "manifest.json").write_text(json.dumps(manifest))


DAMAGE = {  # case -> words the message must contain
    "missing_shard": ["rank_00001.safetensors", "file is missing"],
    "truncated": ["rank_00000.safetensors", "truncated"],
    "corrupted": ["rank_00001.safetensors", "corrupted", "xxh3_128"],
    "corrupted_objects": ["objects.pt", "corrupted", "xxh3_128"],
    "corrupted_sha256": ["rank_00001.safetensors", "corrupted", "sha256"],  # format version 2's records
    "record_without_checksum": ["manifest.json", "files['objects.pt']", "exactly one checksum"],
    "manifest_missing": ["manifest.json", "manifest is missing"],
    "manifest_garbled": ["manifest.json", "not valid JSON"],
    "latest_dangling": ["global_step99", "no checkpoint with tag"],
}


def _damage_worker(rank: int, world: int, *, root: str) -> list:
    root = Path(root)
    engine = build_engine(2)
    train_micro_steps(engine, tiny_batches(), 0, 2)
    engine.save_checkpoint(root / "good")

    def file_case(case):
        target = root / f"damaged-{case}"
        if rank == 0:
            shutil.copytree(root / "good", target)
            _damage(target, case)
        engine.comm.barrier("damaged copy ready")
        messages = []
        with pytest.raises(CheckpointError) as error:
            engine.load_checkpoint(target)
        messages.append(str(error.value))
        with pytest.raises(CheckpointError) as error:  # the offline path says the same
            consolidate(target, root / f"out-{case}-{rank}.safetensors", progress=False)
        messages.append(str(error.value))
        for message in messages:
            for word in DAMAGE[case]:
                assert word in message, f"{case}: '{word}' not in: {message}"
        return messages[0]

    def model_case(case):
        other = {"more_layers": dict(n_layer=3), "wider": dict(n_embd=48)}[case]
        foreign = build_engine(2, **other)
        with pytest.raises(CheckpointError) as error:
            foreign.load_checkpoint(root / "good")
        foreign.destroy()
        message = str(error.value)
        assert "manifest.json" in message and "incompatible model" in message, message
        expected = "blocks.2" if case == "more_layers" else "different shape"
        assert expected in message, message
        return message

    messages = subtests([dict(case=c) for c in DAMAGE], file_case)
    messages += subtests([dict(case=c) for c in ("more_layers", "wider")], model_case)
    # Not strict: a parameter the checkpoint lacks keeps its value, and its optimizer state starts at zero,
    # also beside saved parameters of its flat group (biases the saved model did not have).
    plain = build_engine(2, bias=False)
    train_micro_steps(plain, tiny_batches(), 0, 2)
    plain.save_checkpoint(root / "no_bias")
    saved = full_params(plain)
    plain.destroy()
    grown = build_engine(2, seed=3, scheduler=False)  # the warmup's first rate is 0
    train_micro_steps(grown, tiny_batches(seed=1), 0, 1)  # biases and their states no longer zero
    before = full_params(grown)
    grown.load_checkpoint(root / "no_bias", load_module_strict=False)
    for name, value in full_params(grown).items():
        assert torch.equal(value, saved.get(name, before[name])), name
    new_pieces = []
    for group in grown.groups:
        state = grown.optimizer.group_state(group)
        for slot, _, _, piece in group.master_pieces(state["exp_avg"]):
            assert piece.any() == (slot.name in saved), f"{slot.name}: state zero only where the checkpoint lacks it"
            new_pieces += [slot.name] if slot.name not in saved else []
    assert new_pieces, "this rank holds parameters the checkpoint lacks"
    grown.destroy()
    if rank == 0:  # a checkpoint whose files format version 2 recorded by sha256 loads as it did
        shutil.copytree(root / "good", root / "version2")
        _as_format_version_2(root / "version2" / "global_step2")
    engine.comm.barrier("version 2 copy ready")
    older = build_engine(2, seed=3)
    older.load_checkpoint(root / "version2")
    assert_equal_params(full_params(older), full_params(engine), "format version 2")
    older.destroy()
    sgd = build_engine(2, optimizer_fn=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    with pytest.raises(CheckpointError, match="optimizer states of AdamW .* cannot be loaded into SGD"):
        sgd.load_checkpoint(root / "good")
    path, _ = sgd.load_checkpoint(root / "good", load_optimizer_states=False)
    assert_equal_params(full_params(sgd), full_params(engine), "weights only")
    sgd.destroy()
    engine.destroy()
    return messages


def test_damage_is_reported_with_the_file_and_the_problem(tmp_path):
    """Damaged files and another model's checkpoint are errors naming the file and the problem; the
    weights alone, an older format version and (not strict) a checkpoint lacking parameters load."""
    reports = run_distributed(_damage_worker, 2, timeout=300, root=str(tmp_path))
    assert reports[0] == reports[1], "every rank raises the same error"


# ---------------------------------------------------------------- tags and `latest`


def _tags_worker(rank: int, world: int, *, root: str) -> None:
    root = Path(root)
    engine = build_engine(1)
    assert engine.load_checkpoint(root / "empty") == (None, None), "no `latest`: nothing to load"
    batches = tiny_batches()
    train_micro_steps(engine, batches, 0, 1)
    first = full_params(engine)
    assert engine.save_checkpoint(root) == str(root / "global_step1")
    train_micro_steps(engine, batches, 1, 1)
    second = full_params(engine)
    engine.save_checkpoint(root)
    engine.save_checkpoint(root, tag="side", save_latest=False)
    engine.save_checkpoint(root, tag="global_step2")  # replaces the tag in place
    with pytest.raises(CheckpointError, match="not usable as a directory name"):
        engine.save_checkpoint(root, tag="../escape")
    _fail_one_shard_write(engine, root)
    engine.comm.barrier("saved")
    assert (root / "latest").read_text() == "global_step2"
    assert sorted(p.name for p in root.iterdir()) == ["global_step1", "global_step2", "latest", "side"]
    fresh = build_engine(1, seed=3)
    assert fresh.load_checkpoint(root)[0] == str(root / "global_step2")
    assert_equal_params(full_params(fresh), second, "latest")
    fresh.load_checkpoint(root, tag="global_step1")
    assert_equal_params(full_params(fresh), first, "explicit tag")
    assert fresh.global_steps == 1
    fresh.destroy()
    engine.destroy()


def _fail_one_shard_write(engine, root: Path) -> None:
    """Rank 1 cannot write its shard: every rank raises an error saying so, nothing is published."""
    from zeroshard.checkpoint import save as save_module

    original = save_module.write_safetensors

    def full_disk(path, tensors, metadata=None):
        raise OSError(28, "No space left on device", str(path))

    if engine.global_rank == 1:
        save_module.write_safetensors = full_disk
    try:
        with pytest.raises(
            CheckpointError, match=r"saving checkpoint .*never failed on rank \[1\]: OSError: .*No space left on device"
        ):
            engine.save_checkpoint(root, tag="never")
    finally:
        save_module.write_safetensors = original


def test_tags_and_latest_follow_deepspeed(tmp_path):
    run_distributed(_tags_worker, 2, timeout=120, root=str(tmp_path / "ckpt"))


def _handover_worker(rank: int, world: int) -> None:
    engine = build_engine(1)
    train_micro_steps(engine, tiny_batches(), 0, 2)
    optimizer, group = engine.optimizer, engine.groups[0]
    held = optimizer.optimizer.state
    given = {k: v.clone() for k, v in optimizer.group_state(group).items()}
    optimizer.load_group_state(group, given, take=True)
    assert held[group.master]["exp_avg"] is given["exp_avg"], "an elementwise tensor given up is kept"
    assert held[group.master]["step"] is not given["step"], "scalar state may be shared between groups"
    whole = torch.zeros(2 * group.master.numel())
    viewed = {**given, "exp_avg": whole[group.master.numel() :]}
    optimizer.load_group_state(group, viewed, take=True)
    kept = held[group.master]["exp_avg"]
    assert kept is not viewed["exp_avg"] and kept.untyped_storage().nbytes() == kept.nbytes, "a view is copied"
    copied = {k: v.clone() for k, v in given.items()}
    optimizer.load_group_state(group, copied)
    assert all(held[group.master][k] is not v for k, v in copied.items()), "by default every tensor is copied"
    engine.destroy()


def test_a_load_gives_its_read_states_to_the_optimizer_instead_of_copying_them():
    """[Note: a load hands its tensors over]: load_group_state(take=True) keeps an elementwise tensor
    that is all of its storage; views and scalars are copied, and without `take` everything is."""
    run_distributed(_handover_worker, 2, timeout=120)
