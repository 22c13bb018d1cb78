"""ZeRO++ (hpZ, qwZ, qgZ) and MiCS at stage 3 ([Note: ZeRO++ and MiCS] in core/unit.py), through
DeepSpeed's config keys, against plain stage 3 and DDP on the same model, data and seed.

Ranks 0-1 and 2-3 play two "nodes" of two ranks (LOCAL_WORLD_SIZE=2), so that the communicators
count bytes over the slow link ([Note: bytes over the slow link] in core/comm_bytes.py)."""

from __future__ import annotations

import pytest
import torch

import zeroshard
from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches, gpt_loss, train_ddp
from tests.zs_common import adamw, assert_close, full_params, gpt_model_fn, make_config
from zeroshard.config import ConfigKeyNotActedOnWarning, load_config
from zeroshard.core import quantize
from zeroshard.tools.demo.corpus import Batches, CharTokenizer, load_corpus
from zeroshard.tools.models.gpt import GPT, tiny_gpt_config

STEPS, GAS, CLIP = 3, 2, 0.05  # the clip binds: the norm is large at the start
NODE = {"LOCAL_WORLD_SIZE": "2"}
CURVE_STEPS, WINDOW, CURVE_LR = 200, 20, 3e-3
# qwZ + qgZ vs full-precision communication on the demo model: single losses are too noisy to
# compare (the two runs' trajectories part after a few dozen steps, as any change of rounding
# makes them), so the mean loss of every window of 20 steps must agree within CURVE_WINDOW_RTOL and
# the mean of the whole curve within CURVE_MEAN_RTOL (measured at 2 ranks: 1.0e-2 worst window,
# 3.5e-3 whole curve; see docs/zeropp.md).
CURVE_WINDOW_RTOL, CURVE_MEAN_RTOL = 3e-2, 1e-2


# -- quantization kernels (one process) -------------------------------------------------------------
@pytest.mark.parametrize("numel,block", [(1000, 256), (256, 256), (7, 4), (1, 256)])
def test_quantize_error_is_at_most_half_a_step(numel, block):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    x[: min(3, numel)] *= 100  # one large value coarsens its own block only
    q, scales = quantize.quantize(x, block)
    assert q.dtype == torch.int8 and q.numel() == quantize.blocks_for(numel, block) * block
    back = quantize.dequantize(q, scales, numel, block)
    step = scales.repeat_interleave(block)[:numel]  # each element's block scale
    assert ((back - x).abs() <= step / 2 * (1 + 1e-6)).all()
    assert float(scales.max()) == pytest.approx(float(x.abs().max()) / 127)


def test_quantize_zero_block_and_rows():
    x = torch.zeros(600)
    x[300:] = torch.linspace(-1, 1, 300)
    q, scales = quantize.quantize(x, 256)
    assert scales[0] == 0 and torch.equal(quantize.dequantize(q, scales, 600, 256)[:256], torch.zeros(256))
    rows = [torch.randn(10), torch.randn(10)]
    encoded = [quantize.quantize(r, 4) for r in rows]
    both = quantize.dequantize_rows(torch.cat([e[0] for e in encoded]), torch.cat([e[1] for e in encoded]), 2, 10, 4)
    for (q, s), out in zip(encoded, both):
        assert torch.equal(out, quantize.dequantize(q, s, 10, 4))


# -- config -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "key,value",
    [
        ("mics_shard_size", 0),
        ("mics_shard_size", -2),
        ("zero_hpz_partition_size", -1),
        ("zero_quantized_weights", "maybe"),
    ],
)
def test_bad_values_name_the_key(key, value):
    with pytest.raises(Exception, match=key):
        load_config(make_config(3, **{key: value}), world_size=4)


def test_below_stage_3_they_are_reported_not_acted_on():
    with pytest.warns(ConfigKeyNotActedOnWarning, match="zero_quantized_weights"):
        load_config(make_config(2, zero_quantized_weights=True), world_size=4)


# -- distributed ------------------------------------------------------------------------------------
def _train(config: dict, steps: int = STEPS, batches=None) -> dict:
    model = gpt_model_fn()()
    engine, *_ = zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config=config)
    batches = batches or gpt_batches(model.config)
    out = {"losses": [], "params_per_step": []}
    for step in range(steps):
        losses = []
        for micro in range(engine.gradient_accumulation_steps()):
            inputs, targets = batches(step, micro, engine.global_rank)
            loss = gpt_loss(engine, inputs, targets)
            engine.backward(loss)
            out["memory_before_step"] = engine.memory_report()  # hpZ's copies exist until the step
            engine.step()
            losses.append(loss.item())
        out["losses"].append(losses)
        out["params_per_step"].append(full_params(engine))
    out["params"] = out["params_per_step"][-1]
    out["comm"] = engine.sharded.comm_report()
    out["shard_numel"] = sum(g.master.numel() for g in engine.groups)
    out["padded_numel"] = sum(g.layout.padded_numel for g in engine.groups)
    out["memory"] = engine.memory_report()
    engine.destroy()
    return out


def _gathers(report: dict, group: str) -> int:
    return report.get("groups", {"world": report})[group]["calls"].get("all_gather", 0)


def _hpz_bit_exact() -> dict:
    plain = _train(make_config(3, gas=GAS, clip=CLIP))
    hpz = _train(make_config(3, gas=GAS, clip=CLIP, zero_hpz_partition_size=2))
    assert_close(hpz, plain, exact=True, what="hpZ h=2 vs stage 3")
    # The backward's gathers moved into the node group: the world's gathers are plain stage 3's
    # minus those (each is N/h = 2 node all-gathers there, one per shard of the rank's strided
    # piece), and none of the node group's bytes crossed a node.
    node_calls = _gathers(hpz["comm"], "secondary")
    assert node_calls > 0 and node_calls % 2 == 0
    moved = node_calls // 2
    assert _gathers(hpz["comm"], "world") == _gathers(plain["comm"], "world") - moved
    assert hpz["comm"]["groups"]["secondary"]["inter_node_bytes"].get("all_gather", 0) == 0
    assert (
        hpz["comm"]["groups"]["world"]["inter_node_bytes"]["all_gather"]
        < plain["comm"]["inter_node_bytes"]["all_gather"]
    )
    copy = hpz["memory_before_step"]["params"] - plain["memory_before_step"]["params"]
    # The secondary copy: the shards of the node's piece other than this rank's own, (1/h - 1/N) of
    # the model in fp32: a quarter at h = 2, N = 4 (the own shard is the rank's primary shard).
    assert copy == plain["padded_numel"] // 4 * 4, copy
    return {
        "moved": moved,
        "plain_inter": plain["comm"]["inter_node_bytes"]["all_gather"],
        "hpz_inter": hpz["comm"]["inter_node_bytes"]["all_gather"],
        "copy_bytes": copy,
        "stage3_before_step": plain["memory_before_step"]["total"],
    }


def _hpz_quantized() -> dict:
    """With qwZ the copies stay int8 blocks + scales: the same math as qwZ alone, ~1/4 of the memory."""
    plain = _train(make_config(3, gas=GAS, clip=CLIP), steps=1)
    qwz = _train(make_config(3, gas=GAS, clip=CLIP, zero_quantized_weights=True))
    hpz_qwz = _train(make_config(3, gas=GAS, clip=CLIP, zero_quantized_weights=True, zero_hpz_partition_size=2))
    assert_close(hpz_qwz, qwz, exact=True, what="hpZ h=2 + qwZ vs qwZ")
    copy = hpz_qwz["memory_before_step"]["params"] - plain["memory_before_step"]["params"]
    fp32 = plain["padded_numel"] // 4 * 4  # the fp32 copy of _hpz_bit_exact
    assert 0 < copy < 0.3 * fp32, (copy, fp32)
    return {"int8_copy_bytes": copy, "fp32_copy_bytes": fp32}


def _mics_vs_ddp(world: int) -> dict:
    config = make_config(3, gas=GAS, clip=CLIP, mics_shard_size=2)
    mics = _train(config)
    model_fn = gpt_model_fn()
    ref = train_ddp(
        model_fn,
        gpt_batches(model_fn().config),
        optimizer_fn=adamw,
        steps=STEPS,
        grad_accum=GAS,
        clip=CLIP,
        record_params=True,
    )
    if world == 2:  # k = world: plain stage 3, bit for bit
        assert_close(mics, _train(make_config(3, gas=GAS, clip=CLIP)), exact=True, what="MiCS k=2 at world 2")
    # Reduce-scatter over 2 then all-reduce over 2 sums in another order than DDP's all-reduce.
    assert_close(mics, ref, exact=False, rtol=1e-4, what=f"MiCS k=2 at world {world} vs DDP")
    assert mics["shard_numel"] * 2 == mics["padded_numel"]  # states / k per rank
    return {"shard_numel": mics["shard_numel"], "padded_numel": mics["padded_numel"], "memory": mics["memory"]}


def _demo_curve(zero: dict) -> list[float]:
    corpus = load_corpus()
    tokenizer = CharTokenizer(corpus.text)
    tokens = tokenizer.encode(corpus.text[:200_000])
    torch.manual_seed(0)
    model = GPT(tiny_gpt_config(vocab_size=tokenizer.vocab_size))
    config = make_config(3, clip=1.0, **zero)
    engine, *_ = zeroshard.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=CURVE_LR), config=config
    )
    batches = Batches(tokens, 16, 8, seed=0, rank=engine.global_rank)
    losses = []
    for _ in range(CURVE_STEPS):
        x, y = batches.next()
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    report = engine.sharded.comm_report()
    engine.destroy()
    return losses, report


def _quantized_curve() -> dict:
    exact, exact_comm = _demo_curve({})
    quantized, quantized_comm = _demo_curve({"zero_quantized_weights": True, "zero_quantized_gradients": True})
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    windows = [(mean(exact[i : i + WINDOW]), mean(quantized[i : i + WINDOW])) for i in range(0, CURVE_STEPS, WINDOW)]
    errors = [abs(q - e) / e for e, q in windows]
    whole = abs(mean(quantized) - mean(exact)) / mean(exact)
    assert max(errors) <= CURVE_WINDOW_RTOL and whole <= CURVE_MEAN_RTOL, (windows, whole)
    assert windows[-1][1] < 0.8 * windows[0][1]  # it trains
    data = lambda r: sum(v for k, v in r["inter_node_bytes"].items() if k != "control")  # noqa: E731
    assert data(quantized_comm) < 0.4 * data(exact_comm)  # int8 + scales vs fp32
    return {
        "worst_window": max(errors),
        "whole": whole,
        "windows": windows,
        "inter_exact": data(exact_comm),
        "inter_quantized": data(quantized_comm),
    }


def _bad_sizes() -> None:
    for key, value in (("mics_shard_size", 3), ("zero_hpz_partition_size", 3)):
        model = gpt_model_fn()()
        with pytest.raises(ValueError, match=f"{key}={value}"):
            zeroshard.initialize(
                model=model, optimizer=adamw(model.parameters()), config=make_config(3, **{key: value})
            )


def _worker4(rank: int, world: int, cases: tuple) -> list:
    return subtests(
        [{"case": c} for c in cases],
        lambda case: {
            "hpz": _hpz_bit_exact,
            "mics": lambda: _mics_vs_ddp(world),
            "sizes": _bad_sizes,
            "hpz_qwz": _hpz_quantized,
        }[case](),
    )


def _worker2(rank: int, world: int, curve: bool) -> list:
    return subtests(
        [{"case": c} for c in ("mics", "curve")[: 1 + curve]],
        lambda case: {"mics": lambda: _mics_vs_ddp(world), "curve": _quantized_curve}[case](),
    )


@pytest.mark.slow
def test_hpz_and_mics_at_4_ranks():
    hpz, mics, _ = run_distributed(_worker4, 4, timeout=600, env=NODE, cases=("hpz", "mics", "sizes"))[0]
    print(f"hpZ: {hpz}\nMiCS: shard {mics['shard_numel']} of {mics['padded_numel']}, memory {mics['memory']}")


@pytest.mark.slow
def test_hpz_with_quantized_weights_at_4_ranks():
    print(run_distributed(_worker4, 4, timeout=600, env=NODE, cases=("hpz_qwz",))[0])


def test_mics_at_2_ranks_is_stage_3():
    run_distributed(_worker2, 2, timeout=300, curve=False)


@pytest.mark.slow
def test_quantized_loss_curve_at_2_ranks():
    """Two "machines" of one rank each: every byte of the data collectives crosses the slow link."""
    _, curve = run_distributed(_worker2, 2, timeout=600, env={"LOCAL_WORLD_SIZE": "1"}, curve=True)[0]
    print(f"qwZ+qgZ curve: {curve}")
