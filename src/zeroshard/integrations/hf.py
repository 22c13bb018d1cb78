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

import copy
import inspect
import os

import torch
import transformers
from transformers.trainer import SCHEDULER_NAME

from zeroshard.checkpoint import full_state_dict
from zeroshard.compat.api import initialize
from zeroshard.compat.inference import from_pretrained
from zeroshard.compat.ulysses_sp import UlyssesSPDataLoaderAdapter
from zeroshard.config import ConfigError, read_config
from zeroshard.core.unit import UnitState
from zeroshard.core.wrap import block_classes
from zeroshard.inference.pretrained import meta_model
from zeroshard.integrations.hf_config import trainer_config
from zeroshard.integrations.hf_deepspeed import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

__all__ = [
    "HfDeepSpeedConfig",
    "ZeroShardTrainer",
    "generate",
    "is_deepspeed_zero3_enabled",
    "trainer_config",
    "zeroshard_trainer",
]


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

    Any other Trainer subclass (TRL's `SFTTrainer`, `DPOTrainer`, ...) becomes a zeroshard one with
    `zeroshard_trainer(TrainerClass)`. Do not set `TrainingArguments.deepspeed`: the config goes to
    `zeroshard_config`, and the TrainingArguments fill it where it says "auto" or nothing, as
    transformers' DeepSpeed integration does (hf_config.py): batch sizes, accumulation, clipping,
    bf16/fp16, the optimizer's and scheduler's parameters. The optimizer is the Trainer's
    (`create_optimizer`, or `optimizers=`) unless the config has an `optimizer` section; likewise the
    scheduler. At stage 3 a reference model (`self.ref_model`, TRL's) and reward models
    (`self.reward_funcs`) are sharded too, as frozen engines without an optimizer. `save_model()`
    (collective: call it on every rank) writes the full model, or a PEFT model's adapters, with
    `save_pretrained` from rank 0; checkpoints also hold the engine's sharded checkpoint
    (`global_step<N>/`, `latest`), from which `train(resume_from_checkpoint=...)` restores weights,
    optimizer state and counters.
    """

    def __init__(self, *args, zeroshard_config=None, **kwargs):
        # The hooks below are those of transformers 5 (`_prepare_for_training` builds the engine where
        # Trainer runs accelerator.prepare); without them Trainer would wrap the model in DDP.
        if not hasattr(transformers.Trainer, "_prepare_for_training"):
            raise ImportError(
                f"ZeroShardTrainer needs transformers>=5.24 (installed: {transformers.__version__}): "
                "pip install 'zeroshard[hf]'"
            )
        if zeroshard_config is not None or not hasattr(self, "zeroshard_config"):  # zeroshard_trainer sets it first
            self.zeroshard_config = zeroshard_config if zeroshard_config is not None else {}
        self.engine = None
        self.frozen_engines: list = []  # the reference and reward models' engines (stage 3)
        super().__init__(*args, **kwargs)
        if self.args.deepspeed:
            raise ConfigError(
                "ZeroShardTrainer: pass the config as zeroshard_config=..., not TrainingArguments("
                "deepspeed=...): that makes transformers set up the deepspeed package (its "
                "HfDeepSpeedConfig looks up the installed deepspeed distribution, which zeroshard "
                "is not); see docs/integrations.md, 'ZeRO-3 with transformers'"
            )

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator, told to sync on every batch: the engine accumulates gradients
        itself (its `gradient_accumulation_steps`, stepping at the boundary), so the Trainer's
        `no_sync` around the other micro-batches, which a stage-2/3 engine refuses as DeepSpeed's does,
        must not reach it (the Trainer skips it for DeepSpeed's engine the same way)."""
        super().create_accelerator_and_postprocess()
        self.accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = True

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
        sequence = self.engine.sharded.sequence_parallel
        if sequence is not None:  # each batch trained by the whole sp group, a shard on each rank
            pad = getattr(self.processing_class, "pad_token_id", None)
            train_dataloader = UlyssesSPDataLoaderAdapter(
                train_dataloader,
                sp_rank=sequence.rank,
                sp_group=sequence.comm.group,
                sp_world_size=sequence.size,
                device=self.args.device,
                pad_token_id=pad if isinstance(pad, int) else 0,
            )
        if resume_from_checkpoint is not None:  # weights, optimizer state, counters; then the Trainer's scheduler
            self.engine.load_checkpoint(resume_from_checkpoint)
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.engine, train_dataloader

    def _build_engine(self, max_steps: int) -> None:
        assert self.model is not None  # Trainer requires a model (or model_init) before train()
        sp = self.get_sp_size()
        if sp > 1 and type(self).compute_loss is not ZeroShardTrainer.compute_loss:
            refusal = _token_sum_loss_refusal(self)
            if refusal:
                raise ConfigError(
                    f"sequence_parallel_size {sp} with {type(self).__name__}, whose compute_loss is its own: "
                    f"{refusal}. Sequence parallelism is supported with ZeroShardTrainer and with TRL's "
                    "SFTTrainer's token loss ([Note: a trainer's own loss under sequence parallelism])"
                )
        config = trainer_config(self.zeroshard_config, self.args, max_steps, self.args.world_size // sp)
        config = _fit_model(config, self.model)
        if "scheduler" in config and self.lr_scheduler is not None:
            raise ConfigError(
                "a scheduler was given to Trainer(optimizers=...) and the zeroshard config has a "
                "'scheduler' section: give exactly one"
            )
        stage = config.get("zero_optimization", {}).get("stage", 0)
        if stage == 3 and getattr(self.args, "sync_ref_model", False):
            raise ConfigError(
                "sync_ref_model=True (TR-DPO) at zero_optimization.stage 3: it mixes the policy's "
                "parameters into the reference model's in place, which at stage 3 are 1/N shards of "
                "differently laid out models; use stage 0-2, or sync_ref_model=False"
            )
        optimizer = None if "optimizer" in config else self.create_optimizer()
        self.engine, *_ = initialize(model=self.model, optimizer=optimizer, config=config)
        if stage == 3:
            self._shard_frozen_models(config)

    def _shard_frozen_models(self, config: dict) -> None:
        """Stage 3: the reference model (TRL's `ref_model`) and reward models held as frozen stage-3
        engines, 1/N of each on a rank, as DeepSpeed's ZeRO-3 holds them in TRL. Their calls reach
        the module itself (TRL calls `self.ref_model(...)`), whose units gather on each call ([Note:
        calls below a unit's module] in core/wrap.py). A reference model `zeroshard_trainer` built
        from the policy's directory is one already."""
        models = [getattr(self, "ref_model", None), *getattr(self, "reward_funcs", [])]
        held = {id(engine.module) for engine in self.frozen_engines}
        for model in models:
            if not isinstance(model, torch.nn.Module) or model is self.model or id(model) in held:
                continue
            if any(True for _ in model.parameters()):
                engine, *_ = initialize(model=model, config=_fit_model(_frozen_config(config), model))
                self.frozen_engines.append(engine)

    def _wrap_model(self, model, training=True, dataloader=None):
        """Evaluation runs through the engine once it exists (Trainer would prepare the bare module
        with Accelerate, which adds its autocast to the module's forward)."""
        if self.engine is not None and not training:
            return self.engine
        return super()._wrap_model(model, training, dataloader)

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

    # -- sequence parallelism ([Note: Ulysses sequence parallelism] in core/sequence.py) --------------
    def get_sp_size(self) -> int:
        """The config's `sequence_parallel_size`: the Trainer counts the adapter's batches (each
        dataloader batch once per sp rank) and the data-parallel ranks (world / sp) by it."""
        size = read_config(self.zeroshard_config).get("sequence_parallel_size", 1)
        return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 1

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Under sequence parallelism: the whole sequences' mean token loss from this rank's shard
        (its `shift_labels`), on every sp rank; otherwise the Trainer's."""
        sequence = self.engine.sharded.sequence_parallel if self.engine is not None else None
        if sequence is None or "shift_labels" not in inputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs.pop("shift_labels")  # (B, S/sp)
        outputs = model(**inputs)
        logits = outputs.logits.float()  # (B, S/sp, V)
        summed = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        loss = sequence.whole_loss(summed, (labels != -100).sum())
        return (loss, outputs) if return_outputs else loss

    def _get_num_items_in_batch(self, batch_samples: list, device):
        """Under sequence parallelism, for a trainer with its own token loss: the real tokens of the
        adapter's batches, counted from their `shift_labels` (the labels shifted over the whole
        sequence, then cut) on every rank, so each shard once ([Note: a trainer's own loss under
        sequence parallelism]). Otherwise the Trainer's count."""
        own_loss = type(self).compute_loss is not ZeroShardTrainer.compute_loss
        if not (own_loss and self.get_sp_size() > 1 and batch_samples and "shift_labels" in batch_samples[0]):
            return super()._get_num_items_in_batch(batch_samples, device)
        count = sum((batch["shift_labels"] != -100).sum() for batch in batch_samples)
        return self.accelerator.gather(count.to(device)).sum()

    def evaluate(self, *args, **kwargs):
        if self.get_sp_size() > 1:
            raise ConfigError(
                f"evaluate() with sequence_parallel_size {self.get_sp_size()}: evaluation batches are not "
                "sharded over the sequence; evaluate with a trainer without sequence parallelism"
            )
        return super().evaluate(*args, **kwargs)

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
        config); of a PEFT model only the trainable parameters (the adapters) are gathered, and its
        `save_pretrained` writes the adapter. Collective: every rank calls it, as the Trainer itself
        does."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        model = self.engine.module
        if hasattr(model, "peft_config"):
            trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
            with self.engine.gathered_parameters([p for _, p in trainable]):
                rank0 = self.engine.global_rank == 0
                state_dict = {name: p.detach().clone() for name, p in trainable} if rank0 else {}
        else:
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


def _token_sum_loss_refusal(trainer) -> str:
    """[Note: a trainer's own loss under sequence parallelism]
    Each rank holds a shard of every sequence, so a loss is right under sequence parallelism only if
    it is a sum over the shard's tokens divided by a count of the whole sequences' tokens: the sum of
    the ranks' terms is then the whole sequences' loss. TRL's SFTTrainer computes exactly that with its
    default NLL loss: the summed token losses of its fused head (which reads the adapter's
    `shift_labels`) over `num_items_in_batch`, times the number of processes when the Trainer averages
    tokens across devices (its default), since gradients are averaged over every rank. The count is the
    Trainer's own, taken from the adapter's `shift_labels` on every rank (`_get_num_items_in_batch`).
    Losses over whole sequences (DPO's, KTO's, GRPO's per-sequence log-probabilities), label smoothing,
    DFT, a `compute_loss_func` and MoE auxiliary losses are per shard there, so they are refused.
    Returns why this trainer's loss is refused, or "" when it is supported."""
    own = "ZeroShardTrainer computes the loss of a sequence's shards itself"
    try:
        import trl
    except ImportError:
        return own
    if not isinstance(trainer, trl.SFTTrainer):
        return own
    args = trainer.args
    loss_type = getattr(args, "loss_type", "nll")
    if loss_type != "nll":
        return f"SFTConfig(loss_type={loss_type!r}) weighs each token by the shard's own probabilities"
    if trainer.compute_loss_func is not None or args.label_smoothing_factor > 0:
        return "a compute_loss_func or label smoothing needs the whole sequence's logits"
    if getattr(trainer, "aux_loss_enabled", False):
        return "a router's auxiliary loss is a mean over the shard's tokens"
    if not args.average_tokens_across_devices:
        return "average_tokens_across_devices=False divides each shard by its own tokens"
    if not trainer.model_accepts_loss_kwargs:
        return "the model takes no loss kwargs, so the Trainer divides each shard's loss by its own tokens"
    return ""


def zeroshard_trainer(trainer_class: type) -> type:
    """`trainer_class` (a `transformers.Trainer` subclass: TRL's `SFTTrainer`, `DPOTrainer`,
    `RewardTrainer`, `KTOTrainer`, `GRPOTrainer`, or your own) training through a zeroshard engine:

        DPO = zeroshard_trainer(trl.DPOTrainer)
        trainer = DPO(model=..., args=trl.DPOConfig(...), train_dataset=..., zeroshard_config=config)

    The class is `trainer_class` first and `ZeroShardTrainer` below it, so the subclass's own
    `training_step` and `compute_loss` run and reach ZeroShardTrainer's through `super()` (TRL's
    GRPO counts its generation steps there); `zeroshard_config` is taken before the subclass's
    `__init__`, whose signature does not know it. At stage 3 a reference model TRL would load whole
    from the policy's local directory is built from it shard by shard instead
    (`_reference_from_directory`)."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(f"zeroshard_trainer({trainer_class!r}): a transformers.Trainer subclass")
    if issubclass(trainer_class, ZeroShardTrainer):
        return trainer_class

    def __init__(self, *args, zeroshard_config=None, **kwargs):
        self.zeroshard_config = zeroshard_config if zeroshard_config is not None else {}
        reference = _reference_from_directory(trainer_class, self.zeroshard_config, kwargs)
        if reference is not None:
            kwargs["ref_model"] = reference.module
        trainer_class.__init__(self, *args, **kwargs)
        if reference is not None:
            self.frozen_engines.append(reference)

    name = f"ZeroShard{trainer_class.__name__}"
    return type(name, (trainer_class, ZeroShardTrainer), {"__init__": __init__, "__qualname__": name})


def _frozen_config(config: dict) -> dict:
    """A copy of a training config for a model without an optimizer (a reference or reward model):
    no optimizer, scheduler or optimizer offload, as TRL's `prepare_deepspeed` does for DeepSpeed."""
    frozen = {k: copy.deepcopy(v) for k, v in config.items() if k not in ("optimizer", "scheduler")}
    zero = frozen.get("zero_optimization", {})
    frozen["zero_optimization"] = {k: v for k, v in zero.items() if k != "offload_optimizer"}
    return frozen


def _reference_from_directory(trainer_class: type, config, kwargs: dict):
    """The frozen stage-3 engine of a reference model that `trainer_class` (a trainer taking
    `ref_model`: TRL's DPO, KTO) would load whole with `from_pretrained` (no `ref_model` given, no
    PEFT, no precomputed reference log-probabilities), built straight from the policy's local
    directory with each rank reading only its shards (inference/pretrained.py); None where that does
    not apply (then `_shard_frozen_models` shards what the trainer loaded)."""
    model, args = kwargs.get("model"), kwargs.get("args")
    if not isinstance(model, (str, os.PathLike)) or not os.path.isdir(model) or args is None:
        return None
    if kwargs.get("ref_model") is not None or kwargs.get("peft_config") is not None:
        return None
    if "ref_model" not in inspect.signature(trainer_class).parameters:
        return None
    if getattr(args, "precompute_ref_log_probs", False):
        return None
    full = trainer_config(config, args, None, args.world_size)
    if full.get("zero_optimization", {}).get("stage", 0) != 3:
        return None
    frozen = _frozen_config(full)
    extras = frozen.setdefault("zeroshard", {})
    if not extras.get("wrap_modules"):  # TRL's fused LM head reads the head's weight: see _fit_model
        extras["wrap_modules"] = block_classes(meta_model(model))
    return from_pretrained(model, frozen)


def _fit_model(config: dict, model: torch.nn.Module) -> dict:
    """`config`, with the wrap policy told to leave an LM head in the root unit when the model's
    forward was replaced on the instance: TRL's fused LM head (`add_fused_lm_head`) reads
    `lm_head.weight` without calling `lm_head`, so a head that was a unit of its own ([Note: the head
    is a unit] in core/wrap.py) would never be gathered. The blocks stay the units they were."""
    get_base = getattr(model, "get_base_model", None)  # under PEFT's wrapper
    base = get_base() if callable(get_base) else model
    extras = config.setdefault("zeroshard", {})
    if "forward" in vars(base) and not extras.get("wrap_modules"):
        extras["wrap_modules"] = block_classes(model)
    return config
