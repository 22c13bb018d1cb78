"""HuggingFace transformers on zeroshard (2 gloo ranks, models built from configs, nothing
downloaded): GPT-2 (tied embeddings) and a Llama-style model (grouped-query attention, untied head)
train at every stage with the losses and parameters of DDP bit for bit, called with keywords and
returning ModelOutput; `generate` on the engine returns the tokens of the DDP-trained model and
leaves nothing gathered. The Trainer: a stage-3 `ZeroShardTrainer` run saves a model.safetensors
that `from_pretrained` loads with the engine's logits, and resuming from its checkpoint continues
exactly where the uninterrupted run goes."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import zeroshard
from tests.extras import needs
from tests.harness import run_distributed, run_script, subtests, write_titled_blocks
from tests.hf_models import ENV, SEQ, VOCAB, batches, causal_lm_loss, model_fn, prompt_and_length
from tests.reference import train_ddp
from tests.zs_common import adamw, assert_close, full_params, make_config
from zeroshard.core.unit import UnitState

pytestmark = needs("transformers", extra="hf")

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4


# -- models as they are, against DDP -------------------------------------------------------------------
def _against_ddp(kind: str, stage: int) -> None:
    from zeroshard.integrations.hf import generate

    rank = torch.distributed.get_rank()
    ref = train_ddp(model_fn(kind), batches, optimizer_fn=adamw, steps=STEPS, loss_fn=causal_lm_loss)
    model = model_fn(kind)()
    engine, *_ = zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config=make_config(stage))
    blocks = "transformer.h" if kind == "gpt2" else "model.layers"
    assert [u.name for u in engine.units] == [f"{blocks}.0", f"{blocks}.1", "<root>"]
    ours = {"losses": []}
    for step in range(STEPS):
        loss = causal_lm_loss(engine, *batches(step, 0, rank))
        engine.backward(loss)
        engine.step()
        ours["losses"].append([loss.item()])
    ours["params"] = full_params(engine)
    assert_close(ours, ref, exact=True, what=f"{kind} at stage {stage}")

    oracle = model_fn(kind)()  # the DDP-trained weights in a plain model
    loaded = oracle.load_state_dict(ref["params"], strict=False)
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {"lm_head.weight"}, loaded  # tied head
    oracle.eval()
    engine.eval()
    prompt, new_tokens = prompt_and_length(rank)
    kwargs = dict(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones_like(prompt)
    )
    expected = oracle.generate(prompt, **kwargs)
    layers = [unit for unit in engine.units if unit.name != "<root>"]
    gathered_layers = []  # at each layer's forward: how many layers are gathered
    probes = [
        unit.module.register_forward_pre_hook(
            lambda module, args: gathered_layers.append(sum(u.state is UnitState.UNSHARDED for u in layers))
        )
        for unit in layers
    ]
    got = generate(engine, prompt, **kwargs)
    for probe in probes:
        probe.remove()
    assert torch.equal(got, expected), f"{kind} stage {stage}: generate gave\n{got}\nDDP model gave\n{expected}"
    forwards = 8 if stage == 3 else new_tokens  # stage 3: as many as the longest rank's (synced_gpus)
    assert len(gathered_layers) == forwards * len(layers), len(gathered_layers)
    if stage == 3:  # one layer at a time, and nothing left afterwards
        assert set(gathered_layers) == {1}, gathered_layers
        assert all(p.numel() == 0 for p in engine.module.parameters()), "parameters left gathered"
    engine.destroy()


def _models_worker(rank: int, world_size: int) -> None:
    subtests([dict(kind=k, stage=s) for k in ("gpt2", "llama") for s in (0, 1, 2, 3)], _against_ddp)


def test_transformers_models_match_ddp_and_generate():
    run_distributed(_models_worker, 2, timeout=300, env=ENV)


# -- Hugging Face's sharded layout ------------------------------------------------------------------------
def _export_case(kind: str, out: str) -> None:
    """Stage 3, trained 2 steps: `engine.save_hf_model` (config.json included) and `zeroshard consolidate
    --format hf` of a checkpoint write several shards and an index that from_pretrained loads, with the
    engine's logits bit for bit."""
    import json

    import transformers

    from zeroshard.checkpoint import consolidate

    rank = torch.distributed.get_rank()
    model = model_fn(kind)()
    config = make_config(3, stage3_param_persistence_threshold=0)
    engine, *_ = zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config=config)
    for step in range(2):
        engine.backward(causal_lm_loss(engine, *batches(step, 0, rank)))
        engine.step()
    root = Path(out) / kind
    assert engine.save_hf_model(root / "engine", max_shard_size="40KB") == str(root / "engine")
    engine.save_checkpoint(root / "ckpt")
    probe = torch.arange(2, 2 + SEQ).reshape(2, SEQ // 2)  # (2, T/2)
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=probe).logits
    engine.destroy()
    if rank != 0:
        return
    consolidate(root / "ckpt", root / "cli", fmt="hf", max_shard_size="40KB", progress=False)
    (root / "cli" / "config.json").write_text((root / "engine" / "config.json").read_text())
    for directory in ("engine", "cli"):
        index = json.loads((root / directory / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
        assert all((root / directory / f).stat().st_size <= 40_000 + 4 * 32 * VOCAB + 1024 for f in files)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(root / directory).eval()
        with torch.no_grad():
            reloaded = loaded(input_ids=probe).logits
        assert torch.equal(reloaded, logits), f"{kind} {directory}: logits differ by {(reloaded - logits).abs().max()}"


def _export_worker(rank: int, world_size: int, out: str) -> None:
    subtests([dict(kind=k, out=out) for k in ("gpt2", "llama")], _export_case)


def test_hugging_face_export_loads_with_from_pretrained(tmp_path):
    run_distributed(_export_worker, 2, timeout=300, env=ENV, out=str(tmp_path))


# -- the Trainer ---------------------------------------------------------------------------------------
class CountingDataset(torch.utils.data.Dataset):
    """16 rows that count up from a start fixed by the row index."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict:
        start = torch.randint(2, VOCAB, (1,), generator=torch.Generator().manual_seed(index))
        ids = (start + torch.arange(SEQ)) % VOCAB  # (T,)
        return {"input_ids": ids, "labels": ids}


def _trainer(output_dir: str, **overrides):
    import transformers

    from zeroshard.integrations.hf import ZeroShardTrainer

    settings = dict(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        max_steps=4,
        save_steps=2,
        logging_steps=1,
        learning_rate=1e-2,
        warmup_steps=1,
        weight_decay=0.1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    args = transformers.TrainingArguments(**{**settings, **overrides})
    config = {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_clipping": "auto",
    }
    return ZeroShardTrainer(
        model=model_fn("gpt2")(),
        args=args,
        train_dataset=CountingDataset(),
        eval_dataset=CountingDataset(),
        zeroshard_config=config,
    )


def _losses(trainer) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


def _trainer_worker(rank: int, world_size: int, out: str) -> None:
    import transformers

    probe = torch.arange(2, 2 + SEQ).reshape(2, SEQ // 2)  # (2, T/2)
    first = _trainer(os.path.join(out, "run"))
    first.train()
    engine = first.engine
    assert engine.zero_optimization_stage() == 3 and engine.global_steps == 4
    eval_loss = first.evaluate()["eval_loss"]  # the module's hooks gather what evaluation runs
    assert 0 < eval_loss < _losses(first)[1], eval_loss
    final = os.path.join(out, "final")
    first.save_model(final)
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=probe).logits
    expected_params, expected_losses = full_params(engine), _losses(first)
    engine.destroy()
    if rank == 0:
        weights = os.path.join(final, "model.safetensors")
        numel = sum(p.numel() for p in expected_params.values())
        assert os.path.getsize(weights) >= 4 * numel, f"{weights}: {os.path.getsize(weights)} bytes for {numel} params"
        loaded = transformers.AutoModelForCausalLM.from_pretrained(final).eval()
        assert loaded.lm_head.weight is loaded.transformer.wte.weight, "tied weights not tied after loading"
        with torch.no_grad():
            reloaded = loaded(input_ids=probe).logits
        assert torch.equal(reloaded, logits), f"logits differ by {(reloaded - logits).abs().max()}"

    resumed = _trainer(os.path.join(out, "resumed"))
    resumed.train(resume_from_checkpoint=os.path.join(out, "run", "checkpoint-2"))
    assert resumed.engine.global_steps == 4
    assert _losses(resumed) == expected_losses  # steps 1-2 from the checkpoint's trainer state, 3-4 run again
    for name, value in full_params(resumed.engine).items():
        assert torch.equal(value, expected_params[name]), f"resumed run differs at '{name}'"
    resumed.engine.destroy()
    _accumulation(os.path.join(out, "accumulation"))


def _accumulation(out: str) -> None:
    """Gradient accumulation at stage 3: 2 micro-batches of 1 row train as 1 batch of 2 does (the
    same 4 rows a step over both ranks; the engine accumulates, the Trainer's no_sync stays out)."""
    trained = {}
    for gas in (1, 2):
        trainer = _trainer(
            os.path.join(out, f"gas{gas}"), per_device_train_batch_size=2 // gas, gradient_accumulation_steps=gas,
            max_steps=2, save_strategy="no",
        )  # fmt: skip
        trainer.train()
        assert trainer.engine.global_steps == 2
        trained[gas] = (_losses(trainer), full_params(trainer.engine))
        trainer.engine.destroy()
    (losses, params), (accumulated_losses, accumulated) = trained[1], trained[2]
    for step, loss in losses.items():
        assert abs(accumulated_losses[step] - loss) <= 1e-5, (accumulated_losses, losses)
    for name, value in params.items():
        assert (accumulated[name] - value).abs().max().item() <= 1e-5, f"accumulated run differs at '{name}'"


def test_trainer_saves_loadable_model_and_resumes(tmp_path):
    pytest.importorskip("accelerate", reason="the [hf] extra installs it; `make test` does")
    run_distributed(_trainer_worker, 2, timeout=300, env=ENV, out=str(tmp_path))


# -- the documented examples ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("script", ["hf_train.py", "trainer_train.py"])
def test_documented_example_runs_on_two_ranks(script, tmp_path):
    """As `torchrun --nproc_per_node 2 SCRIPT` starts it (tests.harness.run_script); the scripts end by
    destroying their process group, which retires the ranks."""
    pytest.importorskip("accelerate", reason="the [hf] extra installs it; `make test` does")
    write_titled_blocks(ROOT / "docs" / "integrations.md", tmp_path)
    stdout = "\n".join(run_script(tmp_path / script, world_size=2, cwd=tmp_path, env=ENV, timeout=300))
    if script == "hf_train.py":  # the reloaded model generates what the engine generated on rank 0
        generated = re.search(r"rank 0: \[[\d, ]+\] -> (\[[\d, ]+\])", stdout)
        assert generated and f"reloaded: {generated.group(1)}" in stdout, stdout
        assert "'model.layers.0', 'model.layers.1', '<root>'" in stdout, stdout
    else:
        assert "loaded 112384 parameters from trainer-out/final" in stdout, stdout
        assert (tmp_path / "trainer-out" / "checkpoint-16" / "global_step16" / "manifest.json").is_file()
