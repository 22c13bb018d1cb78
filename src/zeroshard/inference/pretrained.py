"""A Hugging Face checkpoint straight into the ZeRO-Inference store, never materialising the model.

    model = zeroshard.inference.from_pretrained("path/to/model", offload=zeroshard.NVMeOffload("/local_nvme"))
    tokens = model.generate(input_ids, max_new_tokens=32)

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
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.checkpoint.files import CheckpointError
from zeroshard.checkpoint.manifest import persistent_buffers
from zeroshard.checkpoint.weights import INDEX
from zeroshard.inference.sharded import InferenceModel, shard

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
    """One rank of gloo in this process when torch.distributed is not initialised (the common case of
    inference: `python script.py` without a launcher). Under a launcher (torchrun sets RANK and
    WORLD_SIZE) the process group is the launcher's: initialise it first, with
    `zeroshard.init_distributed()` or `torch.distributed.init_process_group()`."""
    if dist.is_initialized():
        return
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        raise RuntimeError(
            "RANK / WORLD_SIZE are set (a launcher such as torchrun started this process) but torch.distributed "
            "is not initialised: call zeroshard.init_distributed() or torch.distributed.init_process_group() first"
        )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def from_pretrained(path, *, model_class=None, strict: bool = True, **options) -> InferenceModel:
    """The Hugging Face checkpoint directory `path` as an `InferenceModel`, its weights loaded straight
    into the store: `options` are `shard()`'s (`offload`, `quantize`, `packed_matmul`, `precision`,
    ...; by default the shards stay in compute memory). `model_class` defaults to
    AutoModelForCausalLM. Collective: every rank calls it; each reads only its own shards."""
    source = weights_source(path)
    init_one_rank()
    model = shard(meta_model(path, model_class), **options)
    model.load_weights(source, strict=strict)
    log.info(
        "loaded %s into the %s store: %.1f MB of shards on rank %d",
        source,
        getattr(model.placement.param_store, "kind", "compute-memory"),
        sum(g.master.numel() * 4 for g in model.groups) / 1e6,
        model.rank,
    )
    return model
