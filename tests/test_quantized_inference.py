"""ZeRO-Inference with quantized weights in the store ([Note: quantized weight store] in
inference/store.py) and speculative decoding with a resident draft ([Note: exact speculative
decoding] in inference/speculative.py), against the unsharded model on gloo at 1 and 2 ranks:
  * a store's packing of whole parameters and raw pieces dequantizes to what `quantize` then
    `dequantize` give, at 8 and 4 bits, both forms, odd and even group sizes;
  * an engine loaded from a sharded safetensors checkpoint into an int8 / int4 store (CPU and NVMe)
    computes the logits of the unsharded model whose matrices went through the same quantization,
    bit for bit, reads the packed bytes only, and generates its tokens;
  * speculative greedy decoding (the engine's own 4-bit copy as draft, or a small model the user
    gives) produces the unsharded model's greedy tokens; sampled tokens follow the target's
    distribution (a chi-square test);
  * a process capped below the fp32 weights loads and generates from int4 weights in memory;
  * packed matmuls ([Note: packed matmuls] in inference/packed.py): the int4 kernel's form
    matches torch's own converter and its dequantization; an engine whose layers multiply packed
    computes the logits and tokens of the unsharded model made to compute the same way, bit for
    bit, and every reader outside the forward sees the dequantized weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.extras import needs
from tests.harness import TEARDOWN_ABORT, grid, run_distributed, subtests
from tests.hf_models import ENV
from tests.inference_helpers import capped_model, hf_config, run_capped
from zeroshard.inference import int4, store as quantized
from zeroshard.inference.quantization import QuantSpec, dequantize, quantize, unpack_codes
from zeroshard.inference.store import QuantizedStore
from zeroshard.offload import CPUStore

BLOCK = int4.kernel_block()
needs_kernel = pytest.mark.skipif(
    BLOCK is None, reason="torch's int4 CPU kernel uses a layout zeroshard does not know on this CPU"
)

pytestmark = needs("transformers", extra="hf")

VOCAB = 48


def _model(seed: int, layers: int = 2, width: int = 64, vocab: int = VOCAB, special_tokens: bool = True):
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(hf_config("llama", layers, width, vocab, special_tokens)).eval()


def _fake_quantized(model, spec: QuantSpec):
    """`model` with every matrix replaced by its quantized-then-dequantized values: the oracle."""
    import copy

    oracle = copy.deepcopy(model)
    with torch.no_grad():
        for param in oracle.parameters():
            if param.dim() >= 2:
                param.copy_(dequantize(quantize(param, spec)))
    return oracle


def _config(store: str, swap: str, spec: QuantSpec | None) -> dict:
    offload = {"device": "cpu"} if store == "cpu" else {"device": "nvme", "nvme_path": swap}
    config: dict = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": offload,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 1,
        },
        "zeroshard": {"comm_timeout_s": 60},
    }
    if spec is not None:
        config["weight_quantization"] = {
            "quantized_initialization": {
                "num_bits": spec.num_bits,
                "group_size": spec.group_size,
                "group_dim": spec.group_dim,
                "symmetric": spec.symmetric,
            }
        }
    return config


# -- the store's arithmetic, one process ----------------------------------------------------------------
@pytest.mark.parametrize("spec", [QuantSpec(8, 64), QuantSpec(4, 32), QuantSpec(4, 5, symmetric=True), QuantSpec(8, 7)])
def test_store_packs_whole_parameters_and_keeps_the_rest_raw(spec, monkeypatch):
    monkeypatch.setattr(
        quantized, "CHUNK", 130
    )  # a few rows at a time: a chunk's bytes and scales land where the whole's would
    gen = torch.Generator().manual_seed(0)
    shapes = [(6, 64), (64,), (3, 7, 10), (5, 70)]
    values = [torch.randn(s, generator=gen) for s in shapes]
    offsets, at = [], 3  # a raw stretch before the first parameter, as padding would be
    for v in values:
        offsets.append(at)
        at += v.numel()
    numel = at + 2
    store = QuantizedStore(CPUStore(), spec)
    master = store.tensor("g", numel, torch.float32, pieces=list(zip(offsets, [torch.Size(s) for s in shapes])))
    assert master.untyped_storage().nbytes() == 0  # packed from the start: a fresh blob is zeros
    store.stage([master])
    store.ready([master])
    assert torch.equal(master, torch.zeros(numel))
    full = torch.randn(numel, generator=gen)
    for off, v in zip(offsets, values):
        full[off : off + v.numel()] = v.reshape(-1)
    master.copy_(full)
    store.release([master])
    assert master.untyped_storage().nbytes() == 0
    store.prefetch([master])
    store.ready([master])
    expected = full.clone()
    for off, v in zip(offsets, values):
        if v.dim() >= 2 and spec.group_dim < v.dim():
            expected[off : off + v.numel()] = dequantize(quantize(v, spec)).reshape(-1)
    assert torch.equal(master, expected)  # vectors and the raw stretches exactly, matrices as quantized
    matrices = [v for v in values if v.dim() >= 2]
    raw = numel - sum(v.numel() for v in matrices)
    groups = sum(v.numel() // v.shape[1] * -(-v.shape[1] // spec.group_size) for v in matrices)
    codes = sum(-(-v.numel() * spec.num_bits // 8) for v in matrices)
    alignment = 16 * 3 * (len(values) + 2)  # each piece's codes, scales and minimums start 16-byte aligned
    assert store.packed_bytes <= raw * 4 + codes + groups * (4 if spec.symmetric else 8) + alignment
    store.freeze([master])
    master.zero_()  # a frozen tensor's release writes nothing back
    store.release([master])
    store.prefetch([master])
    store.ready([master])
    assert torch.equal(master, expected)
    store.destroy()


# -- the int4 kernel's form, one process ------------------------------------------------------------------
def _kernel_form(q, n: int, k: int, group: int):
    codes = torch.empty(n, k // 2, dtype=torch.uint8)
    scales = torch.empty(k // group, n, 2, dtype=torch.bfloat16)
    int4.to_kernel(q, BLOCK, codes, scales)
    return codes, scales


@needs_kernel
@pytest.mark.parametrize("spec", [QuantSpec(4, 32), QuantSpec(4, 64, symmetric=True)])
def test_int4_form_matches_torchs_converter_and_our_dequantization(spec):
    assert BLOCK is not None
    gen = torch.Generator().manual_seed(1)
    n, k = 2 * BLOCK, 4 * spec.group_size
    weight = torch.randn(n, k, generator=gen)
    q = quantize(weight, spec)
    codes, scales = _kernel_form(q, n, k, spec.group_size)
    plain = unpack_codes(q.packed, 4, n * k).view(n, k).to(torch.int32)
    assert torch.equal(codes, torch._convert_weight_to_int4pack_for_cpu(plain, 1))
    values = torch.empty(n, k)
    int4.dequantize_kernel(codes, scales, spec.group_size, BLOCK, values)
    # Ours up to the bf16 rounding of the scale and of the zero (m + 8 s): 2^-9 of each, |q - 8| <= 8.
    scale = q.scale.repeat_interleave(spec.group_size, dim=1)
    zero = torch.zeros_like(scale) if q.minimum is None else q.minimum.repeat_interleave(spec.group_size, dim=1)
    bound = (8 * scale + (zero + 8 * scale).abs()) * 2**-8
    assert ((values - dequantize(q)).abs() <= bound).all()
    rows = torch.tensor([[0, BLOCK - 1], [BLOCK // 2, n - 1]])
    assert torch.equal(int4.rows(codes, scales, spec.group_size, BLOCK, rows), values[rows])
    x = torch.randn(2, 3, k, generator=gen)
    out = int4.linear(x, codes, scales, spec.group_size, torch.ones(n))
    reference = x.to(torch.bfloat16).float() @ values.t() + 1
    assert out.shape == (2, 3, n) and out.dtype == torch.float32
    assert (out - reference).abs().max() <= 2**-7 * reference.abs().max(), "the kernel disagrees with its form"


@needs_kernel
def test_store_reads_kernel_pieces_packed_for_compute_and_dequantized_otherwise(monkeypatch):
    assert BLOCK is not None
    monkeypatch.setattr(quantized, "CHUNK", 64)  # one block of rows at a time
    spec = QuantSpec(4, 32)
    gen = torch.Generator().manual_seed(2)
    shapes = [torch.Size((2 * BLOCK, 64)), torch.Size((6, 64))]  # the second: not whole blocks of rows
    numel = sum(s.numel() for s in shapes) + 8  # and a raw vector
    store = QuantizedStore(CPUStore(), spec, kernel=True)
    master = store.tensor("g", numel, torch.float32, pieces=[(0, shapes[0]), (shapes[0].numel(), shapes[1])])
    full = torch.randn(numel, generator=gen)
    store.stage([master])
    store.ready([master])
    master.copy_(full)
    store.release([master])
    store.prefetch([master])
    store.ready([master])
    dequantized = master.clone()
    first = full[: shapes[0].numel()].view(shapes[0])
    codes, scales = _kernel_form(quantize(first, spec), *shapes[0], spec.group_size)
    expected = torch.empty(shapes[0])
    int4.dequantize_kernel(codes, scales, spec.group_size, BLOCK, expected)
    assert torch.equal(dequantized[: shapes[0].numel()].view(shapes[0]), expected)
    rest = full[shapes[0].numel() : shapes[0].numel() + shapes[1].numel()].view(shapes[1])
    assert torch.equal(dequantized[shapes[0].numel() : -8], dequantize(quantize(rest, spec)).reshape(-1))
    assert torch.equal(dequantized[-8:], full[-8:])
    store.release([master])
    assert store.direct(master, shapes[0].numel()) is None  # not in the kernel's layout
    packed = store.direct(master, 0)
    assert packed is not None
    store.freeze([master])
    store.prefetch_for_compute([master])
    store.ready([master])
    assert [torch.equal(a, b) for a, b in zip(packed.views(), (codes, scales))] == [True, True]
    assert torch.equal(master[shapes[0].numel() :], dequantized[shapes[0].numel() :])
    store.prefetch([master])  # a reader of the whole master: the packed piece is dequantized now
    store.ready([master])
    assert torch.equal(master, dequantized)
    store.release([master])
    with pytest.raises(RuntimeError, match="not gathered"):
        packed.views()
    store.destroy()


@needs_kernel
def test_tied_embedding_and_head_are_not_packed():
    """A tied weight is read by the embedding by row and by the head as a matrix: left dequantized."""
    import transformers

    from zeroshard.inference.packed import PackedMatmuls

    config = hf_config("llama", 1, 64, 64)
    config.tie_word_embeddings = True
    model = transformers.LlamaForCausalLM(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    packed = {id(m) for m, _ in PackedMatmuls.of_model(model, QuantSpec(4, 32)).layers}
    assert id(model.lm_head) not in packed and id(model.model.embed_tokens) not in packed
    assert id(model.model.layers[0].mlp.up_proj) in packed


@needs_kernel
def test_packed_matmul_that_packs_nothing_says_so(caplog):
    """No group gathers in place (bf16 compute, N ranks, another device): the option warns, not silent."""
    from zeroshard.inference.packed import PackedMatmuls

    store = QuantizedStore(CPUStore(), QuantSpec(4, 32), kernel=True)
    with caplog.at_level("WARNING", logger="zeroshard.inference.packed"):
        assert PackedMatmuls(_model(seed=3), [], store).layers == []
    assert "no layer reads its weights packed" in caplog.text
    store.destroy()


# -- engines at 1 and 2 ranks ---------------------------------------------------------------------------
def _quantized_case(store: str, bits: int, checkpoint: str, swap: str) -> None:
    from zeroshard.compat.inference import from_pretrained

    rank = torch.distributed.get_rank()
    spec = QuantSpec(bits, 32 if bits == 4 else 64, 1, bits == 8)  # int8 symmetric, int4 with minimums
    model = _model(seed=3)
    oracle = _fake_quantized(model, spec)
    engine = from_pretrained(checkpoint, _config(store, f"{swap}/q{bits}-{store}", spec))
    quantized = engine.placement.param_store
    assert isinstance(quantized, QuantizedStore), type(quantized)
    assert all(p.numel() == 0 for p in engine.module.parameters()), "parameters not sharded at rest"
    # Whole parameters on every rank (uneven slices), no padding, summing to the model.
    stored = sum(g.master.numel() for g in engine.groups)
    total = torch.tensor([stored])
    torch.distributed.all_reduce(total)
    assert int(total) == sum(p.numel() for p in model.parameters()), (stored, int(total))
    for group in engine.groups:
        assert sum(math.prod(s) for _, s in group.whole_pieces()) == group.master.numel()
    # int8 with groups of 64: (1 + 4/64) / 4 = 0.27 of fp32; int4 with groups of 32: (0.5 + 8/32) / 4 = 0.19
    assert quantized.packed_bytes < 4 * stored * (0.28 if bits == 8 else 0.2), (quantized.packed_bytes, stored)
    memory = engine.memory_report()  # the packed bytes, in memory or in files, not the fp32 ones
    held = (memory["params"], memory["offloaded_nvme"])
    assert held == ((quantized.packed_bytes, 0) if store == "cpu" else (0, quantized.packed_bytes)), memory
    prompt = torch.randint(2, VOCAB, (2, 5), generator=torch.Generator().manual_seed(10 + rank))
    before = quantized.counters.prefetched_bytes
    logits = engine(prompt).logits
    assert torch.equal(logits, oracle(prompt).logits), f"rank {rank}: logits differ from the quantized oracle"
    if store == "nvme":  # one pass reads every blob once: the packed bytes, not the fp32 ones
        assert quantized.counters.prefetched_bytes - before == quantized.packed_bytes
    kwargs = dict(max_new_tokens=6 - 2 * rank, min_new_tokens=6 - 2 * rank, attention_mask=torch.ones_like(prompt))
    tokens = engine.generate(prompt, do_sample=False, **kwargs)
    assert torch.equal(tokens, oracle.generate(prompt, do_sample=False, **kwargs)), f"rank {rank}: tokens differ"
    assert engine.gathered_units() == []
    engine.destroy()


def _speculative_case(store: str, draft: str, checkpoint: str, swap: str) -> None:
    from zeroshard.compat.inference import from_pretrained
    from zeroshard.inference import PassCounter, resident_draft

    rank = torch.distributed.get_rank()
    model = _model(seed=3)
    engine = from_pretrained(checkpoint, _config(store, f"{swap}/s-{draft}-{store}", None))
    assistant = resident_draft(checkpoint, num_bits=4, group_size=32) if draft == "self" else _model(seed=5, layers=1)
    if draft == "self":
        assert assistant.world_size == 1 and isinstance(assistant.placement.param_store, QuantizedStore)
        assert BLOCK is None or assistant.packed.layers, "a resident 4-bit draft multiplies packed by default"
    new = 12 - 4 * rank  # rank 0 runs on alone at the end (synced_gpus)
    prompt = torch.randint(2, VOCAB, (1, 4), generator=torch.Generator().manual_seed(20 + rank))
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(prompt))
    passes = PassCounter(engine.module)
    tokens = engine.generate(prompt, assistant_model=assistant, **kwargs)
    passes.close()
    assert torch.equal(tokens, model.generate(prompt, **kwargs)), f"rank {rank}: speculative tokens differ"
    assert passes.passes >= 1 and engine.gathered_units() == []
    if draft == "self":
        assistant.destroy()
    engine.destroy()


def _packed_case(store: str, checkpoint: str, swap: str) -> None:
    """One rank: layers multiplying by the packed weights compute the unsharded model's logits when it
    computes the same way (`PackedMatmuls.of_model`), bit for bit. With the NVMe store every Linear
    and the embedding are units of their own, read packed whole: their masters get no fp32 storage."""
    from zeroshard.compat.inference import from_pretrained
    from zeroshard.inference.packed import _WEIGHTS, PackedMatmuls

    spec = QuantSpec(4, 32)
    oracle = _model(seed=3, vocab=64)
    expected = PackedMatmuls.of_model(oracle, spec)
    config = _config(store, f"{swap}/p-{store}", spec)
    config["zeroshard"]["packed_matmul"] = True
    alone = store == "nvme"
    if alone:
        config["zeroshard"]["wrap_modules"] = ["LlamaDecoderLayer", "Embedding", "Linear"]
    engine = from_pretrained(checkpoint, config)
    assert engine.inference.packed is not None
    seen: list[int] = []
    engine.module.lm_head.register_forward_pre_hook(lambda m, a: seen.append(m.weight.untyped_storage().nbytes()))
    packed = sorted(type(m).__name__ for m, _ in engine.inference.packed.layers)
    assert packed == sorted(type(m).__name__ for m, _ in expected.layers), packed
    assert "PackedEmbedding" in packed and "PackedLinear" in packed
    # The embedding and 15 Linears; the 4 k/v projections have 32 rows, whole kernel blocks where the
    # block is 32 (AVX2), not where it is 64 (AVX-512)
    assert len(packed) == (16 if 32 % BLOCK == 0 else 12), (BLOCK, packed)
    prompt = torch.randint(2, 64, (2, 5), generator=torch.Generator().manual_seed(10))
    assert torch.equal(engine(prompt).logits, oracle(prompt).logits), "logits differ from the packed oracle"
    assert (seen[0] == 4) if alone else (seen[0] > 4 * 64 * 64), seen  # 4: one zero under the weight's shape
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(engine.generate(prompt, **kwargs), oracle.generate(prompt, **kwargs)), "tokens differ"
    # Read outside the forward, the weights are those the kernel multiplies by.
    layer = engine.module.model.layers[1].mlp.down_proj
    with engine.gathered_parameters([layer.weight]):
        got = layer.weight.detach().clone()
    codes, scales = _WEIGHTS[oracle.model.layers[1].mlp.down_proj].views()
    want = torch.empty(got.shape)
    int4.dequantize_kernel(codes, scales, spec.group_size, BLOCK, want)
    assert torch.equal(got, want)
    engine.destroy()
    assert not [m for m in engine.module.modules() if type(m).__name__.startswith("Packed")]
    config["weight_quantization"]["quantized_initialization"]["num_bits"] = 8
    with pytest.raises(ValueError, match="packed_matmul.*num_bits 4.*got num_bits 8"):
        from_pretrained(checkpoint, config)


def _worker(rank: int, world_size: int, checkpoint: str, swap: str, packed_checkpoint: str) -> None:
    if world_size == 1 and BLOCK is not None:
        subtests(
            grid(store=["cpu", "nvme"]), lambda **case: _packed_case(checkpoint=packed_checkpoint, swap=swap, **case)
        )
    if world_size > 1:
        config = _config("cpu", swap, QuantSpec(4, 32))
        config["zeroshard"]["packed_matmul"] = True
        with pytest.raises(ValueError, match="packed_matmul: true works on one rank"):
            from zeroshard.compat.inference import from_pretrained

            from_pretrained(checkpoint, config)
    subtests(
        grid(store=["cpu", "nvme"], bits=[8, 4]),
        lambda **case: _quantized_case(checkpoint=checkpoint, swap=swap, **case),
    )
    subtests(
        grid(store=["cpu", "nvme"], draft=["self", "user"]),
        lambda **case: _speculative_case(checkpoint=checkpoint, swap=swap, **case),
    )


@pytest.mark.parametrize("world_size", [1, 2])
def test_quantized_store_and_speculative_decoding_match_the_unsharded_model(world_size, tmp_path):
    checkpoint = tmp_path / "model"
    _model(seed=3).save_pretrained(checkpoint, max_shard_size="40KB")  # several shards and an index
    assert (checkpoint / "model.safetensors.index.json").is_file()
    packed = tmp_path / "model64"  # a vocabulary of whole blocks of rows: the embedding too is packed
    _model(seed=3, vocab=64).save_pretrained(packed)
    run_distributed(
        _worker,
        world_size,
        timeout=300,
        env=ENV,
        checkpoint=str(checkpoint),
        swap=str(tmp_path / "swap"),
        packed_checkpoint=str(packed),
    )


# -- sampling: the target's distribution -----------------------------------------------------------------
def test_speculative_sampling_keeps_the_targets_distribution(tmp_path):
    """Two sampled tokens after a fixed prompt, many times, with a draft that disagrees often: the
    counts of the 36 pairs against the target's own probabilities p(a) p(b | a) (chi-square, 35
    degrees of freedom, 0.1% level: 66.6)."""
    started = not torch.distributed.is_initialized()
    try:
        _sample_pairs(tmp_path)
    finally:
        if started and torch.distributed.is_initialized():  # the pytest process's own group: leave none behind
            torch.distributed.destroy_process_group()


def _sample_pairs(tmp_path) -> None:
    from zeroshard.compat.inference import from_pretrained
    from zeroshard.inference.pretrained import init_one_rank

    init_one_rank()
    vocab = 6
    target = _model(seed=11, layers=1, width=16, vocab=vocab, special_tokens=False)  # no end token: every pair can come
    with torch.no_grad():
        target.lm_head.weight.mul_(8)  # a peaked distribution, far from the draft's
    target.save_pretrained(tmp_path / "t")
    draft = _model(seed=12, layers=1, width=16, vocab=vocab, special_tokens=False)
    engine = from_pretrained(tmp_path / "t", _config("cpu", "", None))
    prompt = torch.tensor([[2, 3, 4]])
    with torch.no_grad():
        first = target(prompt).logits[0, -1].softmax(-1)
        second = torch.stack(
            [target(torch.cat([prompt, torch.tensor([[a]])], 1)).logits[0, -1].softmax(-1) for a in range(vocab)]
        )
    expected = (first[:, None] * second).reshape(-1)
    torch.manual_seed(0)
    counts = torch.zeros(vocab * vocab)
    samples = 600
    kwargs = dict(max_new_tokens=2, do_sample=True, attention_mask=torch.ones_like(prompt))
    for _ in range(samples):
        out = engine.generate(prompt, assistant_model=draft, **kwargs)[0, -2:]
        counts[out[0] * vocab + out[1]] += 1
    engine.destroy()
    cells = expected * samples >= 5  # the usual validity rule; the rest pooled into one cell
    observed = torch.cat([counts[cells], counts[~cells].sum()[None]])
    wanted = torch.cat([expected[cells] * samples, (expected[~cells] * samples).sum()[None]])
    chi2 = float(((observed - wanted) ** 2 / wanted.clamp_min(1e-9)).sum())
    assert chi2 < 66.6, (chi2, counts.view(vocab, vocab), (expected * samples).view(vocab, vocab))


# -- a memory cap below the fp32 weights --------------------------------------------------------------------
@pytest.mark.slow
def test_capped_process_loads_and_generates_from_int4_weights_in_memory(tmp_path):
    model, weights = capped_model(tmp_path / "m")  # 158 MB of fp32 weights, saved in shards
    spec = QuantSpec(4, 64)
    prompt = torch.tensor([[5, 6, 7, 8]])
    oracle = _fake_quantized(model, spec)
    expected = oracle.generate(prompt, max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(prompt))
    # Half the fp32 weights, under which the unsharded model does not load (test_inference's capped
    # test): the int4 blobs take 0.16 of them, the dequantizing thread and two gathered layers in fp32
    # about 0.2 more, and no file holds them.
    headroom = weights // 2
    ours = run_capped("int4", tmp_path / "m", tmp_path / "swap", headroom)
    assert ours.returncode == 0 or TEARDOWN_ABORT in ours.stderr, ours.stdout + ours.stderr[-3000:]
    report = json.loads(ours.stdout.strip().splitlines()[-1])
    assert report["tokens"] == expected.tolist(), report
    assert report["data"] < report["cap"], report
    assert Path(tmp_path / "m" / "model.safetensors.index.json").is_file()


# -- a training checkpoint into a quantized store, twice -----------------------------------------------------
def _checkpoint_worker(rank: int, world_size: int, root: str) -> None:
    import zeroshard
    from zeroshard.checkpoint import full_state_dict
    from zeroshard.compat.inference import InferenceEngine
    from zeroshard.config import load_config

    model = _model(seed=4)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    trainer, *_ = zeroshard.initialize(model=model, config={**config, "zero_optimization": {"stage": 3}})
    ids = torch.arange(2, 14).reshape(2, 6)
    trainer.backward(trainer(input_ids=ids, labels=ids).loss)
    trainer.step()
    trainer.save_checkpoint(root)
    trained = {k: v.clone() for k, v in full_state_dict(trainer).items()}
    trainer.destroy()
    oracle = _model(seed=4)
    oracle.load_state_dict(trained, strict=False)
    oracle = _fake_quantized(oracle, QuantSpec(8, 64))
    from zeroshard.checkpoint.manifest import persistent_buffers
    from zeroshard.inference.pretrained import materialize_buffers

    with torch.device("meta"):
        empty = _model(seed=4)
    materialize_buffers(empty, persistent_buffers(empty))
    spec = {"weight_quantization": {"quantized_initialization": {"num_bits": 8}}, "zero_optimization": {"stage": 3}}
    engine = InferenceEngine(empty, load_config(spec, world_size))
    for _ in range(2):  # the second load writes over packed masters
        engine.load_checkpoint(root)
        assert torch.equal(engine(ids).logits, oracle(ids).logits)
    engine.destroy()


def test_training_checkpoint_loads_into_a_quantized_store_twice(tmp_path):
    run_distributed(_checkpoint_worker, 1, timeout=120, env=ENV, root=str(tmp_path / "ckpt"))
