"""A Hugging Face checkpoint straight into the ZeRO-Inference store, never materialising the model.

    engine = zeroshard.compat.pretrained.from_pretrained("path/to/model", config={"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}})
    tokens = engine.module.generate(input_ids, max_new_tokens=32)

The model is built on the meta device (shapes, no storage), so its parameters have no values
([Note: deferred values] in core/group.py): each flat group allocates only this rank's shard, in
the store, and `load_full_weights` reads exactly that shard's element ranges from the safetensors
files (one `model.safetensors`, or the shards a `model.safetensors.index.json` names, as
`save_pretrained(max_shard_size=...)` writes them) and writes it into the store tensor, group by
group, releasing each to its file before the next. Peak memory is about one group's shard, not the
model. Buffers are small and built for real: non-persistent ones (rotary frequencies) are computed
by the model's own initialisation, persistent ones are read from the checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.checkpoint.files import CheckpointError
from zeroshard.checkpoint.manifest import persistent_buffers
from zeroshard.checkpoint.weights import INDEX
from zeroshard.compat.comm import init_distributed
from zeroshard.compat.inference import InferenceEngine
from zeroshard.config import load_config

log = logging.getLogger(__name__)

SINGLE = "model.safetensors"


def weights_source(path) -> Path:
    """The directory (sharded) or file holding the checkpoint's safetensors weights."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"{path}: not a directory; give the directory save_pretrained() wrote "
            "(config.json and model.safetensors or model.safetensors.index.json)"
        )
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: has no config.json, which a Hugging Face model directory holds")
    if (path / INDEX).is_file():
        return path
    if (path / SINGLE).is_file():
        return path / SINGLE
    found = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".safetensors"))
    raise CheckpointError(
        f"{path}: neither {SINGLE} nor {INDEX}; found {found or 'no weight files'} "
        "(only safetensors checkpoints are read: save_pretrained(safe_serialization=True))"
    )


def meta_model(path, model_class=None) -> nn.Module:
    """The model of the checkpoint at `path` with its parameters on the meta device and its buffers real."""
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(path)
    model_class = model_class or transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = model_class.from_config(hf_config)
    materialize_buffers(model, persistent_buffers(model))
    return model


@torch.no_grad()
def materialize_buffers(model: nn.Module, persistent: dict[str, torch.Tensor]) -> None:
    """Real (CPU) storage for every buffer on the meta device. Non-persistent ones get their values
    from the model's own `_init_weights` (Hugging Face models compute rotary frequencies there,
    which is also how transformers' own meta-device loading fills them); persistent ones are read
    with the weights (load_full_weights), so they must be in the checkpoint."""
    persistent_ids = {id(b) for b in persistent.values()}
    owners: dict[int, nn.Module] = {}
    computed = []
    for module_name, module in model.named_modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is None or not buffer.is_meta:
                continue
            module._buffers[name] = torch.zeros_like(buffer, device="cpu")
            if id(buffer) not in persistent_ids:
                owners[id(module)] = module
                computed.append(f"{module_name}.{name}".lstrip("."))
    if not owners:
        return
    init = getattr(model, "_init_weights", None)
    if init is None:
        raise ValueError(
            f"buffers {computed[:3]} were built on the meta device and are not in the checkpoint; only "
            "Hugging Face models (whose _init_weights computes them) can be built so"
        )
    for module in owners.values():
        init(module)


def init_one_rank() -> None:
    """torch.distributed as torchrun set it up, or else one rank of gloo in this process (the common
    case of inference: `python script.py` / `zeroshard generate` without a launcher)."""
    if dist.is_initialized():
        return
    import os

    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        init_distributed()
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def from_pretrained(path, config=None, *, model_class=None, strict: bool = True) -> InferenceEngine:
    """An InferenceEngine over the Hugging Face checkpoint directory `path`, its weights loaded
    straight into the store of `config` (a DeepSpeed config: dict or JSON path; default stage 3,
    weights in CPU memory). `model_class` defaults to AutoModelForCausalLM. Collective: every rank
    calls it; each reads only its own shards."""
    source = weights_source(path)
    init_one_rank()
    cfg = load_config(
        config if config is not None else {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
        dist.get_world_size(),
    )
    if cfg.optimizer is not None or cfg.scheduler is not None:
        raise ValueError(
            "from_pretrained builds an inference engine: remove the config's 'optimizer' and "
            "'scheduler' sections (train with zeroshard.initialize(..., optimizer=...))"
        )
    model = meta_model(path, model_class)
    engine = InferenceEngine(model, cfg)
    engine.load_weights(source, strict=strict)
    log.info(
        "loaded %s into the %s store: %.1f MB of shards on rank %d",
        source,
        getattr(engine.placement.param_store, "kind", "compute-memory"),
        sum(g.master.numel() * 4 for g in engine.groups) / 1e6,
        engine.global_rank,
    )
    return engine
