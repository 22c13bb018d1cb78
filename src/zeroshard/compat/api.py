"""`zeroshard.initialize`: DeepSpeed's entry point, same call shape and return value."""

from __future__ import annotations

import logging
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.compat.comm import init_distributed
from zeroshard.compat.engine import ZeroEngine
from zeroshard.compat.inference import InferenceEngine
from zeroshard.compat.optimizers import build_optimizer, check_shardable
from zeroshard.compat.schedulers import build_scheduler
from zeroshard.compat.ulysses_sp import sequence_mesh
from zeroshard.config import ConfigError, ConfigKeyNotActedOnWarning, ZeroShardConfig, load_config, read_config
from zeroshard.core.mesh import ZeroGroups, from_device_mesh, from_mpu
from zeroshard.core.optim.muon import as_one_optimizer
from zeroshard.core.optim.optimizer import ZeroOptimizer

log = logging.getLogger(__name__)


def initialize(
    args=None,
    model: nn.Module | None = None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    mpu=None,
    dist_init_required=None,
    collate_fn=None,
    config=None,
    config_params=None,
    mesh=None,
):
    """Returns `(engine, optimizer, training_dataloader, lr_scheduler)` like `deepspeed.initialize`.

    `config` (or `config_params`, or `args.deepspeed_config`) is a DeepSpeed JSON config: a dict or a
    path, given exactly once (`{}` for all defaults), as DeepSpeed requires. `optimizer` is a torch
    optimizer, or a callable building one from parameters; given together with the config's
    `optimizer` section it wins, as in DeepSpeed (with a warning); the same for `lr_scheduler` and the
    `scheduler` section. The optimizer returned is the one DeepSpeed returns: at stage 0 in fp32 the
    torch optimizer itself, else zeroshard's `ZeroOptimizer` around it ([Note: the optimizer
    initialize returns] in compat/client_optimizer.py). With neither an optimizer nor an 'optimizer'
    section, stages 0 and 3 give an engine for inference (ZeRO-Inference, compat/inference.py) and the
    optimizer returned is None; stages 1 and 2 refuse, as DeepSpeed does.

    Under tensor and/or pipeline parallelism, pass `mesh` (a torch DeviceMesh with dimensions named
    'dp' and 'tp'/'pp') or DeepSpeed/Megatron's `mpu` object: ZeRO partitions over the data-parallel
    group only, and batch sizes count data-parallel ranks (docs/parallelism.md).
    """
    if model is None or not isinstance(model, nn.Module):
        raise ValueError(f"initialize(model=...) needs an nn.Module, got {type(model).__name__}")
    if mpu is not None and mesh is not None:
        raise ValueError("initialize(mesh=..., mpu=...): give the parallel layout once, as a DeviceMesh or an mpu")
    _refuse_hf_deepspeed_config()
    config = _pick_config(args, config, config_params)
    _check_local_rank(args)
    config = _init_distributed(config, dist_init_required, mesh is None and mpu is None)
    groups = _parallel_layout(mesh, mpu, model, _sequence_parallel_size(config))
    group, model_parallel = groups.dp, groups.model_parallel
    sp = dist.get_world_size(groups.sp) if groups.sp is not None else 1
    cfg = load_config(config, (dist.get_world_size(group) if group is not None else dist.get_world_size()) // sp)
    if cfg.sequence_parallel_size != sp:
        raise ConfigError(
            f"config sequence_parallel_size is {cfg.sequence_parallel_size} but the "
            f"{'mesh' if mesh is not None else 'mpu'}'s sequence-parallel groups have {sp} ranks: make them agree"
        )
    deferred = any(p.is_meta for p in model.parameters())  # values loaded into the shards later
    if torch.cuda.is_available() and dist.get_backend() == "nccl" and not deferred:
        model.to(torch.device("cuda", torch.cuda.current_device()))
    if optimizer is None and cfg.optimizer is None:
        _check_stage_without_optimizer(cfg.zero_optimization.stage)
        if group is not None:
            raise ValueError(
                "initialize(mesh=/mpu=) without an optimizer: ZeRO-Inference shards over the whole "
                "world only; pass an optimizer to train under tensor/pipeline parallelism"
            )
        return _inference(model, cfg, lr_scheduler, training_data, collate_fn)
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if cfg.weight_quantization.quantized_initialization is not None:
        raise ConfigError(
            "weight_quantization.quantized_initialization quantizes the weights of an inference engine: "
            "initialize() without an optimizer (and without an 'optimizer' section) to use it; training "
            "keeps fp32 master weights"
        )
    torch_optimizer = _build_optimizer(optimizer, cfg, params, model)
    check_shardable(torch_optimizer)
    engine = ZeroEngine(model, torch_optimizer, cfg, group=group, model_parallel=model_parallel, sequence=groups.sp)
    engine.lr_scheduler = _build_scheduler(lr_scheduler, cfg, engine, optimizer)
    loader = _dataloader(training_data, collate_fn, engine) if training_data is not None else None
    return engine, engine.returned_optimizer, loader, engine.lr_scheduler


class InitializeError(ConfigError, AssertionError):
    """initialize()'s arguments contradict each other, or lack what DeepSpeed requires. Also an
    AssertionError: DeepSpeed 0.19.8 asserts in these cases, and its tests and some scripts catch that."""


def _init_distributed(config, dist_init_required, whole_world: bool):
    """Initialise torch.distributed if no one has, bounded by the config's comm_timeout_s, not torch's
    30 minutes; the config is parsed here for that (for torchrun's WORLD_SIZE) and returned parsed."""
    if dist.is_available() and dist.is_initialized() or dist_init_required is False:
        return config
    world = os.environ.get("WORLD_SIZE", "")
    if not (whole_world and world.isdigit() and int(world) > 0):
        init_distributed(dist_init_required=dist_init_required)  # raises when launched without torchrun
        return config
    parsed = load_config(config, int(world) // _sequence_parallel_size(config))
    init_distributed(dist_init_required=dist_init_required, timeout_s=parsed.zeroshard.comm_timeout_s)
    return parsed


def _parallel_layout(mesh, mpu, model, sequence_parallel_size: int) -> ZeroGroups:
    """ZeRO's groups in a mesh or an mpu; without either, the whole world, or with the config's
    `sequence_parallel_size` above 1, the groups of consecutive ranks that DeepSpeed's ALST builds."""
    if mesh is not None:
        if not hasattr(mesh, "get_group"):
            raise ValueError(f"initialize(mesh=...) needs a torch DeviceMesh, got {type(mesh).__name__}")
        return from_device_mesh(mesh, model)
    if mpu is not None:
        return from_mpu(mpu, model)
    if sequence_parallel_size > 1:
        return from_device_mesh(sequence_mesh(sequence_parallel_size), model)
    return ZeroGroups()


def _sequence_parallel_size(config) -> int:
    """The config's `sequence_parallel_size` before it is parsed (the batch sizes count dp ranks)."""
    if isinstance(config, ZeroShardConfig):
        return config.sequence_parallel_size
    size = read_config(config).get("sequence_parallel_size", 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"config sequence_parallel_size is {size!r}: a positive integer")
    return size


def _refuse_hf_deepspeed_config() -> None:
    """transformers' `HfDeepSpeedConfig` (ZeRO-3) makes `from_pretrained` build models under the real
    DeepSpeed's `zero.Init`, whose partitioned parameters zeroshard cannot take. Read, not imported:
    only a script that imported transformers can have one."""
    hf = sys.modules.get("transformers.integrations.deepspeed")
    enabled = getattr(hf, "is_deepspeed_zero3_enabled", None)
    if enabled is not None and enabled():
        raise ConfigError(
            "transformers' HfDeepSpeedConfig with ZeRO-3 is active: it makes from_pretrained partition the model "
            "with the deepspeed package, not zeroshard. Import it as `from zeroshard.integrations.hf import "
            "HfDeepSpeedConfig` instead (from_pretrained then builds the whole model, which initialize "
            "partitions), or, for a model larger than one rank, build it under "
            "`with zeroshard.zero.Init(): model = AutoModelForCausalLM.from_config(config)`, then load the weights "
            "with zeroshard.checkpoint.load_full_weights(engine, 'model.safetensors'), or train with "
            "zeroshard.integrations.hf.ZeroShardTrainer (docs/integrations.md, 'ZeRO-3 with transformers')"
        )


def _inference(model, cfg, lr_scheduler, training_data, collate_fn):
    if lr_scheduler is not None or cfg.scheduler is not None:
        raise ConfigError(
            "a learning-rate scheduler was given but no optimizer: add an 'optimizer' section to the "
            "config or pass initialize(optimizer=...) to train; without one the engine is for inference"
        )
    engine = InferenceEngine(model, cfg)
    loader = _dataloader(training_data, collate_fn, engine) if training_data is not None else None
    return engine, None, loader, None


def _pick_config(args, config, config_params):
    """The one config: `config`, `config_params`, or the command line's `--deepspeed_config` (or its
    deprecated spelling `--deepscale_config`), refused when it comes twice or not at all, as
    DeepSpeed refuses it. `args.deepspeed` naming a file is taken when nothing else names one."""
    if config is not None and config_params is not None:
        raise InitializeError("give the config once: `config` or `config_params`, not both")
    name = "config" if config is not None else "config_params"
    config = config if config is not None else config_params
    path = _config_path_from_args(args)
    if path is not None and config is not None:
        raise InitializeError(
            f"the config was given twice: args.deepspeed_config={path!r} (--deepspeed_config on the command line) "
            f"and initialize({name}={_brief(config)}); give one: drop --deepspeed_config or {name}= "
            "(DeepSpeed refuses both too)"
        )
    if config is None and path is None:
        deepspeed = getattr(args, "deepspeed", None)
        path = deepspeed if isinstance(deepspeed, str | os.PathLike) else None
    config = config if config is not None else path
    if config is None:
        raise InitializeError(
            "initialize() got no config: pass config= (a dict, or a JSON file's path; {} for all defaults) or "
            "args= with args.deepspeed_config set (--deepspeed_config FILE, from zeroshard.add_config_arguments), "
            "as DeepSpeed requires"
        )
    return config


def _config_path_from_args(args):
    path = getattr(args, "deepspeed_config", None)
    deprecated = getattr(args, "deepscale_config", None)
    if path is not None and deprecated is not None:
        raise InitializeError(
            f"args.deepspeed_config={path!r} and args.deepscale_config={deprecated!r}: give one "
            "(--deepscale_config is DeepSpeed's deprecated spelling of --deepspeed_config)"
        )
    return path if path is not None else deprecated


def _brief(config) -> str:
    text = repr(config)
    return text if len(text) <= 120 else f"{text[:117]}..."


def _check_local_rank(args) -> None:
    """DeepSpeed's check that the launcher's `--local_rank` (args.local_rank) and the LOCAL_RANK
    environment variable name the same device; None or a negative value means "not given"."""
    local_rank = getattr(args, "local_rank", None)
    if local_rank is None:
        return
    if not isinstance(local_rank, int):
        raise InitializeError(
            f"args.local_rank={local_rank!r} is a {type(local_rank).__name__}: expected an int (the launcher's "
            "--local_rank), or None"
        )
    env = os.environ.get("LOCAL_RANK")
    if local_rank >= 0 and env is not None and int(env) != local_rank:
        raise InitializeError(
            f"args.local_rank={local_rank} but the LOCAL_RANK environment variable is {env}: both name this "
            "process's device and must agree (DeepSpeed refuses this too); let the launcher set both, or leave "
            "--local_rank out (torchrun sets only LOCAL_RANK)"
        )


def _check_stage_without_optimizer(stage: int) -> None:
    if stage in (1, 2):
        raise InitializeError(
            f"initialize() without an optimizer at ZeRO stage {stage}: stages 1 and 2 partition the optimizer's "
            f"state, so they need one (DeepSpeed: 'zero stage {stage} requires an optimizer'). To train, pass optimizer=... "
            "or add an 'optimizer' section; for an engine without one (inference), use stage 3 (ZeRO-Inference) or 0"
        )


def _build_optimizer(optimizer, cfg, params, model) -> torch.optim.Optimizer:
    if optimizer is not None and cfg.optimizer is not None:
        warnings.warn(
            "an optimizer was passed to initialize() and the config has an 'optimizer' section: the "
            "one passed is used and the section is ignored, as in DeepSpeed",
            ConfigKeyNotActedOnWarning,
            stacklevel=3,
        )
    if optimizer is None:
        return build_optimizer(cfg.optimizer, params, {id(p): n for n, p in model.named_parameters()})
    if isinstance(optimizer, ZeroOptimizer):
        raise ValueError(
            "initialize(optimizer=...) got the optimizer another initialize() returned: pass a "
            "torch optimizer over this model's parameters"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if isinstance(optimizer, (list, tuple)):  # a torch Muon and an AdamW, as torch's recipe holds them
        return as_one_optimizer(optimizer)
    if callable(optimizer):
        return as_one_optimizer(optimizer(params))
    raise ValueError(
        f"initialize(optimizer=...) must be a torch optimizer, a list [Muon, AdamW] of them, or a callable building one, "
        f"got {type(optimizer).__name__}"
    )


def _build_scheduler(lr_scheduler, cfg, engine, client_optimizer):
    if lr_scheduler is not None and cfg.scheduler is not None:
        warnings.warn(
            "an lr_scheduler was passed to initialize() and the config has a 'scheduler' section: the "
            "one passed is used and the section is ignored, as in DeepSpeed",
            ConfigKeyNotActedOnWarning,
            stacklevel=3,
        )
    elif cfg.scheduler is not None:
        return build_scheduler(cfg.scheduler, engine.optimizer)
    if lr_scheduler is None:
        return None
    if hasattr(lr_scheduler, "step"):
        _check_scheduler_optimizer(lr_scheduler, engine.basic_optimizer, client_optimizer)
        return lr_scheduler  # built against the client optimizer, whose param-group dicts we kept
    return lr_scheduler(engine.basic_optimizer)


def _check_scheduler_optimizer(lr_scheduler, basic, client_optimizer) -> None:
    """A scheduler object must drive the optimizer the engine steps: DeepSpeed asserts that the client
    optimizer is an object when the scheduler is; zeroshard also names a scheduler over another one."""
    driven = getattr(lr_scheduler, "optimizer", None)
    if not isinstance(driven, torch.optim.Optimizer) or driven is basic:
        return
    if driven.param_groups and all(any(g is h for h in basic.param_groups) for g in driven.param_groups):
        return  # one of the optimizers combined into it ([Muon, AdamW]): the same param-group dicts
    source = (
        "the one built from the config's 'optimizer' section"
        if client_optimizer is None
        else "the one initialize(optimizer=callable) built"
        if not isinstance(client_optimizer, torch.optim.Optimizer)
        else f"initialize(optimizer={type(client_optimizer).__name__} object)"
    )
    raise InitializeError(
        f"initialize(lr_scheduler={type(lr_scheduler).__name__} object) drives a {type(driven).__name__} that is not "
        f"the optimizer the engine steps ({source}), so its learning rates would never be used: build the "
        "scheduler over the optimizer passed to initialize(), or pass a callable (optimizer -> scheduler)"
    )


def _dataloader(dataset, collate_fn, engine):
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(dataset, num_replicas=engine.world_size, rank=engine.global_rank)
    return DataLoader(
        dataset,
        batch_size=engine.train_micro_batch_size_per_gpu(),
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=True,
    )


def add_config_arguments(parser):
    """DeepSpeed's `add_config_arguments`: adds --deepspeed, --deepspeed_config (and the deprecated
    --deepscale, --deepscale_config) to an argparse parser, each only if the parser lacks it, plus
    --local_rank (LOCAL_RANK's value) when the script does not define it, for DeepSpeed-launcher scripts
    that read `args.local_rank`."""
    known = set(parser._option_string_actions)  # argparse's own table of the options it has
    group = parser.add_argument_group("zeroshard", "DeepSpeed-compatible configuration")
    options = [
        (
            "--deepspeed",
            dict(default=False, action="store_true", help="enable zeroshard (kept for DeepSpeed scripts; always on)"),
        ),
        ("--deepspeed_config", dict(default=None, type=str, help="DeepSpeed JSON config path")),
        ("--deepscale", dict(default=False, action="store_true", help="deprecated spelling of --deepspeed")),
        ("--deepscale_config", dict(default=None, type=str, help="deprecated spelling of --deepspeed_config")),
        ("--local_rank", dict(default=int(os.environ.get("LOCAL_RANK", 0)), type=int, help="set by the launcher")),
    ]
    for flag, kwargs in options:
        if flag not in known:
            group.add_argument(flag, **kwargs)
    return parser
