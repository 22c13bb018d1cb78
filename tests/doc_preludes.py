"""What a documentation block's context provides, for tests/test_doc_blocks.py's `run` and `cli` blocks.

A prelude is `setup(namespace, here, rank)`: it puts into the page's namespace the names a fragment
takes from its surroundings, and writes the files it reads into `here`, the page's directory (rank 0
writes, then both ranks meet). `AFTER[name](namespace, here, rank)` checks what the block did.
Models are the smallest that exercise the block: the GPT of zeroshard.tools.models (`tiny_gpt_config`)
and a 2-layer Llama built from a config (transformers, no download).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.tools.models import GPT, tiny_gpt_config

ROOT = Path(__file__).resolve().parents[1]
NVME_PLACEHOLDER = "/local_nvme"
_pages: dict[str, dict] = {}  # page -> its namespace, for the life of the rank


def _rank0_writes(write) -> None:
    if dist.get_rank() == 0:
        write()
    dist.barrier()


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(tiny_gpt_config())


def _tokens(rows: int, rank: int = 0) -> torch.Tensor:
    """(rows, block_size + 1) tokens counting upward from a random start: a language the GPT learns."""
    cfg = tiny_gpt_config()
    start = torch.randint(0, cfg.vocab_size, (rows, 1), generator=torch.Generator().manual_seed(rank))
    return (start + torch.arange(cfg.block_size + 1)) % cfg.vocab_size


def _llama():
    from tests.hf_models import hf_config, model_fn

    return hf_config("llama"), model_fn("llama")()


# ---------------------------------------------------------------- the preludes


def batches(ns: dict, here: Path, rank: int) -> None:
    """`batches`: this rank's (inputs, targets) of 3 steps."""
    tokens = _tokens(3 * 4, rank)
    ns["batches"] = [(t[:, :-1], t[:, 1:]) for t in tokens.split(4)]


def deepspeed(ns: dict, here: Path, rank: int) -> None:
    """`model` (the GPT), `dataset` of (inputs, targets) rows and `ds_config.json` (examples/ds_config.json)."""
    ns["model"] = _gpt()
    tokens = _tokens(32)
    ns["dataset"] = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    _rank0_writes(lambda: shutil.copy(ROOT / "examples" / "ds_config.json", here / "ds_config.json"))


def engine(ns: dict, here: Path, rank: int) -> None:
    """`engine`: the GPT at stage 3 with AdamW, one step trained; its snapshots in the block's
    directory, not in /dev/shm."""
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zeroshard": {"snapshot_dir": str(here / "snapshots")},
    }
    ns["engine"], *_ = zeroshard.initialize(model=_gpt(), config=config)
    tokens = _tokens(4, rank)
    _, loss = ns["engine"](tokens[:, :-1], tokens[:, 1:])
    ns["engine"].backward(loss)
    ns["engine"].step()


def ds_checkpoint(ns: dict, here: Path, rank: int) -> None:
    """`engine` of the model DeepSpeed trained for tests/data/deepspeed/, and its stage-3 checkpoint
    copied to `ds_checkpoints/` (written by DeepSpeed 0.19.8 at 2 ranks)."""
    from tests.data.deepspeed import tiny_model as tm

    source = ROOT / "tests" / "data" / "deepspeed" / "stage3_fp32"
    _rank0_writes(lambda: shutil.copytree(source, here / "ds_checkpoints", dirs_exist_ok=True))
    model = tm.build_model()
    ns["engine"], *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=tm.config(3, "fp32", 2)
    )


def hf(ns: dict, here: Path, rank: int) -> None:
    """`model` (a fresh 2-layer Llama), `input_ids` (2, 6), and the same model saved to `path/to/model`."""
    _, model = _llama()
    ns["model"], ns["input_ids"] = model, torch.arange(2, 14).reshape(2, 6)
    _rank0_writes(lambda: model.save_pretrained(here / "path" / "to" / "model"))


def checkpoint(ns: dict, here: Path, rank: int) -> None:
    """`checkpoints/`: the Llama's training checkpoint (stage 3, AdamW, one step) as `engine.save_checkpoint` writes it."""
    _, model = _llama()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    trainer, *_ = zeroshard.initialize(model=model, config={**config, "zero_optimization": {"stage": 3}})
    ids = torch.arange(2, 14).reshape(2, 6)
    trainer.backward(trainer(input_ids=ids, labels=ids).loss)
    trainer.step()
    trainer.save_checkpoint(str(here / "checkpoints"))
    trainer.destroy()


def hf_weights(ns: dict, here: Path, rank: int) -> None:
    """`transformers`, `config` (the Llama's config), `ds_config`, and `model.safetensors` of that model."""
    import transformers
    from safetensors.torch import save_file

    ns["transformers"] = transformers
    config, model = _llama()
    ns["config"], ns["weights"] = config, {n: p.detach().clone() for n, p in model.named_parameters()}
    ns["ds_config"] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    _rank0_writes(lambda: save_file(ns["weights"], str(here / "model.safetensors")))


def lora(ns: dict, here: Path, rank: int) -> None:
    """`model`: the Llama with LoRA adapters (peft), trained by an engine at stage 3 that shards even
    the adapters (persistence threshold 0); `rank`."""
    import peft

    _, base = _llama()
    lora_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, lora_config)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    ns["engine"], *_ = zeroshard.initialize(model=model, config=config)
    ns["model"], ns["rank"] = model, rank


def mesh(ns: dict, here: Path, rank: int) -> None:
    """`init_device_mesh`, `device_type` "cpu", `dp` 2 x `tp` 1, `model` (the GPT), `opt` (AdamW),
    `ds_config`, and an `mpu` over the same layout (tests/tp_helpers.py's)."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.tp_helpers import Mpu

    ns.update(init_device_mesh=init_device_mesh, device_type="cpu", dp=2, tp=1, model=_gpt())
    ns["opt"] = torch.optim.AdamW(ns["model"].parameters(), lr=1e-2)
    ns["ds_config"] = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}
    ns["mpu"] = Mpu(init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp")))


PRELUDES = {
    "batches": batches,
    "deepspeed": deepspeed,
    "engine": engine,
    "ds-checkpoint": ds_checkpoint,
    "hf": hf,
    "checkpoint": checkpoint,
    "hf-weights": hf_weights,
    "lora": lora,
    "mesh": mesh,
}


# ---------------------------------------------------------------- what a block must have done


def _trained(ns: dict, here: Path, rank: int) -> None:
    losses = ns["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0], losses


def _stepped(ns: dict, here: Path, rank: int) -> None:
    assert ns["engine"].global_steps == 2, ns["engine"].global_steps  # 32 rows / (4 x 2 ranks x 2 micro)


def _loaded_weights(ns: dict, here: Path, rank: int) -> None:
    engine = ns["engine"]
    with zeroshard.zero.GatheredParameters(list(engine.module.parameters())):
        for name, param in engine.module.named_parameters():
            assert torch.equal(param, ns["weights"][name]), name


def _saved_adapter(ns: dict, here: Path, rank: int) -> None:
    from safetensors.torch import load_file

    dist.barrier()
    saved = load_file(str(here / "adapter" / "adapter_model.safetensors"))
    assert saved and all(t.numel() > 0 for t in saved.values()), {k: t.shape for k, t in saved.items()}


AFTER = {"batches": _trained, "deepspeed": _stepped, "hf-weights": _loaded_weights, "lora": _saved_adapter}


# ---------------------------------------------------------------- running one block


def run_block(root: Path, rank: int, *, page: str, line: int, info: str, code: str, kind: str, args: str) -> dict:
    here = root / re.sub(r"\W", "_", page)
    here.mkdir(parents=True, exist_ok=True)
    os.chdir(here)
    code = code.replace(NVME_PLACEHOLDER, str(here / "local_nvme"))
    if kind == "cli":
        return {"exit": _run_cli(code, rank)}
    ns = _pages.setdefault(page, {"__name__": "__doc_block__", "torch": torch, "zeroshard": zeroshard})
    for prelude in args.split():
        PRELUDES[prelude](ns, here, rank)
    dist.barrier()
    try:  # blank lines first: a traceback then gives the line of the page
        exec(compile("\n" * line + code, page, "exec"), ns)  # noqa: S102 - our own documentation
    finally:
        dist.barrier()  # a rank that failed meets the other before subtests() compares their results
    for prelude in args.split():
        if prelude in AFTER:
            AFTER[prelude](ns, here, rank)
    return {"names": sorted(k for k in ns if not k.startswith("__"))}


def _run_cli(code: str, rank: int) -> list[int]:
    from tests.test_doc_blocks import commands
    from zeroshard.tools.cli import main

    exits = []
    try:
        for argv in commands(code) if rank == 0 else []:
            assert argv[0] == "zeroshard", f"a `cli` block runs zeroshard commands, not {shlex.join(argv)}"
            exits.append(main(argv[1:]))
            assert exits[-1] == 0, f"`{shlex.join(argv)}` exited with {exits[-1]}"
    finally:
        dist.barrier()
    return exits
