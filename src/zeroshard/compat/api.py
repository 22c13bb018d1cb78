"""`zeroshard.initialize`: DeepSpeed's entry point, same call shape and return value."""
from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.config import ConfigError, load_config
from zeroshard.compat.engine import ZeroEngine
from zeroshard.compat.optimizers import build_optimizer, check_shardable
from zeroshard.compat.schedulers import build_scheduler

log = logging.getLogger(__name__)


def init_distributed(dist_backend: str | None = None, timeout_s: float = 1800.0) -> None:
    """Initialise torch.distributed from torchrun's environment (no-op when already initialised)."""
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"torch.distributed is not initialised and {', '.join(missing)} are not set: "
                           "launch the script with `torchrun --nproc_per_node N script.py`")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def initialize(args=None, model: nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, config_params=None):
    """Returns `(engine, optimizer, training_dataloader, lr_scheduler)` like `deepspeed.initialize`.

    `config` (or `config_params`, or `args.deepspeed_config`) is a DeepSpeed JSON config: a dict or a
    path. `optimizer` is a torch optimizer, or a callable building one from parameters; exactly one
    of `optimizer` and the config's `optimizer` section must be given.
    """
    if model is None or not isinstance(model, nn.Module):
        raise ValueError(f"initialize(model=...) needs an nn.Module, got {type(model).__name__}")
    if mpu is not None:
        raise ValueError("initialize(mpu=...): model parallelism is not supported by zeroshard")
    config = _pick_config(args, config, config_params)
    init_distributed()
    cfg = load_config(config, dist.get_world_size())
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        model.to(torch.device("cuda", torch.cuda.current_device()))
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    torch_optimizer = _build_optimizer(optimizer, cfg, params)
    check_shardable(torch_optimizer)
    engine = ZeroEngine(model, torch_optimizer, cfg)
    engine.lr_scheduler = _build_scheduler(lr_scheduler, cfg, engine)
    loader = _dataloader(training_data, collate_fn, engine) if training_data is not None else None
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _pick_config(args, config, config_params):
    if config is not None and config_params is not None:
        raise ConfigError("give the config once: `config` or `config_params`, not both")
    config = config if config is not None else config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepspeed", None)
        if config is True:
            config = None
    return config


def _build_optimizer(optimizer, cfg, params) -> torch.optim.Optimizer:
    if optimizer is not None and cfg.optimizer is not None:
        raise ConfigError("an optimizer was passed to initialize() and the config has an 'optimizer' "
                          "section: give exactly one")
    if optimizer is None and cfg.optimizer is None:
        raise ConfigError("no optimizer: add an 'optimizer' section to the config or pass "
                          "initialize(optimizer=...)")
    if optimizer is None:
        return build_optimizer(cfg.optimizer, params)
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        return optimizer(params)
    raise ValueError(f"initialize(optimizer=...) must be a torch optimizer or a callable building one, "
                     f"got {type(optimizer).__name__}")


def _build_scheduler(lr_scheduler, cfg, engine):
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError("an lr_scheduler was passed to initialize() and the config has a 'scheduler' "
                          "section: give exactly one")
    if cfg.scheduler is not None:
        return build_scheduler(cfg.scheduler, engine.optimizer)
    if lr_scheduler is None or hasattr(lr_scheduler, "step"):
        return lr_scheduler  # built against the client optimizer, whose param-group dicts we kept
    return lr_scheduler(engine.optimizer.optimizer)


def _dataloader(dataset, collate_fn, engine):
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(dataset, num_replicas=engine.world_size, rank=engine.global_rank)
    return DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler,
                      collate_fn=collate_fn, drop_last=True)


def add_config_arguments(parser):
    """DeepSpeed's `add_config_arguments`: adds --deepspeed, --deepspeed_config to an argparse parser."""
    group = parser.add_argument_group("zeroshard", "DeepSpeed-compatible configuration")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable zeroshard (kept for DeepSpeed scripts; always on)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON config path")
    group.add_argument("--local_rank", default=int(os.environ.get("LOCAL_RANK", 0)), type=int,
                       help="set by the launcher")
    return parser
