"""TRL's trainers on zeroshard (2 gloo ranks, a 2-layer Llama and a word-level tokenizer built here,
nothing downloaded): `zeroshard_trainer(SFTTrainer | DPOTrainer | RewardTrainer | KTOTrainer |
GRPOTrainer)` trains at stages 1 and 3, with and without a PEFT LoRA adapter, with the losses of TRL's
own DDP run and the same trained parameters, bit for bit in fp32. At stage 3 the reference models
(DPO's and KTO's second model, GRPO's) are frozen stage-3 engines, 1/N of them on each rank; GRPO
generates inside the step with the whole model gathered once per `generate()` (its
`ds3_gather_for_generation`, the default) or unit by unit. `trainer.save_model()` at stage 3 writes a
model or an adapter that `from_pretrained` loads with the engine's logits, and resuming from a
checkpoint continues exactly."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import trl_helpers as H
from tests.extras import needs
from tests.harness import run_distributed, run_script, subtests, write_titled_blocks
from tests.hf_models import ENV

pytestmark = needs("trl", extra="hf")

CONFIG = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
TRAINERS = {  # name: (trainer, its config class, the dataset it reads)
    "sft": ("SFTTrainer", "SFTConfig", "sft"),
    "dpo": ("DPOTrainer", "DPOConfig", "preference"),
    "reward": ("RewardTrainer", "RewardConfig", "preference"),
    "kto": ("KTOTrainer", "KTOConfig", "unpaired"),
    "grpo": ("GRPOTrainer", "GRPOConfig", "prompt"),
}
GRPO_ARGS = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=6, beta=0.1)


def _model_dir(root: str, name: str) -> str:
    """The tiny model saved once, loaded by path: TRL loads a reference model from the policy's path."""
    path = os.path.join(root, f"model-{name}")
    if torch.distributed.get_rank() == 0 and not os.path.exists(path):
        H.llama(num_labels=1 if name == "reward" else None).save_pretrained(path)
    torch.distributed.barrier()
    return path


def _trainer(root: str, name: str, *, stage: int | None, peft: bool, tag: str = "", **overrides):
    """TRL's trainer `name` (stage None: as TRL runs it, DDP) on the shared tiny setup."""
    import trl

    from zeroshard.integrations.hf import zeroshard_trainer

    trainer_name, config_name, data = TRAINERS[name]
    args = H.common_args(os.path.join(root, f"out-{name}-{stage}-{peft}{tag}"), **(GRPO_ARGS if name == "grpo" else {}))
    args.update(overrides)
    kwargs = dict(
        model=_model_dir(root, name),
        args=getattr(trl, config_name)(**args),
        train_dataset=H.dataset(data),
        processing_class=H.tokenizer(),
    )
    if name == "grpo":
        kwargs["reward_funcs"] = H.reward_length
    if peft:
        kwargs["peft_config"] = H.lora(sequence_classification=name == "reward")
    trainer_class = getattr(trl, trainer_name)
    if stage is None:
        return trainer_class(**kwargs)
    config = {**CONFIG, "zero_optimization": {**CONFIG["zero_optimization"], "stage": stage}}
    return zeroshard_trainer(trainer_class)(**kwargs, zeroshard_config=config)


def _losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _trained(trainer) -> dict:
    """The trainable parameters by name, whole (gathered from the engine's shards)."""
    engine = getattr(trainer, "engine", None)
    model = engine.module if engine is not None else trainer.model
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    gathered = engine.gathered_parameters([p for _, p in params]) if engine is not None else contextlib.nullcontext()
    with gathered:
        return {n: p.detach().clone() for n, p in params}


def _parity(root: str, name: str, peft: bool) -> None:
    """TRL's DDP run, then zeroshard at stages 1 and 3 (with an adapter, stage 3, which shards the
    frozen base too; tests/test_peft.py runs LoRA at every stage): equal losses and trained parameters."""
    ddp = _trainer(root, name, stage=None, peft=peft)
    ddp.train()
    expected = {"losses": _losses(ddp), "params": _trained(ddp)}
    assert len(expected["losses"]) == 3
    for stage in (3,) if peft else (1, 3):
        with _loads_counted(name) as loads:
            trainer = _trainer(root, name, stage=stage, peft=peft)
        trainer.train()
        engine = trainer.engine
        assert engine.zero_optimization_stage() == stage
        got = {"losses": _losses(trainer), "params": _trained(trainer)}
        what = f"{name} stage {stage} peft {peft}"
        assert got["losses"] == expected["losses"], f"{what}: losses {got['losses']} vs DDP {expected['losses']}"
        for key, value in expected["params"].items():
            assert torch.equal(got["params"][key], value), f"{what}: '{key}' differs from DDP's"
        if stage == 3:
            _reference_sharded(trainer, name, peft)
            # DPO and KTO take `ref_model`: zeroshard builds it from the policy's directory shard by
            # shard, and TRL loads only the policy; GRPO loads its reference itself (sharded after).
            assert len(loads) == (2 if name == "grpo" and not peft else 1), loads
        for frozen in trainer.frozen_engines:
            frozen.destroy()
        engine.destroy()


@contextlib.contextmanager
def _loads_counted(name: str):
    """The models TRL's trainer `name` loads from a path (`create_model_from_path`) while inside."""
    import importlib

    module = importlib.import_module(f"trl.trainer.{name}_trainer")
    original, loads = module.create_model_from_path, []

    def counted(path, *args, **kwargs):
        loads.append(path)
        return original(path, *args, **kwargs)

    module.create_model_from_path = counted
    try:
        yield loads
    finally:
        module.create_model_from_path = original


def _reference_sharded(trainer, name: str, peft: bool) -> None:
    """Stage 3: a reference model other than the policy is a frozen stage-3 engine holding 1/N of it."""
    separate = name in ("dpo", "kto", "grpo") and not peft  # with PEFT the reference is the adapter-free base
    assert len(trainer.frozen_engines) == int(separate), trainer.frozen_engines
    if separate:
        (engine,) = trainer.frozen_engines
        assert engine.module is trainer.ref_model and engine.optimizer is None
        assert all(p.numel() == 0 for p in trainer.ref_model.parameters()), "reference parameters left whole"
        total = sum(g.layout.numel for g in engine.groups)
        held = sum(g.layout.shard_numel for g in engine.groups)
        world = torch.distributed.get_world_size()
        assert total / world <= held <= total / world + world * len(engine.groups), (held, total)
    assert "lm_head" not in [u.name.rsplit(".", 1)[-1] for u in trainer.engine.units]  # TRL's fused head reads it


def _grpo_gathering_per_unit(root: str) -> None:
    """`ds3_gather_for_generation=False`: each unit gathered per generation forward, the same run."""
    runs = {}
    for gather in (True, False):
        trainer = _trainer(root, "grpo", stage=3, peft=False, tag=f"-{gather}", ds3_gather_for_generation=gather)
        trainer.train()
        assert trainer.engine.config.zeroshard.generate_gather == ("whole" if gather else "units")
        runs[gather] = (_losses(trainer), _trained(trainer))
        trainer.engine.destroy()
    assert runs[True][0] == runs[False][0], runs
    assert all(torch.equal(runs[True][1][k], v) for k, v in runs[False][1].items())


def _logits(model, probe: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=probe).logits


def _saves_and_resumes(root: str, name: str, peft: bool) -> None:
    """Stage 3, 4 steps with a checkpoint at step 2: `save_model()` writes a model (or, with PEFT, an
    adapter) that `from_pretrained` (`PeftModel.from_pretrained`) loads with the engine's logits;
    a run resumed from the checkpoint has the straight run's losses and parameters."""
    import peft as peft_lib
    import transformers

    rank = torch.distributed.get_rank()
    steps = dict(max_steps=4, save_strategy="steps", save_steps=2)
    straight = _trainer(root, name, stage=3, peft=peft, tag="-save", **steps)
    straight.train()
    final = os.path.join(root, f"final-{name}-{peft}")
    straight.save_model(final)
    probe = torch.arange(3, 11).reshape(2, 4)  # (2, T)
    engine = straight.engine
    engine.eval()
    expected = {"losses": _losses(straight), "params": _trained(straight), "logits": _logits(engine, probe)}
    engine.destroy()
    base_dir = _model_dir(root, name) if peft else final  # (collective: every rank)
    if rank == 0:
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
        loaded = peft_lib.PeftModel.from_pretrained(base, final) if peft else base
        assert os.path.isfile(os.path.join(final, "adapter_model.safetensors" if peft else "model.safetensors"))
        reloaded = _logits(loaded.eval(), probe)
        assert torch.equal(reloaded, expected["logits"]), (
            f"{name}: logits differ by {(reloaded - expected['logits']).abs().max()}"
        )
    torch.distributed.barrier()
    resumed = _trainer(root, name, stage=3, peft=peft, tag="-resumed", **steps)
    resumed.train(resume_from_checkpoint=os.path.join(root, f"out-{name}-3-{peft}-save", "checkpoint-2"))
    assert _losses(resumed) == expected["losses"], (_losses(resumed), expected["losses"])
    for key, value in _trained(resumed).items():
        assert torch.equal(value, expected["params"][key]), f"{name} resumed: '{key}' differs"
    resumed.engine.destroy()


def _bf16_from_training_arguments(root: str) -> None:
    """`TrainingArguments(bf16=True)`, a config without a bf16 section: the engine trains in bf16."""
    trainer = _trainer(root, "sft", stage=3, peft=False, tag="-bf16", bf16=True)
    trainer.train()
    engine = trainer.engine
    assert engine.bfloat16_enabled() and engine.precision.param_dtype is torch.bfloat16
    losses = _losses(trainer)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    engine.destroy()


def _worker(rank: int, world_size: int, root: str) -> None:
    cases = [dict(case="parity", name=n, peft=p) for n in TRAINERS for p in (False, True)]
    cases += [dict(case="grpo_units"), dict(case="bf16")]
    cases += [dict(case="save", name="sft", peft=True), dict(case="save", name="dpo", peft=False)]

    def run(case: str, **kw):
        if case == "parity":
            return _parity(root, kw["name"], kw["peft"])
        if case == "save":
            return _saves_and_resumes(root, kw["name"], kw["peft"])
        if case == "bf16":
            return _bf16_from_training_arguments(root)
        return _grpo_gathering_per_unit(root)

    subtests(cases, run)


@pytest.mark.slow
def test_trl_trainers_match_ddp(tmp_path):
    run_distributed(_worker, 2, timeout=900, env=ENV, root=str(tmp_path))


@pytest.mark.slow
def test_documented_trl_script_runs_under_both_launchers(tmp_path):
    """docs/integrations.md's trl_dpo.py as `torchrun --nproc_per_node 2 trl_dpo.py` starts it
    (tests.harness.run_script: kept ranks in torchrun's environment) and under a real
    `accelerate launch --multi_gpu --num_processes 2 trl_dpo.py`: both ranks train with the reference
    model split over them, in bf16 as TRL's config asks where bf16 is supported."""
    write_titled_blocks(Path(__file__).resolve().parents[1] / "docs" / "integrations.md", tmp_path)
    expected = "reference model units ['model.layers.0', 'model.layers.1', '<root>']"
    for rank, stdout in enumerate(run_script(tmp_path / "trl_dpo.py", world_size=2, cwd=tmp_path, env=ENV)):
        assert f"rank {rank}: bf16 " in stdout and expected in stdout, stdout
    accelerate = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2"]
    env = {**os.environ, **ENV, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*accelerate, "trl_dpo.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert f"rank {rank}: bf16 " in done.stdout and expected in done.stdout, done.stdout
