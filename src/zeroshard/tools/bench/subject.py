"""The implementations a bench compares, each reduced to a `Subject`: zeroshard here, torch's own in peers.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Subject:
    """One data-parallel implementation under test, reduced to what the bench needs from it."""

    step: Callable[[torch.Tensor, torch.Tensor], float]  # one training step, returns the loss
    states: Callable[[], dict]  # model-state bytes this rank holds, by kind
    count_comm: Callable[[Callable[[], None]], dict]  # run the callable, return paper bytes by kind
    slowest: Callable[[float], float]  # max of a number over ranks
    gather: Callable[[object], list]  # every rank's object, on every rank
    params: int
    close: Callable[[], None]
    # Complete what a step left in flight (zeroshard.overlap_param_gather's all-gathers): a bench that
    # interleaves systems settles one before stepping another, so that its traffic stays its own.
    settle: Callable[[], None] = lambda: None


def zeroshard_subject(
    model: torch.nn.Module, config: dict, device: torch.device, make_optimizer, adjust=None
) -> Subject:
    """`adjust(engine)`, when given, changes what no config key reaches (a benchmark's what-if)."""
    from zeroshard.compat.api import initialize

    engine, *_ = initialize(model=model, optimizer=make_optimizer(model.parameters()), config=config)
    if adjust is not None:
        adjust(engine)

    def step(x, y) -> float:
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    def count_comm(fn) -> dict:
        before = engine.comm_report()["paper_bytes"]
        fn()
        after = engine.comm_report()["paper_bytes"]
        return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}

    def slowest(value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=device)
        engine.comm.all_reduce(tensor, "bench: slowest rank's step time", op="max", kind="control")
        return float(tensor.item())

    return Subject(
        step,
        engine.memory_report,
        count_comm,
        slowest,
        lambda obj: engine.comm.all_gather_objects(obj, "bench: per-rank figures"),
        engine.num_parameters(),
        engine.destroy,
        engine.sharded.wait_parameters,
    )
