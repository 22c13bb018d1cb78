"""Shared by the ZeRO-Inference tests (tests/test_inference.py, test_quantized_inference.py): the
configs of their transformers models, and a process capped (RLIMIT_DATA) below what a model needs,
which loads and generates from a saved model."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from tests.hf_models import ENV

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 96


def hf_config(kind: str, layers: int = 3, width: int = 32, vocab: int = VOCAB, special_tokens: bool = True):
    """`special_tokens` False: no bos/eos/pad ids (generation then never stops early)."""
    import transformers

    special = (
        dict(bos_token_id=0, eos_token_id=1, pad_token_id=1)
        if special_tokens
        else dict(bos_token_id=None, eos_token_id=None)
    )
    if kind == "gpt2":  # tied embedding and LM head
        return transformers.GPT2Config(
            vocab_size=vocab, n_positions=64, n_embd=width, n_layer=layers, n_head=2, **special
        )
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        **special,
    )


CAPPED = textwrap.dedent("""
    import json, resource, sys, torch, torch.distributed as dist, transformers
    from zeroshard.compat.inference import from_pretrained
    mode, path, swap, headroom = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.new_group(backend="gloo")  # the engine's group: its threads exist before the cap, like the imports
    warm = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    warm.generate(torch.tensor([[5, 6]]), max_new_tokens=2)  # transformers imports lazily, at first use
    del warm
    def data_bytes():
        return int(open("/proc/self/status").read().split("VmData:")[1].split()[0]) * 1024
    cap = data_bytes() + headroom  # the runtime as it is, plus `headroom` bytes for the model
    def rss():
        return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
    rss_before = rss()
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    prompt = torch.tensor([[5, 6, 7, 8]])
    kwargs = dict(max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(prompt))
    if mode == "unsharded":
        model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        rss_loaded = rss()
        tokens = model.generate(prompt, **kwargs)
    else:
        offload = {"device": "nvme", "nvme_path": swap} if mode == "zeroshard" else {"device": "cpu"}
        config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                  "stage3_prefetch_bucket_size": 1, "offload_param": offload}}
        if mode == "int4":  # weights in memory, packed 4-bit (tests/test_quantized_inference.py)
            config["weight_quantization"] = {"quantized_initialization": {"num_bits": 4, "group_size": 64}}
        engine = from_pretrained(path, config)
        rss_loaded = rss()
        open("/proc/self/clear_refs", "w").write("5")  # VmHWM of generate alone
        tokens = engine.module.generate(prompt, **kwargs)
    rss = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
    print(json.dumps({"tokens": tokens.tolist(), "cap": cap, "data": data_bytes(), "peak_rss": rss,
                      "rss_before": rss_before, "rss_loaded": rss_loaded}), flush=True)
""")


def run_capped(mode: str, path: Path, swap: Path, headroom: int) -> subprocess.CompletedProcess:
    # The cap counts virtual memory, thread stacks too (8 MiB each: the engine's gloo group and the NVMe
    # store's I/O threads take ~40 MB), hence a model this large. Both runs: glibc returns freed blocks of
    # 64 KiB and more to the system at once (DESIGN.md, "How performance is measured"); by default it
    # raises that threshold to the largest block freed (up to 32 MiB), so freed layer buffers of a few MB
    # would stay in the heap and count against the cap.
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(ROOT / "src"), **ENV)
    return subprocess.run(
        [sys.executable, "-c", CAPPED, mode, str(path), str(swap), str(headroom)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def capped_model(path: Path):
    """The capped tests' model, saved sharded to `path`: a Llama of 24 layers of 6.6 MB, 158 MB of
    fp32 weights. Returns (model, its bytes of weights)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=320,
        intermediate_size=1280,
        num_hidden_layers=24,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path, max_shard_size="40MB")
    return model, sum(p.numel() * 4 for p in model.parameters())
