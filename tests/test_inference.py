"""ZeRO-Inference: `initialize(model=..., config=...)` with no optimizer, and `from_pretrained` loading a
sharded safetensors checkpoint straight into the CPU or NVMe store, generate exactly the tokens of the
unsharded model (greedy, and sampling with a fixed seed) with HF's KV cache, at 1 and 2 ranks (each
rank its own prompts), gathering one unit at a time with the next prefetched, and holding no gradient
or optimizer memory. The config-free entry point (`zeroshard.inference.shard`, `from_pretrained` with
plain arguments) computes what the DeepSpeed-config path computes, bit for bit. A process capped
(RLIMIT_DATA) below what the unsharded model needs still generates with the NVMe store. Models are
built from configs with random weights; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zeroshard
from tests.extras import needs
from tests.harness import TEARDOWN_ABORT, grid, run_distributed, subtests
from tests.hf_models import ENV
from tests.inference_helpers import VOCAB, capped_model, hf_config, run_capped
from zeroshard.compat.inference import InferenceEngine

pytestmark = needs("transformers", extra="hf")

ROOT = Path(__file__).resolve().parent.parent


def build_model(kind: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(hf_config(kind)).eval()


def inference_config(store: str, swap: str, in_cpu: int = 0, **zero) -> dict:
    """store "nvme+cpu": NVMe offload with offload_param.max_in_cpu = `in_cpu`."""
    offload = {"device": "cpu"} if store == "cpu" else {"device": "nvme", "nvme_path": swap}
    if store == "nvme+cpu":
        offload["max_in_cpu"] = in_cpu
    return {
        "zero_optimization": {
            "stage": 3,
            "offload_param": offload,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 1,
            **zero,
        },  # prefetch: the next unit only
        "zeroshard": {"comm_timeout_s": 60},
    }


def prompts(rank: int) -> tuple[torch.Tensor, int]:
    """Each rank its own batch; rank 1 generates fewer tokens, so rank 0 runs on alone (synced_gpus)."""
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randint(2, VOCAB, (2, 5), generator=gen), 8 - 3 * rank


# -- token equality at 1 and 2 ranks ---------------------------------------------------------------------
def _engine(source: str, kind: str, store: str, checkpoints: str, swap: str, in_cpu: int = 0):
    from zeroshard.compat.inference import from_pretrained

    config = inference_config(store, swap, in_cpu)
    if source == "pretrained":
        return from_pretrained(Path(checkpoints) / kind, config)
    engine, optimizer, _, scheduler = zeroshard.initialize(model=build_model(kind), config=config)
    assert optimizer is None and scheduler is None
    return engine


def _watch_prefetch(engine) -> list[tuple[str, str]]:
    """At each layer's forward (after our hooks): the state of the layer after it, and of the one after that."""
    layers = [u for u in engine.units if u.name != "<root>"]
    seen = []
    for index, unit in enumerate(layers[:-2]):
        following = layers[index + 1 : index + 3]
        unit.module.register_forward_pre_hook(
            lambda module, args, following=following: seen.append(tuple(u.state.value for u in following))
        )
    return seen


def _watch_storage(engine) -> list[bool]:
    """At each unit's forward (after our hooks): are its parameters views of its groups' master shards?"""
    seen = []
    for unit in engine.units:
        masters = {g.master.untyped_storage().data_ptr() for g in unit.groups}
        params = [p for g in unit.groups for p in g.params]
        unit.module.register_forward_pre_hook(
            lambda module, args, masters=masters, params=params: seen.append(
                all(p.untyped_storage().data_ptr() in masters for p in params)
            )
        )
    return seen


def _check_max_in_cpu(engine, memory: dict, in_cpu: int) -> None:
    """The first shards, up to max_in_cpu elements, are in CPU memory, the rest in the NVMe files."""
    store = engine.placement.param_store
    resident = [store.cpu.holds(g.master) for g in engine.groups]
    first_streamed = resident.index(False)
    assert all(resident[:first_streamed]) and not any(resident[first_streamed:]), resident
    held = sum(g.master.numel() for g in engine.groups[:first_streamed])
    assert 0 < held <= in_cpu < held + engine.groups[first_streamed].master.numel(), (held, in_cpu)
    assert memory["params"] == held * 4, memory


def _generate_case(source: str, kind: str, store: str, checkpoints: str, swap: str) -> None:
    import transformers

    rank = torch.distributed.get_rank()
    oracle = (
        transformers.AutoModelForCausalLM.from_pretrained(Path(checkpoints) / kind).eval()
        if source == "pretrained"
        else build_model(kind)
    )
    in_cpu = sum(p.numel() for p in oracle.parameters()) // (2 * torch.distributed.get_world_size())  # half
    engine = _engine(source, kind, store, checkpoints, f"{swap}/{source}-{kind}-{store}", in_cpu)
    assert isinstance(engine, InferenceEngine)
    memory = engine.memory_report()
    assert memory["grads"] == 0 and memory["optimizer"] == 0 and memory["master"] == 0, memory
    resident = memory["params"] + memory["offloaded_nvme"]
    assert resident == sum(g.layout.shard_numel * 4 for g in engine.groups), memory  # the shards, once
    assert (memory["offloaded_nvme"] > 0) == (store != "cpu"), memory
    if store == "nvme+cpu":
        _check_max_in_cpu(engine, memory, in_cpu)
    assert all(p.numel() == 0 for p in engine.module.parameters()), "parameters not sharded at rest"
    prompt, new_tokens = prompts(rank)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, attention_mask=torch.ones_like(prompt))
    seen = _watch_prefetch(engine)
    in_place = _watch_storage(engine)
    greedy = engine.generate(prompt, do_sample=False, **kwargs)
    assert torch.equal(greedy, oracle.generate(prompt, do_sample=False, **kwargs)), f"rank {rank}: greedy differs"
    torch.manual_seed(7)
    sampled = engine.generate(prompt, do_sample=True, top_k=20, **kwargs)
    torch.manual_seed(7)
    expected = oracle.generate(prompt, do_sample=True, top_k=20, **kwargs)
    assert torch.equal(sampled, expected), f"rank {rank}: sampling differs\n{sampled}\n{expected}"
    assert engine.gathered_units() == [], engine.gathered_units()
    order = [u.name for u in engine.lifecycle.inference_order]
    assert order[0] == "<root>" and len(order) == len(engine.units), order
    # After the first pass (which records the order): the next layer is being gathered, the one after is not.
    assert seen[:1] == [("sharded", "sharded")] and set(seen[1:]) == {("gathering", "sharded")}, seen
    # One rank: the parameters are views of the shards, no copy ([Note: gathering in place at one
    # rank]); two ranks: of the gathered buffer.
    assert set(in_place) == {engine.world_size == 1}, in_place
    engine.destroy()


def _quantized_case(swap: str) -> None:
    """zero_quantized_weights (qwZ) acts in inference too: the parameter all-gathers of a generate
    send int8 blocks, about a quarter of the fp32 bytes; tokens stay close, not equal."""
    gathered = {}
    for quantized in (False, True):
        torch.manual_seed(0)
        engine, _, _, _ = zeroshard.initialize(
            model=build_model("gpt2"), config=inference_config("cpu", swap, zero_quantized_weights=quantized)
        )
        prompt, new_tokens = prompts(torch.distributed.get_rank())
        before = engine.comm_report()["paper_bytes"].get("all_gather", 0)
        out = engine.generate(
            prompt,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            attention_mask=torch.ones_like(prompt),
        )
        gathered[quantized] = engine.comm_report()["paper_bytes"].get("all_gather", 0) - before
        assert out.shape == (prompt.shape[0], prompt.shape[1] + new_tokens), out.shape
        engine.destroy()
    assert 0 < gathered[True] < 0.35 * gathered[False], gathered


def _generate_worker(rank: int, world_size: int, checkpoints: str, swap: str) -> None:
    cases = grid(source=["initialize", "pretrained"], kind=["gpt2", "llama"], store=["cpu", "nvme"]) + grid(
        source=["pretrained"], kind=["gpt2", "llama"], store=["nvme+cpu"]
    )
    subtests(cases, lambda **case: _generate_case(checkpoints=checkpoints, swap=swap, **case))
    if world_size > 1:
        _quantized_case(swap)


def _save_checkpoints(root: Path) -> str:
    for kind in ("gpt2", "llama"):
        build_model(kind, seed=3).save_pretrained(root / kind, max_shard_size="20KB")  # several shards + index
        assert (root / kind / "model.safetensors.index.json").is_file()
    return str(root)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.slow
def test_generate_matches_unsharded_model(world_size, tmp_path):
    checkpoints = _save_checkpoints(tmp_path / "models")
    run_distributed(
        _generate_worker, world_size, timeout=300, env=ENV, checkpoints=checkpoints, swap=str(tmp_path / "swap")
    )


# -- zeroshard.inference.shard, config-free, against the DeepSpeed-shaped path --------------------------
BITS = {"fp32": None, "int8": 8, "int4": 4, "int4-packed": 4}


def _plain_options(store: str, swap: str, weights: str) -> dict:
    """zeroshard.inference.shard's arguments for what `_deepspeed_config` says."""
    import zeroshard.inference as zi

    bits = BITS[weights]
    return {
        "offload": zeroshard.CPUOffload(params=True) if store == "cpu" else zeroshard.NVMeOffload(swap),
        "quantize": None if bits is None else zi.QuantSpec(bits, 32),
        "packed_matmul": weights == "int4-packed",
    }


def _deepspeed_config(store: str, swap: str, weights: str) -> dict:
    config = inference_config(store, swap)
    if BITS[weights] is not None:
        config["weight_quantization"] = {"quantized_initialization": {"num_bits": BITS[weights], "group_size": 32}}
    config["zeroshard"]["packed_matmul"] = weights == "int4-packed"
    return config


def _entry_point_case(source: str, store: str, weights: str, checkpoint: str, swap: str) -> None:
    """The same model through zeroshard.inference (plain arguments) and through initialize or compat's
    from_pretrained (a DeepSpeed config): the same units and bytes, the same logits and tokens, bit for bit."""
    import zeroshard.inference as zi
    from zeroshard.compat.inference import from_pretrained

    rank = torch.distributed.get_rank()
    where = f"{swap}/{source}-{store}-{weights}"
    if source == "model":
        plain = zi.shard(build_model("llama", seed=3), **_plain_options(store, f"{where}/plain", weights))
        engine, *_ = zeroshard.initialize(
            model=build_model("llama", seed=3), config=_deepspeed_config(store, f"{where}/ds", weights)
        )
    else:
        plain = zi.from_pretrained(checkpoint, **_plain_options(store, f"{where}/plain", weights))
        engine = from_pretrained(checkpoint, _deepspeed_config(store, f"{where}/ds", weights))
    assert isinstance(plain, zi.InferenceModel) and isinstance(engine, InferenceEngine)
    assert [u.name for u in plain.units] == [u.name for u in engine.units]
    assert plain.memory_report() == engine.memory_report(), (plain.memory_report(), engine.memory_report())
    assert type(plain.placement.param_store) is type(engine.placement.param_store)
    assert (plain.packed is None) == (engine.inference.packed is None) == (weights != "int4-packed")
    prompt, _ = prompts(rank)
    logits = plain(prompt).logits
    assert torch.equal(logits, engine(prompt).logits), f"rank {rank}: logits differ"
    if weights == "fp32":
        assert torch.equal(logits, build_model("llama", seed=3)(prompt).logits), "logits differ from the model's"
    kwargs = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert torch.equal(plain.generate(prompt, **kwargs), engine.generate(prompt, **kwargs)), f"rank {rank}: tokens"
    assert plain.gathered_units() == [] and engine.gathered_units() == []
    plain.destroy()
    engine.destroy()


def _refusals_case() -> None:
    """Each path refuses in its own terms: plain arguments, or the config's keys."""
    import zeroshard.inference as zi

    with pytest.raises(ValueError, match=r"shard\(quantize=...\) .* needs shard\(stage=3\) \(got stage 0\)"):
        zi.shard(build_model("llama"), quantize=zi.QuantSpec(8), stage=0)
    config = _deepspeed_config("cpu", "", "int8")
    config["zero_optimization"]["stage"] = 0
    with pytest.raises(ValueError, match=r"^weight_quantization.quantized_initialization .* zero_optimization.stage 3"):
        zeroshard.initialize(model=build_model("llama"), config=config)
    if torch.distributed.get_world_size() > 1:
        with pytest.raises(ValueError, match=r"shard\(packed_matmul=True\) works on one rank"):
            zi.shard(build_model("llama"), quantize=zi.QuantSpec(4, 32), packed_matmul=True)
        with pytest.raises(ValueError, match="^zeroshard.packed_matmul: true works on one rank"):
            zeroshard.initialize(model=build_model("llama"), config=_deepspeed_config("cpu", "", "int4-packed"))
    with pytest.raises(ValueError, match=r"places optimizer states, and inference has none: CPUOffload\(params=True\)"):
        zi.shard(build_model("llama"), offload=zeroshard.CPUOffload())
    with pytest.raises(TypeError, match=r"shard\(offload='cpu'\): zeroshard.CPUOffload\(params=True\)"):
        zi.shard(build_model("llama"), offload="cpu")


def _entry_point_worker(rank: int, world_size: int, checkpoint: str, swap: str) -> None:
    cases = grid(source=["model", "pretrained"], store=["cpu", "nvme"], weights=["fp32"])
    cases += [
        {"source": "model", "store": "cpu", "weights": "int8"},
        {"source": "model", "store": "cpu", "weights": "int4"},
        {"source": "pretrained", "store": "nvme", "weights": "int4"},
    ]
    if world_size == 1:
        cases.append({"source": "model", "store": "cpu", "weights": "int4-packed"})
    subtests(cases, lambda **case: _entry_point_case(checkpoint=checkpoint, swap=swap, **case))
    _refusals_case()


@pytest.mark.parametrize("world_size", [1, 2])
def test_config_free_entry_point_matches_the_deepspeed_path(world_size, tmp_path):
    """zeroshard.inference.shard / from_pretrained with plain arguments, and initialize / compat's
    from_pretrained with the DeepSpeed config that says the same: CPU and NVMe stores, fp32, int8,
    int4 and (one rank) int4 multiplied packed, at 1 and 2 ranks."""
    build_model("llama", seed=3).save_pretrained(tmp_path / "llama", max_shard_size="20KB")
    run_distributed(
        _entry_point_worker,
        world_size,
        timeout=300,
        env=ENV,
        checkpoint=str(tmp_path / "llama"),
        swap=str(tmp_path / "swap"),
    )


# -- one process: what an inference engine refuses, and bad checkpoints ----------------------------------
def _misuse_worker(rank: int, world_size: int, tmp: str) -> None:
    from zeroshard.checkpoint import CheckpointError
    from zeroshard.compat.inference import from_pretrained

    engine, *_ = zeroshard.initialize(model=build_model("gpt2"), config=inference_config("cpu", ""))
    with pytest.raises(RuntimeError, match="without an optimizer"):
        engine.step()
    with pytest.raises(RuntimeError, match="without an optimizer"):
        engine.backward(torch.zeros(()))
    logits = engine(torch.tensor([[2, 3, 4]])).logits  # engine(...): no autograd
    assert not logits.requires_grad and engine.gathered_units() == []
    engine.destroy()
    with pytest.raises(zeroshard.ConfigError, match="scheduler was given but no optimizer"):
        zeroshard.initialize(
            model=build_model("gpt2"), config=inference_config("cpu", ""), lr_scheduler=lambda optimizer: None
        )
    root = Path(tmp)
    with pytest.raises(CheckpointError, match="no config.json"):
        from_pretrained(root)
    build_model("llama").save_pretrained(root / "m", max_shard_size="20KB")
    index = json.loads((root / "m" / "model.safetensors.index.json").read_text())
    missing = sorted(set(index["weight_map"].values()))[-1]
    (root / "m" / missing).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        from_pretrained(root / "m", inference_config("cpu", ""))
    (root / "m" / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        from_pretrained(root / "m", inference_config("cpu", ""))


def test_inference_engine_refuses_training_and_bad_checkpoints(tmp_path):
    run_distributed(_misuse_worker, 1, timeout=120, env=ENV, tmp=str(tmp_path))


# -- the CLI ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fp32", "int4+draft"])
def test_generate_command(mode, tmp_path):
    model = build_model("llama", seed=5)
    model.save_pretrained(tmp_path / "m", max_shard_size="20KB")
    prompt = torch.tensor([[5, 6, 7, 8]])
    extra = []
    if mode == "int4+draft":  # int4 weights streamed and multiplied packed, its own 4-bit copy as draft
        from zeroshard.inference.packed import PackedMatmuls
        from zeroshard.inference.quantization import QuantSpec

        PackedMatmuls.of_model(model, QuantSpec(4, 32))  # the model the engine computes as
        extra = ["--quant-bits", "4", "--group-size", "32", "--packed-matmul", "--draft", "self"]
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(prompt))
    command = [
        sys.executable,
        "-m",
        "zeroshard.tools.cli",
        "generate",
        str(tmp_path / "m"),
        "--prompt-ids",
        "5,6,7,8",
        "--max-new-tokens",
        "6",
        "--offload",
        "nvme",
        "--nvme-path",
        str(tmp_path / "swap"),
        "--json",
        *extra,
    ]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"), **ENV),
    )
    assert result.returncode == 0 or TEARDOWN_ABORT in result.stderr, result.stdout + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["tokens"] == expected.tolist(), report
    assert report["new_tokens"] == 6 and report["tokens_per_s"] > 0, report
    if mode == "int4+draft":
        assert report["quant_bits"] == 4 and report["speculation"]["target_passes"] >= 1, report


# -- a memory cap the unsharded model exceeds ---------------------------------------------------------------
@pytest.mark.slow
def test_capped_process_generates_a_model_larger_than_its_cap(tmp_path):
    model, weights = capped_model(tmp_path / "m")
    prompt = torch.tensor([[5, 6, 7, 8]])
    expected = model.generate(prompt, max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(prompt))
    headroom = weights // 2  # the process may grow by half the model's weights
    unsharded = run_capped("unsharded", tmp_path / "m", tmp_path / "swap", headroom)
    assert unsharded.returncode != 0, f"the unsharded model fits under the cap: {unsharded.stdout}"
    ours = run_capped("zeroshard", tmp_path / "m", tmp_path / "swap", headroom)
    assert ours.returncode == 0 or TEARDOWN_ABORT in ours.stderr, ours.stdout + ours.stderr[-3000:]
    report = json.loads(ours.stdout.strip().splitlines()[-1])
    assert report["tokens"] == expected.tolist(), report
    assert report["data"] < report["cap"], report
    # Resident memory too (the cap does not count pages of the swap files): loading releases each group
    # to its file, generating maps about two units, so neither keeps the model resident.
    assert report["rss_loaded"] - report["rss_before"] < weights // 2, report
    assert report["peak_rss"] - report["rss_loaded"] < weights // 2, report


# -- offload_param.max_in_cpu -------------------------------------------------------------------------------
def test_max_in_cpu_is_acted_on_with_nvme_offload(tmp_path):
    """Set with NVMe offload: the first tensors up to max_in_cpu elements are in CPU memory, the rest in files
    (no not-acted-on warning). Absent: everything streams. With device cpu: reported as not acted on. Shared
    with the optimizer's NVMe store: its files are counted once."""
    import warnings

    from zeroshard.config import load_config
    from zeroshard.config.parse import ConfigKeyNotActedOnWarning
    from zeroshard.offload import CPUStore, NVMeStore, ResidentFirstStore, build_placement

    def placement(offload_param: dict, optimizer=None, offload_optimizer=None):
        zero = {"stage": 3, "offload_param": offload_param}
        if offload_optimizer:
            zero["offload_optimizer"] = offload_optimizer
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            cfg = load_config({"zero_optimization": zero}, 1)
        named = [str(w.message) for w in record if w.category is ConfigKeyNotActedOnWarning]
        return build_placement(cfg.zero_optimization, cfg.aio, optimizer, 100, 0, 1), named

    nvme = {"device": "nvme", "nvme_path": str(tmp_path / "a")}
    plan, named = placement({**nvme, "max_in_cpu": 25})
    store = plan.param_store
    assert isinstance(store, ResidentFirstStore) and not any("max_in_cpu" in n for n in named), named
    tensors = [store.tensor(f"t{i}", 10, torch.float32) for i in range(4)]
    assert [store.cpu.holds(t) for t in tensors] == [True, True, False, False]  # 20 <= 25 < 30: a prefix
    assert store.offloaded_bytes == 80 and store.bytes_held == 160 and not store.resident(tensors[2])
    store.release(tensors)
    store.prefetch(tensors)
    assert all(t.sum().item() == 0 for t in tensors)
    plan.destroy()
    assert not any((tmp_path / "a").iterdir()), "destroy removes the swap files"

    plan, _ = placement(dict(nvme, nvme_path=str(tmp_path / "b")))
    assert isinstance(plan.param_store, NVMeStore), "absent: every shard streams"
    plan.destroy()
    plan, named = placement({"device": "cpu", "max_in_cpu": 25})
    assert isinstance(plan.param_store, CPUStore) and any("max_in_cpu" in n for n in named), named
    plan.destroy()

    shared = dict(nvme, nvme_path=str(tmp_path / "c"))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(100))], lr=0.1)
    plan, _ = placement({**shared, "max_in_cpu": 10}, optimizer, offload_optimizer=shared)
    assert plan.param_store.nvme is plan.optimizer_store
    plan.param_store.tensor("p0", 10, torch.float32)
    plan.param_store.tensor("p1", 10, torch.float32)
    plan.optimizer_store.tensor("m", 10, torch.float32)
    assert sum(s.offloaded_bytes for s in plan.stores()) == 80, "the shared files once: p1 and m"
    plan.destroy()


# -- InferenceEngine.load_checkpoint: a training checkpoint's weights, streamed into the store ---------------
def _trained_checkpoint(root: Path) -> dict:
    """Train the tiny Llama two steps at stage 3 (these ranks), save a zeroshard checkpoint; the full
    weights it holds (rank 0's full_state_dict)."""
    from zeroshard.checkpoint import full_state_dict

    model = build_model("llama", seed=4).train()
    engine, *_ = zeroshard.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zeroshard": {"comm_timeout_s": 60},
        },
    )
    gen = torch.Generator().manual_seed(200 + torch.distributed.get_rank())
    for _ in range(2):
        ids = torch.randint(2, VOCAB, (2, 6), generator=gen)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(str(root), tag="trained")
    full = full_state_dict(engine, torch.float32)
    engine.destroy()
    return full


def _meta_engine(kind: str, config: dict) -> InferenceEngine:
    """An engine over a model built on the meta device: no full copy of the weights is ever made."""
    import transformers

    from zeroshard.checkpoint.manifest import persistent_buffers
    from zeroshard.inference.pretrained import materialize_buffers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(kind))
    materialize_buffers(model, persistent_buffers(model))
    engine, *_ = zeroshard.initialize(model=model, config=config)
    return engine


def _load_checkpoint_worker(rank: int, world_size: int, root: str, swap: str) -> None:
    box = [_trained_checkpoint(Path(root))]
    torch.distributed.broadcast_object_list(box, src=0)  # rank 0's full weights, the oracle's
    subtests(
        [{"case": "zeroshard"}, {"case": "deepspeed"}, {"case": "deepspeed_frozen"}],
        lambda case: (
            _case_load_checkpoint(root, swap, box[0])
            if case == "zeroshard"
            else _case_load_deepspeed("stage3_fp32", swap)
            if case == "deepspeed"
            else _case_load_deepspeed_frozen("stage1_fp32_frozen", swap)
        ),
    )


def _case_load_checkpoint(root: str, swap: str, full: dict) -> None:
    from zeroshard.checkpoint import CheckpointError

    rank = torch.distributed.get_rank()
    oracle = build_model("llama")
    oracle.load_state_dict(full)
    engine = _meta_engine("llama", inference_config("nvme", f"{swap}/load"))
    path, client = engine.load_checkpoint(root, load_optimizer_states=False)  # `latest` names "trained"
    assert path.endswith("trained") and client == {}, (path, client)
    prompt, new_tokens = prompts(rank)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, attention_mask=torch.ones_like(prompt))
    assert torch.equal(
        engine.generate(prompt, do_sample=False, **kwargs), oracle.generate(prompt, do_sample=False, **kwargs)
    ), f"rank {rank}: greedy differs"
    assert engine.gathered_units() == [] and engine.memory_report()["offloaded_nvme"] > 0
    engine.destroy()
    other = _meta_engine("gpt2", inference_config("cpu", ""))
    with pytest.raises(CheckpointError, match="does not fit the model"):
        other.load_checkpoint(root, tag="trained")
    with pytest.raises(CheckpointError, match="no 'latest' file"):
        other.load_checkpoint(str(Path(root) / "nowhere"))
    other.destroy()


def _case_load_deepspeed(source: str, swap: str) -> None:
    """A checkpoint DeepSpeed itself wrote (tests/data/deepspeed): the weights are its zero_to_fp32 output."""
    from tests.deepspeed_data import DATA, reference_weights, tm

    engine, *_ = zeroshard.initialize(model=tm.build_model(), config=inference_config("nvme", f"{swap}/ds"))
    engine.load_checkpoint(str(DATA / source))
    with engine.gathered_parameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    reference = reference_weights(source)
    assert params.keys() <= reference.keys() and all(torch.equal(params[n], reference[n].float()) for n in params)
    engine.destroy()


def _case_load_deepspeed_frozen(source: str, swap: str) -> None:
    """DeepSpeed's stage-1 checkpoint of a model with frozen parameters, which it keeps in the module
    state dict alone: every parameter is what DeepSpeed's running engine held."""
    from tests.deepspeed_data import DATA, tm

    engine, *_ = zeroshard.initialize(model=tm.build_adapter_model(), config=inference_config("nvme", f"{swap}/dsf"))
    engine.load_checkpoint(str(DATA / source))
    with engine.gathered_parameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    reference = torch.load(DATA / source / "reference.pt", weights_only=True)["saved"]
    assert params.keys() == reference.keys() and all(torch.equal(params[n], reference[n]) for n in params)
    engine.destroy()


@pytest.mark.parametrize("world_size", [1, 2])
def test_load_checkpoint_streams_a_training_checkpoint_into_the_store(world_size, tmp_path):
    """InferenceEngine.load_checkpoint over a model built on the meta device: a zeroshard checkpoint
    trained at these ranks generates the tokens of the plain model with its full weights; one
    DeepSpeed wrote loads its zero_to_fp32 weights, and one of a model with frozen parameters all of
    them; a checkpoint of another model, or none, is refused."""
    run_distributed(
        _load_checkpoint_worker,
        world_size,
        timeout=300,
        env=ENV,
        root=str(tmp_path / "ckpt"),
        swap=str(tmp_path / "swap"),
    )
