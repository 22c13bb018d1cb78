"""torch's own data-parallel implementations (and DeepSpeed when installed), as bench `Subject`s.

  * `ddp`: `DistributedDataParallel` with torch's defaults + AdamW, ZeRO stage 0's reference;
  * `torch-zero`: DDP + `torch.distributed.optim.ZeroRedundancyOptimizer`, torch's ZeRO stage 1
    (it all-reduces gradients and broadcasts updated parameters: 2Ψ + Ψ in the paper's convention);
  * `fsdp2`: `torch.distributed.fsdp.fully_shard` on every block and the root, torch's ZeRO stage 3
    (the root stays gathered between forward and backward, so it moves a little under 3Ψ);
  * `deepspeed` (one run per stage): `deepspeed.initialize` with the bench's own config, stage-3 gathering
    at DeepSpeed's defaults (worker.DEEPSPEED_GATHERING); never a dependency, skipped with a note when
    it is not installed. Not exercised by our tests (DeepSpeed is not installed here); its gradient
    buffers are not counted in its model states.

This module calls torch.distributed directly: these are torch's implementations, not zeroshard's, and
their communication is counted by `measure.C10dByteCounter` from the outside.
"""

from __future__ import annotations

import importlib.util
from typing import cast

import torch

from zeroshard.core.comm import Communicator
from zeroshard.tools.bench import measure
from zeroshard.tools.bench.subject import Subject

KINDS = ("ddp", "torch-zero", "fsdp2", "deepspeed")


def available(kind: str) -> bool:
    return unavailable_reason(kind) is None


def unavailable_reason(kind: str) -> str | None:
    if kind == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed (`import deepspeed` failed); skipped"
    if kind == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401  (torch >= 2.6)
        except ImportError:
            return f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2); skipped"
    return None


def _collective_helpers(device: torch.device):
    """The bench's own reductions for a peer, through zeroshard's communication layer (its own group,
    so they are not counted as the peer's traffic)."""
    comm = Communicator(check_collectives=False)

    def slowest(value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=device)
        comm.all_reduce(tensor, "bench: slowest rank's step time", op="max", kind="control")
        return float(tensor.item())

    def gather(obj) -> list:
        return comm.all_gather_objects(obj, "bench: per-rank report")

    return slowest, gather


def count_c10d(fn) -> dict:
    with measure.C10dByteCounter() as counter:
        fn()
    return dict(counter.paper)


def _torch_subject(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    params: int,
    autocast_bf16: bool,
    clip: float,
) -> Subject:
    grad_bytes = [0]

    def step(x, y) -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
            _, loss = model(x, y)
        loss.backward()
        grad_bytes[0] = measure.tensor_bytes(p.grad for p in model.parameters())  # before they are freed
        if clip > 0:  # what zeroshard's and DeepSpeed's gradient_clipping does, as a torch script writes it
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def states() -> dict:
        held = {
            "params": measure.tensor_bytes(model.parameters()),
            "grads": grad_bytes[0],
            "optimizer": measure.optimizer_state_bytes(optimizer),
        }
        return {**held, "total": sum(held.values())}

    slowest, gather = _collective_helpers(device)
    return Subject(step, states, count_c10d, slowest, gather, params, lambda: None)


def build(run: dict, model: torch.nn.Module, device: torch.device, config: dict, make_optimizer) -> Subject:
    """A Subject for peer `run["kind"]`; `config` is zeroshard's DeepSpeed config of the same run and
    `make_optimizer(params)` the optimizer every system gets (worker.bench_optimizer)."""
    kind = run["kind"]
    params = sum(p.numel() for p in model.parameters())
    model.to(device)
    bf16 = config["bf16"]["enabled"]  # peers keep fp32 weights and compute under autocast
    clip = config["gradient_clipping"]
    if kind == "deepspeed":
        return _deepspeed_subject(model, device, config, params, make_optimizer)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in cast(torch.nn.ModuleList, model.blocks):  # the GPT's
            fully_shard(block)
        fully_shard(model)
        return _torch_subject(model, make_optimizer(model.parameters()), device, params, bf16, clip)
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)  # torch's defaults, as a user's script writes it
    if kind == "ddp":
        return _torch_subject(ddp, make_optimizer(ddp.parameters()), device, params, bf16, clip)
    if kind == "torch-zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=make_optimizer.func, **make_optimizer.keywords
        )
        return _torch_subject(ddp, optimizer, device, params, bf16, clip)
    raise ValueError(f"unknown peer {run['kind']!r}; allowed: {', '.join(KINDS)}")


def _deepspeed_subject(model, device, config: dict, params: int, make_optimizer) -> Subject:
    import deepspeed

    config = {k: v for k, v in config.items() if k != "zeroshard"}
    config["zero_allow_untested_optimizer"] = True  # the client optimizer is torch's AdamW
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=make_optimizer(model.parameters()), config=config
    )

    def step(x, y) -> float:
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    def states() -> dict:  # stage 3 keeps each parameter's shard in `ds_tensor`
        held = {
            "params": measure.tensor_bytes(getattr(p, "ds_tensor", p) for p in model.parameters()),
            "grads": 0,
            "optimizer": measure.optimizer_state_bytes(getattr(optimizer, "optimizer", optimizer)),
        }
        return {**held, "total": sum(held.values())}  # DeepSpeed's gradient buffers are not counted

    slowest, gather = _collective_helpers(device)
    return Subject(step, states, count_c10d, slowest, gather, params, engine.destroy)
