"""HuggingFace transformers on zeroshard: `generate` on a sharded engine, and `ZeroShardTrainer`,
a `transformers.Trainer` that trains through a zeroshard engine instead of DeepSpeed.

transformers models need nothing else: the default wrap policy makes each decoder layer (the
blocks of the model's largest `nn.ModuleList`) a unit, and an untied LM head of at least half a
layer's size too; the root unit holds the embeddings, the final norm and a tied head (a tied
embedding and head are one parameter, owned once), keyword-only
calls reach the model through `engine(**batch)`, and the lifecycle hooks the tensors inside a
`ModelOutput`. `HfDeepSpeedConfig` and `is_deepspeed_zero3_enabled` replace transformers' own in
DeepSpeed scripts (hf_deepspeed.py). Requires `pip install zeroshard[hf]`; nothing in the core imports this module.
"""

from __future__ import annotations

import os

import torch
import transformers
from transformers.trainer import SCHEDULER_NAME

from zeroshard.checkpoint import full_state_dict
from zeroshard.compat.api import initialize
from zeroshard.config import ConfigError, read_config
from zeroshard.core.unit import UnitState
from zeroshard.integrations.hf_deepspeed import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

__all__ = ["HfDeepSpeedConfig", "ZeroShardTrainer", "generate", "is_deepspeed_zero3_enabled", "trainer_config"]


def generate(engine, *args, **kwargs):
    """`engine.generate(*args, **kwargs)`: `engine.module.generate` under `torch.no_grad()`, safe on a
    stage-3 engine of several ranks (`synced_gpus`, or the whole model gathered once, as the config's
    `zeroshard.generate_gather` says: `EngineBase.generate`). Nothing stays gathered afterwards
    (checked). The train/eval mode is left as it is: call `engine.eval()` first for deterministic
    dropout-free decoding."""
    output = engine.generate(*args, **kwargs)
    gathered = [unit.name for unit in engine.units if unit.reshards and unit.state is not UnitState.SHARDED]
    assert not gathered, f"units left gathered after generate(): {gathered}"
    return output


# -- the Trainer ------------------------------------------------------------------------------------


def trainer_config(config, args: transformers.TrainingArguments, max_steps: int) -> dict:
    """The DeepSpeed-style `config` (dict or JSON path) with the values the Trainer owns filled in,
    as the DeepSpeed integration of transformers does: batch sizes, accumulation and clipping from
    `args` when missing or "auto" (a different explicit value is an error, the Trainer's loop and the
    engine must count the same micro steps); "auto" optimizer and scheduler parameters from the
    learning rate, Adam betas/epsilon, weight decay, warmup and total steps."""
    config = read_config(config)
    if args.fp16 or args.bf16:
        raise ConfigError(
            "ZeroShardTrainer: set precision in the zeroshard config ('bf16': {'enabled': true} or "
            "'fp16'), not with TrainingArguments(fp16/bf16), which would autocast on top of it"
        )
    owned = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "gradient_clipping": args.max_grad_norm,
    }
    for key, value in owned.items():
        given = config.get(key, "auto")
        if given != "auto" and given != value:
            raise ConfigError(
                f"config '{key}' is {given!r} but TrainingArguments give {value!r}: remove it from "
                'the config, set it to "auto", or make them agree'
            )
        config[key] = value
    config.pop("train_batch_size", None)  # derived from the two above and the world size
    lr = args.learning_rate
    fill = {
        "lr": lr,
        "betas": [args.adam_beta1, args.adam_beta2],
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": lr,
        "warmup_num_steps": args.get_warmup_steps(max_steps),
        "total_num_steps": max_steps,
    }
    for section in ("optimizer", "scheduler"):
        if section in config:
            params = dict(config[section].get("params", {}))
            params.update({k: fill[k] for k, v in params.items() if v == "auto" and k in fill})
            config[section] = {**config[section], "params": params}
    return config


class _SteppedByEngine:
    """What the Trainer holds as its optimizer (or scheduler, when the config's `scheduler` section
    makes it the engine's): the engine already stepped inside `training_step`, so `step` does
    nothing; learning rates and param groups are the engine's."""

    def __init__(self, engine):
        self.engine = engine

    @property
    def param_groups(self):
        return self.engine.optimizer.param_groups

    def step(self, *args, **kwargs) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return self.engine.get_lr()

    def state_dict(self) -> dict:  # the engine's checkpoint holds the real state
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class ZeroShardTrainer(transformers.Trainer):
    """`transformers.Trainer` with a zeroshard engine in place of DDP or DeepSpeed.

        trainer = ZeroShardTrainer(model=model, args=TrainingArguments(...), train_dataset=...,
                                   zeroshard_config="ds_config.json")   # a DeepSpeed-style config

    Do not set `TrainingArguments.deepspeed`: the config goes to `zeroshard_config`. The optimizer
    is the Trainer's (`create_optimizer`, or `optimizers=`) unless the config has an `optimizer`
    section; likewise the scheduler. `save_model()` (collective: call it on every rank) writes the
    full model with `save_pretrained` from rank 0; checkpoints also hold the engine's sharded
    checkpoint (`global_step<N>/`, `latest`), from which `train(resume_from_checkpoint=...)`
    restores weights, optimizer state and counters.
    """

    def __init__(self, *args, zeroshard_config=None, **kwargs):
        # The hooks below are those of transformers 5 (`_prepare_for_training` builds the engine where
        # Trainer runs accelerator.prepare); without them Trainer would wrap the model in DDP.
        if not hasattr(transformers.Trainer, "_prepare_for_training"):
            raise ImportError(
                f"ZeroShardTrainer needs transformers>=5.24 (installed: {transformers.__version__}): "
                "pip install 'zeroshard[hf]'"
            )
        super().__init__(*args, **kwargs)
        if self.args.deepspeed:
            raise ConfigError(
                "ZeroShardTrainer: pass the config as zeroshard_config=..., not TrainingArguments("
                "deepspeed=...): that makes transformers set up the deepspeed package (its "
                "HfDeepSpeedConfig looks up the installed deepspeed distribution, which zeroshard "
                "is not); see docs/integrations.md, 'ZeRO-3 with transformers'"
            )
        self.zeroshard_config = zeroshard_config if zeroshard_config is not None else {}
        self.engine = None

    # -- building the engine: replaces the Trainer's accelerator.prepare(model, optimizer) ---------
    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        gas = self.args.gradient_accumulation_steps
        if len(train_dataloader) % gas and max_steps > len(train_dataloader) // gas:
            raise ValueError(
                f"{len(train_dataloader)} batches per epoch are not a multiple of gradient_accumulation_"
                f"steps={gas}: the engine counts accumulation across epochs, the Trainer restarts it"
            )
        if self._created_lr_scheduler:  # as Trainer: a new train() call gets a new scheduler
            self.lr_scheduler, self._created_lr_scheduler = None, False
        if self.engine is None:
            self._build_engine(max_steps)
        if self.engine.lr_scheduler is not None:
            self.lr_scheduler = _SteppedByEngine(self.engine)
        else:
            self.create_scheduler(max_steps, optimizer=self.engine.optimizer.optimizer)
        self.optimizer = _SteppedByEngine(self.engine)
        self.model_wrapped = self.engine
        if resume_from_checkpoint is not None:  # weights, optimizer state, counters; then the Trainer's scheduler
            self.engine.load_checkpoint(resume_from_checkpoint)
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.engine, train_dataloader

    def _build_engine(self, max_steps: int) -> None:
        config = trainer_config(self.zeroshard_config, self.args, max_steps)
        if "scheduler" in config and self.lr_scheduler is not None:
            raise ConfigError(
                "a scheduler was given to Trainer(optimizers=...) and the zeroshard config has a "
                "'scheduler' section: give exactly one"
            )
        optimizer = None if "optimizer" in config else self.create_optimizer()
        self.engine, *_ = initialize(model=self.model, optimizer=optimizer, config=config)

    # -- one micro step -------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Forward and backward through the engine, then `engine.step()`, which steps the optimizer
        at accumulation boundaries. The loss keeps the Trainer's semantics (a per-batch mean divided
        by the accumulation steps, or already normalised by `num_items_in_batch`)."""
        engine = self.engine
        engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(engine, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if self._loss_is_scaled_for_ga(num_items_in_batch):
            engine.backward(loss * engine.gradient_accumulation_steps())  # the engine divides again
            reported = loss
        else:
            engine.backward(loss)
            reported = loss / engine.gradient_accumulation_steps()
        engine.step()
        return reported.detach()

    def _loss_is_scaled_for_ga(self, num_items_in_batch) -> bool:
        if self.loss_is_scaled_for_ga is not None:  # as Trainer.training_step decides it
            return self.loss_is_scaled_for_ga
        return (
            bool(self.model_accepts_loss_kwargs and num_items_in_batch is not None)
            or self.compute_loss_func is not None
        )

    def _clip_grad_norm(self, model):
        """The engine clipped (config `gradient_clipping`) while stepping; report its norm."""
        return self.engine.get_global_grad_norm()

    def _get_grad_norm(self, model, grad_norm=None):
        return self.engine.get_global_grad_norm() if self.engine is not None else grad_norm

    # -- saving and loading ---------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The full model, gathered to rank 0 and written by `save_pretrained` (model.safetensors,
        config). Collective: every rank calls it, as the Trainer itself does."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        state_dict = full_state_dict(self.engine)  # rank 0 holds it, {} elsewhere
        self._save(output_dir or self.args.output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(output_dir, tag=f"global_step{self.state.global_step}")
        if (
            self.args.should_save
            and self.lr_scheduler is not None
            and not isinstance(self.lr_scheduler, _SteppedByEngine)
        ):
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """`train()` calls this before `_prepare_for_training`, where the engine (built first, if
        need be) loads the checkpoint: nothing to do here."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        path = os.path.join(checkpoint or "", SCHEDULER_NAME)
        if (
            checkpoint is not None
            and self.lr_scheduler is not None
            and not isinstance(self.lr_scheduler, _SteppedByEngine)
            and os.path.isfile(path)
        ):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    def _load_best_model(self) -> None:
        self.engine.load_checkpoint(self.state.best_model_checkpoint, load_module_only=True)
