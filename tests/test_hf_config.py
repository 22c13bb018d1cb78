"""The Trainer's settings in the zeroshard config (`zeroshard.integrations.hf_config.trainer_config`),
as transformers' DeepSpeed integration fills a DeepSpeed config: missing or "auto" keys take the
TrainingArguments values, explicit ones must agree, and every difference is named in one error."""

from __future__ import annotations

import pytest

from tests.extras import needs
from zeroshard.config import ConfigError
from zeroshard.integrations.hf_config import trainer_config

pytestmark = needs("transformers", extra="hf")


def _args(**overrides):
    import transformers

    settings = dict(
        output_dir="unused",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
        max_grad_norm=0.5,
        learning_rate=1e-3,
        adam_beta1=0.8,
        adam_beta2=0.95,
        adam_epsilon=1e-7,
        weight_decay=0.1,
        warmup_steps=0.25,
        use_cpu=True,
        report_to=[],
    )
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


def test_missing_and_auto_values_take_the_trainers():
    config = {
        "zero_optimization": {"stage": 3},
        "train_micro_batch_size_per_gpu": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
    }
    out = trainer_config(config, _args(), max_steps=10, world_size=4)
    assert out["train_micro_batch_size_per_gpu"] == 2 and out["gradient_accumulation_steps"] == 3
    assert out["train_batch_size"] == 24 and out["gradient_clipping"] == 0.5
    assert out["bf16"] == {"enabled": False} and "fp16" not in out
    assert out["optimizer"]["params"] == {"lr": 1e-3, "betas": [0.8, 0.95], "eps": 1e-7, "weight_decay": 0.1}
    assert out["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 1e-3,
        "warmup_num_steps": 3,  # ceil(0.25 * 10)
        "total_num_steps": 10,
    }
    assert config["train_micro_batch_size_per_gpu"] == "auto", "the caller's dict was changed"
    no_warmup = trainer_config({"scheduler": {"params": {"warmup_num_steps": "auto"}}}, _args(warmup_steps=0), 10, 1)
    assert no_warmup["scheduler"]["params"]["warmup_num_steps"] == 1  # as transformers: at least one


def test_precision_follows_the_trainer_and_a_config_that_sets_it_stays():
    assert trainer_config({}, _args(bf16=True), 10, 1)["bf16"] == {"enabled": True}
    assert trainer_config({}, _args(fp16=True, use_cpu=False), 10, 1)["fp16"] == {"enabled": True}
    assert trainer_config({"bf16": {"enabled": "auto"}}, _args(bf16_full_eval=True), 10, 1)["bf16"]["enabled"]
    kept = trainer_config({"bf16": {"enabled": True}}, _args(), 10, 1)  # bf16=False: the Trainer's default
    assert kept["bf16"] == {"enabled": True} and "fp16" not in kept


def test_every_difference_is_named_in_one_error():
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "train_batch_size": 99,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.95]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 7}},
    }
    with pytest.raises(ConfigError) as raised:
        trainer_config(config, _args(bf16=True), max_steps=10, world_size=2)
    message = str(raised.value)
    for line in (
        "config train_micro_batch_size_per_gpu=4 vs TrainingArguments per_device_train_batch_size=2",
        "config train_batch_size=99 vs TrainingArguments world size x per_device_train_batch_size x gas=12",
        "config gradient_clipping=1.0 vs TrainingArguments max_grad_norm=0.5",
        "config bf16.enabled=False vs TrainingArguments bf16|bf16_full_eval=True",
        "config optimizer.params.lr=0.0003 vs TrainingArguments learning_rate=0.001",
        "config scheduler.params.warmup_num_steps=7 vs TrainingArguments warmup_steps=3",
    ):
        assert f"- {line}" in message, message
    assert "betas" not in message and "warmup_max_lr" not in message  # those agree
    assert 'set these config values to "auto"' in message


def test_trl_generation_gathering_maps_to_generate_gather():
    trl = pytest.importorskip("trl", reason="the [hf] extra installs it; `make test` does")

    def grpo(gather: bool):
        return trl.GRPOConfig(
            output_dir="unused", use_cpu=True, report_to=[], bf16=False, ds3_gather_for_generation=gather
        )

    assert trainer_config({}, grpo(True), 10, 1)["zeroshard"]["generate_gather"] == "whole"
    assert trainer_config({}, grpo(False), 10, 1)["zeroshard"]["generate_gather"] == "units"
    with pytest.raises(ConfigError, match="zeroshard.generate_gather='units' vs TrainingArguments ds3_gather"):
        trainer_config({"zeroshard": {"generate_gather": "units"}}, grpo(True), 10, 1)
    assert "zeroshard" not in trainer_config({}, _args(), 10, 1)  # a Trainer without the setting
