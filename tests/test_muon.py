"""Muon under ZeRO: each matrix updated whole, by one rank, against DDP with the same torch optimizers.

The oracle steps a `torch.optim.Muon` over the hidden matrices and a `torch.optim.AdamW` over the
rest, one after the other, under DistributedDataParallel; zeroshard gets the same two optimizers as a
list. At 2 ranks fp32 every stage is bit for bit (the reduce-scatter hands the owner the bits DDP's
all-reduce gives every rank).

[Note: Muon amplifies summation order]
At 4 ranks the gradients differ from DDP's in the last bits (another summation order), and torch's
Muon orthogonalises in bfloat16: a one-ulp change of a gradient moves an update element by up to one
bf16 step (2^-8 relative), so after 5 steps two runs that differ only in summation order are about
1e-2 apart relative to a matrix, not 1e-5. The test measures that floor in the same ranks (the
oracle's math in one process, summing the 4 ranks' gradients in rank order, against DDP) and holds
zeroshard to within 3x of it; a wrong owner, a lost or doubled update would be off by 1e-1 or more.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

import zeroshard
from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches, gpt_loss, train_ddp, train_single
from tests.zs_common import (
    adamw,
    assert_close,
    full_params,
    gather_masters,
    gpt_model_fn,
    make_config,
    relative_error,
    train_engine,
)
from zeroshard import MuonWithAdamW
from zeroshard.config import ConfigKeyNotActedOnWarning
from zeroshard.core.flat import FlatLayout
from zeroshard.core.owners import OwnerPlan
from zeroshard.tools.models.gpt import tiny_gpt_config

STEPS = 5
MUON_LR, ADAM_LR = 0.02, 1e-2
CONFIG = tiny_gpt_config()
EMBEDDINGS = {CONFIG.vocab_size, CONFIG.block_size}  # first dimension of wte and wpe


def _hidden(params) -> tuple[list, list]:
    """The test GPT's hidden matrices (2-D, not an embedding), and the other parameters."""
    params = list(params)
    hidden = [p for p in params if p.ndim == 2 and p.shape[0] not in EMBEDDINGS]
    return hidden, [p for p in params if all(p is not h for h in hidden)]


def muon_and_adamw(params) -> list[torch.optim.Optimizer]:
    hidden, rest = _hidden(params)
    return [torch.optim.Muon(hidden, lr=MUON_LR), torch.optim.AdamW(rest, lr=ADAM_LR, weight_decay=0.1)]


class Fp32Muon(torch.optim.Optimizer):
    """A user's Muon variant: Nesterov momentum, then the quintic Newton-Schulz iteration in fp32 (torch's
    runs in bfloat16), scaled by sqrt(max(1, rows / cols)). Declared below as a whole-parameter optimizer."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - group["momentum"])
                x = p.grad.lerp(buf, group["momentum"])
                x = x / (x.norm() + 1e-7)
                tall = x.shape[0] > x.shape[1]
                x = x.T if tall else x
                for _ in range(5):
                    a = x @ x.T
                    x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
                x = x.T if tall else x
                p.add_(x, alpha=-group["lr"] * max(1.0, p.shape[0] / p.shape[1]) ** 0.5)


zeroshard.register_whole_parameter_optimizer(Fp32Muon)


def fp32_muon_and_adamw(params) -> list[torch.optim.Optimizer]:
    hidden, rest = _hidden(params)
    return [Fp32Muon(hidden, lr=MUON_LR), torch.optim.AdamW(rest, lr=ADAM_LR, weight_decay=0.1)]


class _OneAfterTheOther:
    """The oracle: torch's recipe, two optimizers stepped in turn."""

    build = staticmethod(muon_and_adamw)

    def __init__(self, params):
        self.optimizers = self.build(params)

    def step(self):
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True):
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


class _Fp32OneAfterTheOther(_OneAfterTheOther):
    build = staticmethod(fp32_muon_and_adamw)


# -- planning and layout, in one process ---------------------------------------------------------------


def _gpt_block_shapes(d: int, blocks: int) -> list[list[torch.Size]]:
    return [[torch.Size([3 * d, d]), torch.Size([d, d]), torch.Size([4 * d, d]), torch.Size([d, 4 * d])]] * blocks


@pytest.mark.parametrize("uneven", [False, True], ids=["equal-slices", "uneven-slices"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_owners_balance_the_newton_schulz_work_over_a_gpt(world, uneven):
    plan = OwnerPlan(world, frozenset({0}), uneven=uneven)
    for shapes in _gpt_block_shapes(64, 12):
        owners = plan.assign(shapes)
        assert len(owners) == 4 and all(0 <= o < world for o in owners)
    assert plan.imbalance <= 1.15, plan.summary()
    if uneven:  # no padding; no rank stores more than the mean plus the largest matrix (4d²)
        assert plan.padding == 0.0 and sum(plan.elements) == plan.numel, plan.summary()
        assert max(plan.elements) <= plan.numel / world + 4 * 64 * 64, plan.elements


def test_uneven_owners_balance_the_model_not_each_unit():
    plan = OwnerPlan(2, frozenset({0}), uneven=True)
    d2 = 8 * 8
    first, second = (plan.assign(shapes) for shapes in _gpt_block_shapes(8, 2))
    split = [
        [sum(s.numel() for s, o in zip(_gpt_block_shapes(8, 1)[0], owners) if o == r) for r in (0, 1)]
        for owners in (first, second)
    ]
    assert split == [[7 * d2, 5 * d2], [5 * d2, 7 * d2]], split  # 7d² | 5d², then the other way round
    assert plan.elements == [12 * d2, 12 * d2] and plan.imbalance == 1.0, plan.summary()


def test_owner_padding_is_the_least_a_whole_matrix_split_allows():
    # one block: 3d², d², 4d², 4d² -> at 2 ranks 7d² | 5d² (the best split), at 4 ranks 4 | 4 | 3 | 1
    for world, padding in ((1, 0.0), (2, 2 / 12), (4, 4 / 12)):
        plan = OwnerPlan(world, frozenset({0}))
        plan.assign(_gpt_block_shapes(8, 1)[0])
        assert plan.padding == pytest.approx(padding), (world, plan.summary())


def test_spans_of_units_split_whole_matrices_evenly():
    block = _gpt_block_shapes(8, 1)[0]
    assert OwnerPlan(2, frozenset({0})).plan_spans([block] * 5) == [[0, 1], [2, 3], [4]]
    assert OwnerPlan(4, frozenset({0})).plan_spans([block] * 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert OwnerPlan(1, frozenset({0})).plan_spans([block] * 2) == [[0], [1]]
    plan = OwnerPlan(4, frozenset({0}))
    for span in plan.plan_spans([block] * 8):
        plan.assign([s for _ in span for s in block])
    assert plan.padding == 0.0 and plan.imbalance == 1.0


def test_an_owner_aligned_layout_keeps_each_parameter_whole_in_its_owners_slice():
    shapes = [torch.Size([6, 4]), torch.Size([3]), torch.Size([2, 4]), torch.Size([5, 5])]
    owners = [1, 0, 0, 2]
    layout = FlatLayout(["a", "b", "c", "d"], shapes, 3, owners)
    assert layout.shard_numel == 25 and layout.padded_numel == 75
    for slot, owner in zip(layout.slots, owners):
        start, end = layout.shard_range(owner)
        assert start <= slot.offset and slot.offset + slot.numel <= end, slot
    assert layout.gaps() == [(11, 25), (49, 50)]
    pieces = list(layout.pieces_in(0, 75))
    assert [p[0].name for p in pieces] == ["b", "c", "a", "d"]  # buffer order
    full = torch.arange(75.0)
    views = layout.views(full)
    assert [v.shape for v in views] == shapes and views[0][0, 0] == 25
    with pytest.raises(ValueError, match="owners"):
        FlatLayout(["a"], [torch.Size([2])], 2, [2])


def test_an_uneven_layout_holds_each_ranks_parameters_back_to_back_without_padding():
    shapes = [torch.Size([6, 4]), torch.Size([3]), torch.Size([2, 4]), torch.Size([5, 5])]
    layout = FlatLayout(["a", "b", "c", "d"], shapes, 4, [1, 0, 0, 2], uneven=True)
    assert not layout.even and layout.counts == (11, 24, 25, 0)
    assert layout.padded_numel == layout.numel == 60 and layout.gaps() == [] and layout.padding == ()
    assert [layout.shard_range(r) for r in range(4)] == [(0, 11), (11, 35), (35, 60), (60, 60)]
    assert [layout.shard_size(r) for r in range(4)] == [11, 24, 25, 0]
    assert [s.offset for s in layout.slots] == [11, 0, 3, 35]
    even = FlatLayout(["a", "b", "c", "d"], shapes, 4, [1, 0, 0, 2])
    assert even.even and even.counts is None and even.shard_size(3) == even.shard_numel == 25
    with pytest.raises(ValueError, match="uneven slices need owners"):
        FlatLayout(["a"], [torch.Size([2])], 2, uneven=True)


def test_muon_with_adamw_steps_what_the_two_torch_optimizers_step():
    def model():
        torch.manual_seed(0)
        return zeroshard.tools.models.gpt.GPT(CONFIG)

    inputs, targets = gpt_batches(CONFIG)(0, 0, 0)
    ours, theirs = model(), model()
    combined = MuonWithAdamW.combine(*muon_and_adamw(ours.parameters()))
    separate = _OneAfterTheOther(theirs.parameters())
    for _ in range(3):
        for net, opt in ((ours, combined), (theirs, separate)):
            gpt_loss(net, inputs, targets).backward()
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="one torch.optim.Muon"):
        MuonWithAdamW.combine(torch.optim.SGD(ours.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="use_muon"):
        MuonWithAdamW([{"params": list(ours.parameters())}])


def test_the_config_builds_muon_for_hidden_matrices_as_deepspeed_splits():
    model = zeroshard.tools.models.gpt.GPT(CONFIG)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "muon", "params": {"lr": 0.01, "adam_lr": 1e-3, "momentum": 0.9, "ns_method": "gram"}},
    }
    cfg = zeroshard.load_config(config, world_size=1)
    names = {id(p): n for n, p in model.named_parameters()}
    from zeroshard.compat.optimizers import build_optimizer

    optimizer = build_optimizer(cfg.optimizer, list(model.parameters()), names)
    muon, adamw = optimizer.param_groups
    assert muon["use_muon"] and not adamw["use_muon"]
    assert (muon["lr"], muon["momentum"], adamw["lr"], adamw["betas"], adamw["eps"]) == (
        0.01,
        0.9,
        1e-3,
        (0.9, 0.95),
        1e-10,
    )
    in_muon = {names[id(p)] for p in muon["params"]}
    # DeepSpeed's rule: 2-D and the name has neither "embed" nor "lm_head" (this GPT names them wte / wpe)
    assert in_muon == {n for n, p in model.named_parameters() if p.ndim == 2}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zeroshard.load_config(config, world_size=1)
    assert any(issubclass(w.category, ConfigKeyNotActedOnWarning) and "ns_method" in str(w.message) for w in caught)


def test_a_declared_whole_parameter_optimizer_is_sharded_like_muon():
    from zeroshard.compat.optimizers import OptimizerNotShardableError, check_shardable
    from zeroshard.core.optim.whole import whole_param_groups

    model = zeroshard.tools.models.gpt.GPT(CONFIG)
    combined = MuonWithAdamW.combine(*fp32_muon_and_adamw(model.parameters()))
    assert isinstance(combined.muon, Fp32Muon) and combined.muon_class is Fp32Muon
    assert whole_param_groups(combined) == frozenset({0})
    check_shardable(combined)

    class Lookahead(torch.optim.SGD):  # neither elementwise-known nor declared... until it is
        def step(self, closure=None):
            return super().step(closure)

    assert whole_param_groups(Fp32Muon(_hidden(model.parameters())[0])) == frozenset({0})
    with pytest.raises(OptimizerNotShardableError, match="register_whole_parameter_optimizer"):
        check_shardable(torch.optim.LBFGS(model.parameters()))
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        zeroshard.register_whole_parameter_optimizer(object)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        zeroshard.register_whole_parameter_optimizer(Lookahead, groups="all")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="register_whole_parameter_optimizer"):
        MuonWithAdamW([{"params": _hidden(model.parameters())[0], "use_muon": True}], muon=torch.optim.SGD)
    with pytest.raises(ValueError, match="one torch.optim.Muon"):
        MuonWithAdamW.combine(torch.optim.LBFGS(model.parameters()), torch.optim.AdamW(model.parameters()))


# -- against DDP, on gloo ranks ------------------------------------------------------------------------


def _parity_case(stage: int, gas: int, clip: float, world: int) -> dict:
    batches = gpt_batches(CONFIG, batch_size=4)
    model_fn = gpt_model_fn() if world == 2 else gpt_model_fn(bias=False)  # tests/test_parity.py: the key bias
    ref = train_ddp(
        model_fn,
        batches,
        optimizer_fn=_OneAfterTheOther,
        steps=STEPS,
        grad_accum=gas,
        clip=clip,
        reduce_every_micro_step=stage >= 2,
        record_params=True,
    )
    ours = train_engine(
        model_fn,
        batches,
        config=make_config(stage, gas, clip),
        optimizer_fn=muon_and_adamw,
        steps=STEPS,
        record_params=True,
    )
    what = f"Muon stage {stage} gas {gas} clip {clip} world {world}"
    if world == 2:
        assert_close(ours, ref, exact=True, what=what)
    else:  # [Note: Muon amplifies summation order]
        kwargs = dict(grad_accum=gas, clip=clip, reduce_every_micro_step=stage >= 2, record_params=True)
        floor = _within_summation_floor(ours, ref, model_fn, batches, what, **kwargs)
        assert floor > 0, what
    if clip:
        assert min(ref["grad_norms"]) > clip, "clipping must engage"
    assert ref["losses"][-1][0] < ref["losses"][0][0], "the task must be learnable"
    return {"stage": stage, "bytes": ours["comm_per_step"]}


def _declared_case(stage: int, world: int, offload: bool = False) -> None:
    """A Muon variant the user declared, with its Newton-Schulz in fp32: bit for bit at 2 ranks, within
    1e-5 of DDP at 4 (summation order alone, unamplified by bfloat16); also with the optimizer states
    (and at stage 3 the parameters) offloaded to CPU memory."""
    batches = gpt_batches(CONFIG, batch_size=4)
    model_fn = gpt_model_fn() if world == 2 else gpt_model_fn(bias=False)
    kwargs = dict(steps=STEPS, reduce_every_micro_step=stage >= 2, record_params=True)
    ref = train_ddp(model_fn, batches, optimizer_fn=_Fp32OneAfterTheOther, **kwargs)
    zero = _cpu_offload(stage) if offload else {}
    ours = train_engine(
        model_fn,
        batches,
        config=make_config(stage, **zero),
        optimizer_fn=fp32_muon_and_adamw,
        steps=STEPS,
        record_params=True,
    )
    what = f"declared fp32 Muon stage {stage} world {world}{' offload' if offload else ''}"
    if world == 2:
        assert_close(ours, ref, exact=True, what=what)
    else:
        error = _largest_error(ours, ref)
        assert error <= 1e-5, f"{what}: {error:.2e} from DDP"


def _offload_case(stage: int, directory: str) -> None:
    """Optimizer states (and at stage 3 parameters) offloaded to CPU memory, then to files (NVMe):
    DDP's values bit for bit, with AdamW's groups streamed through the store and Muon's matrices
    stepped beside their states, which with NVMe live in swap files too ([Note: whole-parameter
    states in a store] in core/optim/stored.py)."""
    batches = gpt_batches(CONFIG, batch_size=4)
    ref = train_ddp(
        gpt_model_fn(), batches, optimizer_fn=_OneAfterTheOther, steps=3, reduce_every_micro_step=stage >= 2
    )
    zero = _cpu_offload(stage)
    ours = train_engine(
        gpt_model_fn(), batches, config=make_config(stage, **zero), optimizer_fn=muon_and_adamw, steps=3
    )
    assert_close(ours, ref, exact=True, what=f"Muon offload stage {stage}")
    where = {"device": "nvme", "nvme_path": directory}
    nvme = {"offload_optimizer": where, **({"offload_param": where} if stage == 3 else {})}
    ours = train_engine(
        gpt_model_fn(), batches, config=make_config(stage, **nvme), optimizer_fn=muon_and_adamw, steps=3
    )
    assert_close(ours, ref, exact=True, what=f"Muon NVMe offload stage {stage}")
    assert ours["memory"]["optimizer"] <= 8 * 200, ours["memory"]  # step counters only: the rest is in files


def _partition_case(zero: dict) -> None:
    """Stage 3 with MiCS or hpZ at 4 ranks: owners are planned over the partition group; within the
    summation-order floor of DDP ([Note: Muon amplifies summation order])."""
    batches, model_fn = gpt_batches(CONFIG, batch_size=4), gpt_model_fn(bias=False)
    kwargs = dict(reduce_every_micro_step=True, record_params=True)
    ref = train_ddp(model_fn, batches, optimizer_fn=_OneAfterTheOther, steps=STEPS, **kwargs)
    ours = train_engine(
        model_fn, batches, config=make_config(3, **zero), optimizer_fn=muon_and_adamw, steps=STEPS, record_params=True
    )
    _within_summation_floor(ours, ref, model_fn, batches, str(zero), **kwargs)


def _within_summation_floor(ours: dict, ref: dict, model_fn, batches, what: str, **kwargs) -> float:
    """Assert that `ours` is within 3x of what summation order alone moves the oracle from DDP (the
    oracle's math in one process, the ranks' gradients summed in rank order: [Note: Muon amplifies
    summation order]); returns that floor."""
    world = dist.get_world_size()
    floor_run = train_single(model_fn, batches, optimizer_fn=_OneAfterTheOther, steps=STEPS, world_size=world, **kwargs)
    floor, error = _largest_error(floor_run, ref), _largest_error(ours, ref)
    assert error <= 3 * floor + 1e-5, f"{what}: {error:.2e} from DDP; summation order alone: {floor:.2e}"
    return floor


def _largest_error(run: dict, ref: dict) -> float:
    """The largest relative difference of any parameter from the oracle's at any recorded step."""
    return max(_worst(a, b) for a, b in zip(run["params_per_step"], ref["params_per_step"]))


def _cpu_offload(stage: int) -> dict:
    """zero_optimization keys: optimizer states, and at stage 3 parameters, in CPU memory."""
    zero: dict = {"offload_optimizer": {"device": "cpu"}, "sub_group_size": 1000}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    return zero


def _worst(params: dict, ref: dict) -> float:
    return max(relative_error(name, params[name], ref[name]) for name in ref)


def _bytes_case(stage: int) -> dict:
    """Bytes a step moves with Muon against AdamW on the same model: equal at every stage (stages 1/2:
    spans of units split the matrices evenly; stage 3: uneven slices, no padding)."""
    model = dict(n_layer=4)
    batches = gpt_batches(tiny_gpt_config(**model), batch_size=4)
    runs = {}
    for name, optimizer_fn in (("adamw", adamw), ("muon", muon_and_adamw)):
        runs[name] = train_engine(
            gpt_model_fn(**model), batches, config=make_config(stage), optimizer_fn=optimizer_fn, steps=2
        )
    ratio = runs["muon"]["comm_per_step"] / runs["adamw"]["comm_per_step"]
    assert ratio <= 1.0 + 1e-3, (stage, ratio)
    if stage == 3:
        assert runs["muon"]["whole_padding"] == 0.0, runs["muon"]["whole_padding"]
    return {"stage": stage, "ratio": ratio}


def _updates_per_matrix(stage: int) -> dict:
    """Count, with the inner Muon's step pre-hook, which matrices each rank's Muon updates (the
    parameters it is given a gradient for): each must be updated by exactly one rank per step."""
    model = gpt_model_fn()()
    hidden = {n for n, p in model.named_parameters() if p.ndim == 2 and p.shape[0] not in EMBEDDINGS}
    engine, *_ = zeroshard.initialize(
        model=model, optimizer=muon_and_adamw(model.parameters()), config=make_config(stage)
    )
    names = {
        id(m.view): g.layout.slots[m.slot].name for g in engine.groups for m in engine.optimizer.matrices.get(id(g), [])
    }
    counts: dict[str, int] = {}

    def count(muon, args, kwargs):
        for group in muon.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    counts[names[id(p)]] = counts.get(names[id(p)], 0) + 1

    engine.optimizer.optimizer.muon.register_step_pre_hook(count)
    whole = [g for g in engine.groups if g.layout.owners is not None]
    stored = engine.comm.all_gather_objects(sum(g.layout.shard_size(g.rank) for g in whole), "test: stored")
    batches = gpt_batches(CONFIG, batch_size=4)
    for step in range(2):
        engine.backward(gpt_loss(engine, *batches(step, 0, engine.global_rank)))
        engine.step()
    every = engine.comm.all_gather_objects(counts, "test: Muon updates")
    engine.destroy()
    total: dict[str, int] = {}
    for per_rank in every:
        for name, n in per_rank.items():
            total[name] = total.get(name, 0) + n
    once = 1 if stage >= 1 else dist.get_world_size()  # stage 0 is DDP: every rank updates every matrix
    assert set(total) == hidden and set(total.values()) == {2 * once}, (stage, total)  # 2 steps
    if stage >= 1:
        assert all(len(per_rank) < len(hidden) for per_rank in every), every  # split between ranks
    if stage == 3:  # uneven slices: each rank stores its matrices, at most the mean plus the largest one
        largest = max(slot.numel for g in whole for slot in g.layout.slots)
        assert max(stored) <= sum(stored) / len(stored) + largest, (stored, largest)
        assert sum(stored) == sum(g.layout.numel for g in whole), stored
    return total


def _resume_case(saved_stage: int, loaded_stage: int, directory: str) -> None:
    """Save after 2 steps, load into a fresh engine (another stage), train 2 more: as if never stopped."""
    batches = gpt_batches(CONFIG, batch_size=4)

    def engine_at(stage):
        model = gpt_model_fn()()
        engine, *_ = zeroshard.initialize(
            model=model, optimizer=muon_and_adamw(model.parameters()), config=make_config(stage)
        )
        return engine

    def train(engine, steps):
        for step in steps:
            engine.backward(gpt_loss(engine, *batches(step, 0, engine.global_rank)))
            engine.step()

    straight = engine_at(loaded_stage)
    train(straight, range(4))
    expected = full_params(straight)
    straight.destroy()
    first = engine_at(saved_stage)
    train(first, range(2))
    first.save_checkpoint(directory, tag=f"muon{saved_stage}{loaded_stage}")
    first.destroy()
    second = engine_at(loaded_stage)
    second.load_checkpoint(directory, tag=f"muon{saved_stage}{loaded_stage}")
    train(second, range(2, 4))
    got = full_params(second)
    second.destroy()
    for name in expected:
        assert torch.equal(got[name], expected[name]), (saved_stage, loaded_stage, name)


def _bf16_case(stage: int) -> float:
    """bf16 compute, fp32 masters: the recipe of tests/test_precision.py with Muon + AdamW on the masters
    (2 ranks emulated in one process, gradients averaged in bf16 in rank order)."""
    batches, world, steps = gpt_batches(CONFIG, batch_size=4), dist.get_world_size(), 5
    model = gpt_model_fn()()
    config = make_config(stage)
    config["bf16"] = {"enabled": True}
    engine, *_ = zeroshard.initialize(model=model, optimizer=muon_and_adamw(model.parameters()), config=config)
    for step in range(steps):
        engine.backward(gpt_loss(engine, *batches(step, 0, engine.global_rank)))
        engine.step()
    ours = gather_masters(engine)
    engine.destroy()
    master = gpt_model_fn()()
    compute = copy.deepcopy(master).to(torch.bfloat16)
    optimizer = _OneAfterTheOther(master.parameters())
    for step in range(steps):
        per_rank = []
        for rank in range(world):
            compute.zero_grad(set_to_none=True)
            gpt_loss(compute, *batches(step, 0, rank)).float().backward()
            per_rank.append([p.grad * (1.0 / world) for p in compute.parameters()])
        for p32, grads in zip(master.parameters(), zip(*per_rank)):
            total = grads[0].clone()
            for g in grads[1:]:
                total += g
            p32.grad = total.float()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for p16, p32 in zip(compute.parameters(), master.parameters()):
                p16.copy_(p32)
    for name, p in master.named_parameters():
        assert torch.equal(ours[name], p.detach()), (stage, name, relative_error(name, ours[name], p.detach()))
    return 0.0


def _composable_case() -> None:
    """zeroshard.shard takes the pair too; plain loss.backward() and step()."""
    batches = gpt_batches(CONFIG, batch_size=4)
    ref = train_ddp(gpt_model_fn(), batches, optimizer_fn=_OneAfterTheOther, steps=3, reduce_every_micro_step=True)
    model = gpt_model_fn()()
    sharded = zeroshard.shard(
        model, muon_and_adamw(model.parameters()), stage=3, gathering=zeroshard.GatheringPolicy(persistence_threshold=0)
    )
    for step in range(3):
        gpt_loss(sharded, *batches(step, 0, dist.get_rank())).backward()
        sharded.step()
    sharded.wait_parameters()
    with sharded.gathered_parameters(list(model.parameters())):
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), ref["params"][name]), name
    sharded.destroy()


def _worker(rank: int, world: int, directory: str) -> dict:
    # At 4 ranks (owners of whole matrices spread over more ranks, sums in another order) the harder
    # half of each grid: accumulation with clipping, and offload; 2 ranks run all of it, bit for bit.
    schedules = ((1, 0.0), (2, 0.05)) if world == 2 else ((2, 0.05),)
    cases = [dict(stage=s, gas=g, clip=c, world=world) for s in range(4) for g, c in schedules]
    out = {"parity": subtests(cases, _parity_case)}
    out["bytes"] = subtests([dict(stage=s) for s in range(1, 4)], _bytes_case)
    offloads = (False, True) if world == 2 else (True,)
    subtests([dict(stage=s, world=world, offload=o) for s in range(1, 4) for o in offloads], _declared_case)
    if world == 4:
        subtests([dict(zero={"mics_shard_size": 2}), dict(zero={"zero_hpz_partition_size": 2})], _partition_case)
    if world == 2:
        out["updates"] = subtests([dict(stage=s) for s in range(4)], _updates_per_matrix)
        out["resume"] = subtests(
            [dict(saved_stage=a, loaded_stage=b, directory=directory) for a, b in ((3, 1), (1, 3), (2, 2))],
            _resume_case,
        )
        _composable_case()
        out["bf16"] = subtests([dict(stage=s) for s in range(1, 4)], _bf16_case)
        out["offload"] = subtests([dict(stage=s, directory=directory) for s in range(1, 4)], _offload_case)
    return out


# -- checkpoints at another world size ----------------------------------------------------------------
# An untied head: a unit of its own holding one matrix, so at 4 ranks three of them own nothing in it.
RESHARD_MODEL = dict(tie_weights=False, vocab_size=512)


def _reshard_engine(stage: int, world: int):
    model = gpt_model_fn(**RESHARD_MODEL)()
    config = make_config(stage, micro=8 // world)
    engine, *_ = zeroshard.initialize(model=model, optimizer=muon_and_adamw(model.parameters()), config=config)
    return engine


def _save_after_training(rank: int, world: int, root: str) -> None:
    engine = _reshard_engine(2, world)
    batches = gpt_batches(tiny_gpt_config(**RESHARD_MODEL), batch_size=8 // world)
    for step in range(2):
        engine.backward(gpt_loss(engine, *batches(step, 0, rank)))
        engine.step()
    engine.save_checkpoint(f"{root}/trained", tag="t")
    engine.destroy()


def _load_and_save(rank: int, world: int, root: str, source: str, stages: list[int]) -> None:
    for stage in stages:
        engine = _reshard_engine(stage, world)
        engine.load_checkpoint(f"{root}/{source}", tag="t")
        engine.save_checkpoint(f"{root}/{source}-at{world}-stage{stage}", tag="t")
        engine.destroy()


def test_muon_checkpoints_reshard_bit_for_bit_across_world_sizes_and_stages(tmp_path):
    """Saved at 2 ranks (stage 2), loaded and saved again at 4 ranks (stages 1 and 3), then back at 2
    (stage 3): every checkpoint holds the same masters, Muon momenta and AdamW moments by name."""
    from tests.checkpoint_helpers import checkpoint_states, state_difference

    root = str(tmp_path)
    run_distributed(_save_after_training, 2, timeout=300, root=root)
    run_distributed(_load_and_save, 4, timeout=300, root=root, source="trained", stages=[1, 3])
    run_distributed(_load_and_save, 2, timeout=300, root=root, source="trained-at4-stage3", stages=[3])
    original = checkpoint_states(f"{root}/trained")
    assert any("momentum_buffer" in entry for name, entry in original.items() if name.endswith("lm_head.weight"))
    for resaved in ("trained-at4-stage1", "trained-at4-stage3", "trained-at4-stage3-at2-stage3"):
        assert state_difference(checkpoint_states(f"{root}/{resaved}"), original) is None, resaved


@pytest.mark.parametrize("world", [2, 4])
def test_muon_matches_ddp_with_the_same_torch_optimizers(world, tmp_path):
    reports = run_distributed(_worker, world, timeout=600, directory=str(tmp_path))
    assert all(r["parity"] == reports[0]["parity"] for r in reports)
