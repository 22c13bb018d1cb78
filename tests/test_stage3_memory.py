"""Stage 3 bounds what is gathered *during* forward and backward ([Note: bounded gathering] in
core/gathered.py): counted by the units themselves at every gather and free (LiveCount's peak), and
measured as process memory (VmHWM of each rank) against unbounded prefetch. Autograd saves views of
parameters for backward (a Linear saves `weight.t()`), so a unit whose buffer were merely dropped
after forward would stay in memory until its backward: the VmHWM case sees that too."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

import zeroshard
from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches, train_ddp
from tests.zs_common import adamw, assert_close, gpt_model_fn, make_config, train_engine
from zeroshard.core import backend
from zeroshard.tools.bench import measure
from zeroshard.tools.models.gpt import tiny_gpt_config

BLOCKS = 8

UNBOUNDED = {"stage3_prefetch_bucket_size": 50_000_000, "stage3_max_live_parameters": 10**9}  # DeepSpeed's


class Deep(nn.Module):
    """BLOCKS equal units (2 x width^2 elements each) and, with `head` (its output width), a head: left
    in the root unit below half a block, a unit of its own from there ([Note: the head is a unit])."""

    def __init__(self, width: int, head: int = 0):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width, bias=False), nn.Tanh(), nn.Linear(width, width, bias=False))
            for _ in range(BLOCKS)
        )
        self.head = nn.Linear(width, head, bias=False) if head else None

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return (self.head(x) if self.head is not None else x).square().mean()


def _engine(width: int, head: int = 0, gas: int = 1, **zero):
    torch.manual_seed(0)
    model = Deep(width, head)
    engine, *_ = zeroshard.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01), config=make_config(3, gas, micro=2, **zero)
    )
    return engine


def _counted_case(head: int, zero: dict, inference: bool) -> dict:
    width = 32
    engine = _engine(width, head, **zero)
    live = engine.lifecycle.live
    gathers = engine.comm.counter.calls
    x = torch.randn(2, width, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(2):  # the first step records the orders the prefetch follows
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    before = gathers["all_gather"]
    live.reset_peak()
    loss = engine(x)
    forward_peak = live.peak
    engine.backward(loss)
    engine.step()
    report = {
        "forward_peak": forward_peak,
        "step_peak": live.peak,
        "live_after": live.numel,
        "gathers": gathers["all_gather"] - before,
        "losses": losses + [loss.item()],
        "unit": 2 * width * width,
        "root": width * head if head < width else 0,
        "units": [unit.name for unit in engine.units],
    }
    if inference:
        with torch.no_grad():
            for _ in range(3):  # the first pass records the inference order, the second starts prefetching
                live.reset_peak()
                engine.module(x)
        report["inference_peak"] = live.peak
        engine(x)  # a training forward that no backward follows keeps its last unit for reuse ...
        kept = live.numel
        live.reset_peak()
        with torch.no_grad():
            engine.module(x)  # ... until the next pass starts: it is freed there, not held through it
        report["kept_then_freed"] = (kept, live.peak, live.numel)
    engine.destroy()
    return report


def _counted_worker(rank: int, world: int) -> list[dict]:
    cases = [
        {"head": 0, "zero": {}, "inference": True},  # zeroshard's defaults
        {"head": 0, "zero": UNBOUNDED, "inference": True},
        {
            "head": 0,
            "zero": {"stage3_prefetch_bucket_size": 50_000_000, "stage3_max_live_parameters": 3 * 2 * 32 * 32},
            "inference": True,
        },
        {"head": 0, "zero": {"stage3_prefetch_bucket_size": 3 * 2 * 32 * 32}, "inference": False},
        {"head": 0, "zero": {"stage3_max_live_parameters": 1}, "inference": False},  # below one unit
        {"head": 0, "zero": {"stage3_prefetch_bucket_size": 0}, "inference": False},
        {"head": 16, "zero": {"stage3_max_reuse_distance": 0}, "inference": False},  # nothing kept
        {"head": 16, "zero": {}, "inference": False},  # the root is kept from forward to backward
        {"head": 16, "zero": {"stage3_max_reuse_distance": 10**9}, "inference": False},  # everything kept
        {
            "head": 16,
            "zero": {"stage3_max_reuse_distance": 10**9, "stage3_max_live_parameters": 4 * 2048},
            "inference": False,
        },
        {"head": 32, "zero": {}, "inference": False},  # a head unit, no root unit
    ]
    return subtests(cases, _counted_case)


def test_live_gathered_elements_stay_within_the_bounds():
    reports = run_distributed(_counted_worker, 2, timeout=300)
    (default, unbounded, live3, ahead3, live1, no_prefetch, reuse0, root, reuse_all, reuse_capped, head) = reports[0]
    unit = default["unit"]
    for r in reports[0]:
        assert r["live_after"] == 0, r  # everything freed after the step
        if r is not head:
            assert r["losses"] == default["losses"] if r["root"] == 0 else r["losses"] == root["losses"], r
    # Defaults: the unit being computed + the next one prefetched, in forward, backward and no-grad passes.
    assert default["forward_peak"] == default["step_peak"] == default["inference_peak"] == 2 * unit, default
    assert default["kept_then_freed"] == (unit, 2 * unit, 0), default
    # What DeepSpeed's defaults (and zeroshard before the bounds) did: the whole model gathered at once.
    assert unbounded["step_peak"] == unbounded["inference_peak"] == BLOCKS * unit, unbounded
    # stage3_max_live_parameters bounds units computed + in flight.
    assert live3["step_peak"] == live3["inference_peak"] == 3 * unit, live3
    # stage3_prefetch_bucket_size bounds what is ahead: current unit + prefetch bound.
    assert ahead3["step_peak"] == unit + 3 * unit, ahead3
    # A live bound below one unit: the computed unit is gathered anyway, nothing prefetched.
    assert live1["step_peak"] == no_prefetch["step_peak"] == unit, (live1, no_prefetch)
    # Every step gathers each block twice (forward, backward), but the last, whose backward begins where
    # its forward ends (the default reuse distance 1): it stays gathered, unless the live bound forbids it.
    assert default["gathers"] == unbounded["gathers"] == 2 * BLOCKS - 1 and live1["gathers"] == 2 * BLOCKS, default
    # The root unit (the head, outermost): gathered while the blocks run, kept for its backward, which
    # begins where its forward ends, and so is the last block, whose backward follows at once (the
    # root around it is not counted as used in between): two gathers fewer per step, no higher peak.
    assert root["units"][-1] == "<root>" and "head" not in root["units"], root
    assert root["step_peak"] == root["root"] + 2 * unit and root["gathers"] == 2 * BLOCKS, root
    assert reuse0["step_peak"] == root["step_peak"] and reuse0["gathers"] == 2 * (BLOCKS + 1), reuse0
    # A reuse distance above the model: no unit freed after forward, one gather each per step.
    assert reuse_all["forward_peak"] == root["root"] + BLOCKS * unit and reuse_all["gathers"] == BLOCKS + 1
    # ... unless the live bound says otherwise: kept only while live stays within it.
    assert reuse_capped["step_peak"] <= 4 * 2048 and BLOCKS + 1 < reuse_capped["gathers"] < 2 * BLOCKS + 1
    assert reuse_capped["losses"] == root["losses"], reuse_capped
    # A head of a block's size is a unit: kept from its forward (the last) to its backward (the first);
    # the last block is not (the head is used in between), and nothing else is live beside two units.
    assert head["units"] == [f"blocks.{i}" for i in range(BLOCKS)] + ["head"], head
    assert head["step_peak"] == 2 * unit and head["gathers"] == 2 * BLOCKS + 1, head


WIDTH = 1024  # one unit = 2 x 1024 x 1024 fp32 = 8 MiB; the model = 64 MiB
UNIT_MIB = 2 * WIDTH * WIDTH * 4 / 2**20


def _hwm_case(zero: dict) -> dict:
    # Two micro steps a step, the second measured: the gradient shard, made at the first micro step's
    # first reduction ([Note: gradient shard lifetime] in core/group.py), is live through all of the
    # measured one, so the peaks differ by what is gathered alone.
    engine = _engine(WIDTH, gas=2, **zero)
    meter = measure.PeakMemory(torch.device("cpu"))
    # 64 rows: each block computes long enough for the gathers in flight to land (the unbounded
    # prefetch then holds every unit), while activations stay small (256 KiB a layer).
    x = torch.randn(64, WIDTH)
    for _ in range(5):  # warm up (2 steps; first records the order, allocator settles), then 1 micro step
        engine.backward(engine(x))
        engine.step()
    measure.trim()
    base = meter.current()
    meter.reset()
    loss = engine(x)
    forward = meter.peak()
    engine.backward(loss)
    both = meter.peak()  # the high-water mark of forward and backward, not counting the step
    engine.step()
    engine.destroy()
    return {
        "forward_mib": (forward - base) / 2**20,
        "forward_backward_mib": (both - base) / 2**20,
        "method": meter.method,
    }


def _hwm_worker(rank: int, world: int) -> list[dict]:
    return subtests([{"zero": {}}, {"zero": UNBOUNDED}], _hwm_case)


@pytest.mark.slow
def test_process_peak_during_forward_and_backward_is_bounded():
    reports = run_distributed(_hwm_worker, 2, timeout=300, env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    for default, unbounded in reports:
        assert default["method"].startswith("RSS high-water"), default
        # Forward: the current unit + the prefetched next one (16 MiB) + activations (~8 MiB), not all
        # eight units (64 MiB; how many of those have landed at a moment depends on timing).
        assert default["forward_mib"] < 4 * UNIT_MIB, default
        assert unbounded["forward_mib"] > default["forward_mib"], (default, unbounded)
        # Backward adds the full gradients of units awaiting their reduce-scatter (and, at two ranks,
        # the halves the pairwise exchange sends and receives), the same with either prefetch; the
        # unbounded prefetch's units ahead add more: measured 20-23 MiB above the default's after the
        # pairwise reduce-scatter, ~0 on the code before the bounds (both gathered everything).
        assert unbounded["forward_backward_mib"] > default["forward_backward_mib"] + 2 * UNIT_MIB, (default, unbounded)


def _split_case(stage: int, gas: int) -> dict:
    """[Note: gathered buffers under glibc's mmap ceiling], with the ceiling cut to 5000 elements of
    fp32 so that the tiny GPT's blocks (12.4k elements) split: at stages 2/3 each unit's groups (not
    stage 3's persistent unit's) hold at most that many bytes or a single parameter, and training
    stays bit for bit DDP's."""
    cap = 20_000
    batches = gpt_batches(tiny_gpt_config(), batch_size=4)
    ref = train_ddp(
        gpt_model_fn(),
        batches,
        optimizer_fn=adamw,
        steps=3,
        grad_accum=gas,
        reduce_every_micro_step=True,
        record_params=True,
    )
    default = backend.GATHER_GROUP_BYTES
    backend.GATHER_GROUP_BYTES = cap
    try:
        ours = train_engine(gpt_model_fn(), batches, config=make_config(stage, gas), steps=3, record_params=True)
        model = gpt_model_fn()()
        engine, *_ = zeroshard.initialize(
            model=model, optimizer=adamw(model.parameters()), config=make_config(stage, gas)
        )
    finally:
        backend.GATHER_GROUP_BYTES = default
    groups = {
        unit.name: [(g.layout.numel * 4, len(g.params)) for g in unit.groups]
        for unit in engine.units
        if unit.reshards or stage == 2
    }
    engine.destroy()
    for name, sizes in groups.items():
        assert all(nbytes <= cap or count == 1 for nbytes, count in sizes), (name, sizes)
    assert max(len(sizes) for sizes in groups.values()) >= 3, groups
    assert_close(ours, ref, exact=True, what=f"stage {stage} gas {gas}, groups under {cap} bytes")
    return {"groups": groups}


def _split_worker(rank: int, world: int) -> list[dict]:
    return subtests([dict(stage=s, gas=g) for s in (2, 3) for g in (1, 2)], _split_case)


def test_units_split_into_groups_under_the_mmap_ceiling_train_as_ddp():
    print(run_distributed(_split_worker, 2, timeout=300)[0][0])


def _landed_case(stage: int) -> dict:
    """[Note: taken as they land]: at stages 2/3 a group about to make a new full gradient first takes
    the reductions that have landed, so the next unit's gradient reuses the buffer of the unit reduced
    before it instead of living beside it. So that this does not hang on timing, a reduction counts
    as landed once any later gradient has arrived (its finish then waits for it): each size of full
    gradient is then allocated once per backward (the blocks' twice before: the second while the
    first awaited its reduce-scatter), and training stays bit for bit DDP's."""
    unit_module = importlib.import_module("zeroshard.core.unit")
    lifecycle = importlib.import_module("zeroshard.core.lifecycle").Lifecycle
    spent = importlib.import_module("zeroshard.core.group").SpentGradients
    fresh: list[int] = []
    grads, issued = [0], {}
    originals = spent.take, unit_module.Unit.reduction_done, unit_module.Unit.reduce_grads, lifecycle._on_grad

    def take(self, numel, dtype, device):
        if not self._free.get((numel, dtype, device)):
            fresh.append(numel)
        return originals[0](self, numel, dtype, device)

    def reduce_grads(self, *args):
        issued[id(self)] = grads[0]
        return originals[2](self, *args)

    def on_grad(self, *args):
        grads[0] += 1
        return originals[3](self, *args)

    batches = gpt_batches(tiny_gpt_config(), batch_size=4)
    ref = train_ddp(gpt_model_fn(), batches, optimizer_fn=adamw, steps=3, record_params=True)
    spent.take, unit_module.Unit.reduce_grads, lifecycle._on_grad = take, reduce_grads, on_grad
    unit_module.Unit.reduction_done = lambda self: issued.get(id(self), -1) < grads[0]
    try:
        ours = train_engine(gpt_model_fn(), batches, config=make_config(stage, 1), steps=3, record_params=True)
    finally:
        spent.take, unit_module.Unit.reduction_done, unit_module.Unit.reduce_grads, lifecycle._on_grad = originals
    per_size = {numel: fresh.count(numel) for numel in set(fresh)}
    assert per_size and all(count == 3 for count in per_size.values()), per_size  # 3 backwards
    assert_close(ours, ref, exact=True, what=f"stage {stage}, reductions taken as they land")
    return {"fresh full gradients by size": per_size}


def _landed_worker(rank: int, world: int) -> list[dict]:
    return subtests([dict(stage=s) for s in (2, 3)], _landed_case)


def test_a_new_full_gradient_reuses_a_landed_reduction_buffer():
    print(run_distributed(_landed_worker, 2, timeout=300)[0])
