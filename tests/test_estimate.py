"""The estimator's formulas against ZeRO (arXiv 1910.02054) §5 / Figure 1 and against published counts."""

import json
import math

import pytest
import torch

from zeroshard.tools import estimator as est

PSI, N = 7_500_000_000, 64


def test_paper_figure_1():
    totals = [est.model_state_bytes(PSI, N, stage).total for stage in range(4)]
    assert totals == [120_000_000_000, 31_406_250_000, 16_640_625_000, 1_875_000_000]
    assert [est.format_bytes(t) for t in totals] == ["120.0 GB", "31.4 GB", "16.6 GB", "1.9 GB"]
    assert est.model_state_bytes(7.5e9, 64.0, 1).total == totals[1]  # integral floats are counts too


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("k", [0, 4, 8, 12, 16])
@pytest.mark.parametrize("params, ranks", [(PSI, N), (1_000_003, 7), (10, 16), (96, 1)])
def test_generic_formula(stage, k, params, ranks):
    # Stage s shards the optimizer from s >= 1, gradients from s >= 2, parameters at s = 3 (Figure 1);
    # a shard is ceil(Ψ/N) elements, the flat buffer padded to a multiple of N.
    rec = est.Recipe("custom", param_bytes=2, grad_bytes=2, k=k)
    shard = -(-params // ranks)
    expect = {
        "params": 2 * (shard if stage >= 3 else params),
        "grads": 2 * (shard if stage >= 2 else params),
        "optimizer": k * (shard if stage >= 1 else params),
    }
    got = est.model_state_bytes(params, ranks, stage, rec)
    assert (got.params, got.grads, got.optimizer) == tuple(expect.values())
    assert got.total == sum(expect.values()) and got.offloaded_cpu == got.offloaded_nvme == 0


@pytest.mark.parametrize(
    "precision, optimizer, k",
    [
        ("fp16", "adam", 12),
        ("bf16", "adamw", 12),
        ("fp32", "adam", 8),
        ("fp32", "adamw", 8),
        ("fp32", "sgd_momentum", 4),
        ("bf16", "sgd_momentum", 8),
        ("fp32", "sgd", 0),
        ("fp16", "sgd", 4),
    ],
)
def test_recipe_k(precision, optimizer, k):
    rec = est.recipe(precision, optimizer)
    assert rec.k == k
    assert rec.param_bytes == rec.grad_bytes == (4 if precision == "fp32" else 2)
    assert est.recipe(precision, optimizer, k=3).k == 3


def test_blockwise_recipes_count_codes_and_one_scale_per_block():
    """torchao's AdamW8bit: per moment a code per element and an fp32 scale per 256 elements; 4-bit:
    half a byte and a scale per 128. Mixed precision adds the fp32 master."""
    assert est.recipe("fp32", "adamw8bit").k == 2 + 2 * 4 / 256 == 2.03125
    assert est.recipe("bf16", "adamw8bit").k == 4 + 2.03125
    assert est.recipe("fp32", "adamw4bit").k == 1 + 2 * 4 / 128
    assert est.recipe("fp32", "adamwfp8").k == est.recipe("fp32", "adamw8bit").k
    states = est.model_state_bytes(10**9, 8, 3, est.recipe("bf16", "adamw8bit"))
    assert states.optimizer == 6_031_250_000 // 8 and states.total == (2 + 2) * 10**9 // 8 + states.optimizer
    assert est.format_k(est.recipe("bf16", "adamw8bit").k) == "6.03" and est.format_k(12) == "12"


def test_bf16_master_recipes_drop_the_fp32_copy():
    """bf16 master weights: the parameters are the masters and torch's optimizers keep bf16 states."""
    assert est.recipe("bf16", "adamw", master="bf16").k == 4  # m and v in bf16, no fp32 copy
    assert est.recipe("bf16", "adamw8bit", master="bf16").k == 2.03125  # the 6-bytes-per-parameter recipe
    states = est.model_state_bytes(10**9, 8, 3, est.recipe("bf16", "adamw8bit", master="bf16"))
    assert states.total == math.ceil((2 + 2 + 2.03125) * 10**9 / 8)
    with pytest.raises(ValueError, match="bf16 precision"):
        est.recipe("fp32", "adamw", master="bf16")
    with pytest.raises(ValueError, match="master 'fp16' unknown"):
        est.recipe("bf16", "adamw", master="fp16")


def test_estimate_compares_adams_recipes_with_the_largest_model_of_each(capsys):
    from zeroshard.tools.cli import main

    argv = ["estimate", "--params", "7.5B", "--ranks", "8", "--memory", "24GiB", "--recipes"]
    assert main([*argv, "--json"]) == 0
    rows = {row["recipe"]: row for row in json.loads(capsys.readouterr().out)["recipes"]}
    assert list(rows) == [
        "bf16 adam",
        "bf16 adamw8bit",
        "bf16 adamw4bit",
        "bf16 adam bf16 masters",
        "bf16 adamw8bit bf16 masters",
        "bf16 adamw4bit bf16 masters",
    ]
    for row in rows.values():
        rec = est.recipe("bf16", row["optimizer"], master=row["master"])
        assert row["bytes_per_param"] == float(est.bytes_per_param(rec))
        assert row["total_bytes"] == [est.model_state_bytes(7_500_000_000, 8, s, rec).total for s in range(4)]
        assert row["largest_params"][3] == est.largest_model(24 * 2**30, 8, 3, rec)
    assert rows["bf16 adamw8bit bf16 masters"]["bytes_per_param"] == 6.03125  # 2 + 2 + 2.03
    assert main(argv) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[-1].split()[:6] == ["bf16", "adamw4bit", "bf16", "masters", "5.06", "38.0"]
    assert main(["estimate", "--params", "1B", "--precision", "fp32", "--recipes", "--json"]) == 0
    assert [r["master"] for r in json.loads(capsys.readouterr().out)["recipes"]] == ["fp32"] * 3
    assert main(["estimate", "--params", "1B", "--optimizer", "sgd", "--recipes"]) == 2
    assert "--optimizer sgd is not Adam" in capsys.readouterr().err


def test_fp32_adam_stage_0_and_3():
    rec = est.recipe("fp32", "adam")  # 4 + 4 + 8 = 16 bytes per parameter, no master copy
    assert est.model_state_bytes(1000, 1, 0, rec).total == 16_000
    assert est.model_state_bytes(1000, 10, 3, rec).total == 1_600
    assert est.model_state_bytes(1000, 10, 1, rec).total == 8_000 + 800


@pytest.mark.parametrize("bad", [dict(precision="fp8"), dict(optimizer="lamb"), dict(k=-1)])
def test_recipe_errors_name_the_input(bad):
    with pytest.raises(ValueError, match="fp8|lamb|K must"):
        est.recipe(**bad)


def test_offload_optimizer_moves_k_and_fp32_grad_partition():
    # ZeRO-Offload (arXiv 2101.06840): K and the fp32 gradient partition live on the host.
    for stage, device_grads in [(1, 2 * PSI), (2, 0), (3, 0)]:
        got = est.model_state_bytes(PSI, N, stage, offload_optimizer="cpu")
        assert (got.grads, got.optimizer, got.offloaded_nvme) == (device_grads, 0, 0)
        assert got.offloaded_cpu == (4 + 12) * PSI // N
        assert got.params == (2 * PSI // N if stage == 3 else 2 * PSI)
        assert got.total == got.params + got.grads
    nvme = est.model_state_bytes(PSI, N, 2, offload_optimizer="nvme")
    assert (nvme.offloaded_cpu, nvme.offloaded_nvme) == (0, 16 * PSI // N)


def test_offload_param_stage_3():
    got = est.model_state_bytes(PSI, N, 3, offload_optimizer="cpu", offload_param="nvme")
    assert got.total == 0
    assert (got.offloaded_cpu, got.offloaded_nvme) == (16 * PSI // N, 2 * PSI // N)
    both = est.model_state_bytes(PSI, N, 3, offload_optimizer="cpu", offload_param="cpu")
    assert both.offloaded_cpu == 18 * PSI // N  # DeepSpeed's stage-3 estimator: 18 B/param on the host
    alone = est.model_state_bytes(PSI, N, 3, offload_param="cpu")
    assert (alone.params, alone.total, alone.offloaded_cpu) == (0, 14 * PSI // N, 2 * PSI // N)


@pytest.mark.parametrize(
    "stage, kwargs, message",
    [
        (2, dict(offload_param="cpu"), "offload_param needs ZeRO stage 3"),
        (0, dict(offload_optimizer="cpu"), "offload_optimizer needs ZeRO stage 1"),
        (3, dict(offload_optimizer="gpu"), "offload_optimizer='gpu' unknown"),
    ],
)
def test_offload_errors(stage, kwargs, message):
    with pytest.raises(ValueError, match=message):
        est.model_state_bytes(PSI, N, stage, **kwargs)


def test_bad_sizes_and_stage():
    for args, message in [
        ((-1, 4, 0), "params"),
        ((1.5, 4, 0), "params"),
        ((10, 0, 0), "ranks"),
        ((10, 4, 4), "stage"),
    ]:
        with pytest.raises(ValueError, match=message):
            est.model_state_bytes(*args)


def _fits(params, memory, ranks, stage, rec, **offload):
    state = est.model_state_bytes(params, ranks, stage, rec, **offload)
    return state.total <= memory and state.offloaded_cpu <= offload.get("cpu_bytes", float("inf"))


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("ranks", [1, 3, 8, 64, 1000])
@pytest.mark.parametrize("memory", [0, 15, 16, 1000, 12_345_677, 32 * 2**30, 80 * 10**9 + 7])
@pytest.mark.parametrize(
    "rec",
    [
        est.MIXED_ADAM,
        est.recipe("fp32", "sgd"),
        est.recipe("fp32", "adam"),
        est.recipe("bf16", "adamw8bit"),
        est.recipe("fp32", "adamw4bit"),
        est.recipe("bf16", "adamw8bit", master="bf16"),
    ],
    ids=lambda rec: rec.name,
)
def test_largest_model_is_the_exact_inverse(stage, ranks, memory, rec):
    largest = est.largest_model(memory, ranks, stage, rec)
    assert est.model_state_bytes(largest, ranks, stage, rec).total <= memory
    assert est.model_state_bytes(largest + 1, ranks, stage, rec).total > memory


def test_estimate_shows_the_largest_model_of_the_paper_formula(capsys):
    """fp32 Adam, 2 ranks, the 809 MB a 1 GiB-capped bench rank has after its baseline: the model states
    alone, 16 B/param at stage 0, 4 + 4 + 8/2 = 12 at stage 1, 4 + 12/2 = 10 at stage 2, 16/2 = 8 at stage 3."""
    from zeroshard.tools.cli import main

    assert (
        main(["estimate", "--params", "25M", "--ranks", "2", "--precision", "fp32", "--memory", "809MB", "--json"]) == 0
    )
    rows = json.loads(capsys.readouterr().out)["stages"]
    assert [row["largest_params"] // 10**5 for row in rows] == [809 * 10**6 // b // 10**5 for b in (16, 12, 10, 8)]
    assert not [key for row in rows for key in row if "snapshot" in key or "step_" in key], "model states only"
    assert main(["estimate", "--params", "25M", "--ranks", "2", "--precision", "fp32", "--memory", "809MB"]) == 0
    header = [line for line in capsys.readouterr().out.splitlines() if line.startswith("stage ")][0]
    assert header.endswith("comm/step  largest model")


@pytest.mark.parametrize(
    "stage, offload",
    [
        (1, dict(offload_optimizer="cpu")),
        (2, dict(offload_optimizer="nvme")),
        (3, dict(offload_optimizer="cpu", offload_param="nvme")),
    ],
)
def test_largest_model_with_offload(stage, offload):
    memory, cpu = 32 * 2**30, 256 * 2**30
    largest = est.largest_model(memory, 16, stage, cpu_bytes=cpu, **offload)
    state = est.model_state_bytes(largest, 16, stage, **offload)
    after = est.model_state_bytes(largest + 1, 16, stage, **offload)
    assert state.total <= memory and state.offloaded_cpu <= cpu
    assert after.total > memory or after.offloaded_cpu > cpu
    if stage == 3:  # nothing left on the device and NVMe unbounded: the host budget decides alone
        assert largest == cpu // 16 * 16
        with pytest.raises(ValueError, match="nothing bounds"):
            est.largest_model(memory, 16, 3, offload_optimizer="nvme", offload_param="nvme")


def test_paper_table_1_largest_models():
    # Paper Table 1, 32 GB per device, N = 64, K = 12: 2B / 7.6B / 14.4B / 128B.
    sizes = [est.largest_model(32 * 10**9, 64, stage) for stage in range(4)]
    assert [round(size / 1e9, 1) for size in sizes] == [2.0, 7.6, 14.4, 128.0]


def test_communication():
    assert [est.comm_elements_per_step(PSI, s) for s in range(4)] == [2 * PSI] * 3 + [3 * PSI]
    assert est.comm_bytes_per_step(PSI, 3, dtype_bytes=2) == 6 * PSI
    assert est.ring_bytes_sent_per_rank(PSI, 64, 0, dtype_bytes=2) == pytest.approx(4 * PSI * 63 / 64)
    assert est.ring_bytes_sent_per_rank(PSI, 1, 2) == 0


def test_units():
    assert est.parse_bytes("32GiB") == 32 * 2**30
    assert est.parse_bytes("32GB") == 32 * 10**9
    assert est.parse_bytes("1.5e10") == 15 * 10**9
    assert est.parse_bytes("512 mib") == 512 * 2**20
    assert est.parse_count("7.5B") == est.parse_count("7.5e9") == PSI
    assert est.parse_count("125M") == 125 * 10**6
    for bad in ["12XB", "", "GB", "1.2.3GB"]:
        with pytest.raises(ValueError, match="memory size"):
            est.parse_bytes(bad)
    assert est.format_bytes(234_375_000) == "234.4 MB" and est.format_bytes(0) == "0 B"


# Published counts: GPT-2 (transformers' GPT2LMHeadModel, tied head); Llama-2-7B, TinyLlama-1.1B,
# Llama-3-8B (GQA, untied) and Qwen2-0.5B (q/k/v biases, tied) from their model cards / safetensors indexes.
GPT2 = dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
LLAMA2_7B = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
)


@pytest.mark.parametrize(
    "cfg, expected",
    [
        (GPT2, 124_439_808),
        ({**GPT2, "tie_word_embeddings": False}, 124_439_808 + 50257 * 768),
        ({**GPT2, "n_embd": 1600, "n_layer": 48, "n_head": 25}, 1_557_611_200),
        (LLAMA2_7B, 6_738_415_616),
        (
            {
                **LLAMA2_7B,
                "hidden_size": 2048,
                "intermediate_size": 5632,
                "num_hidden_layers": 22,
                "num_key_value_heads": 4,
            },
            1_100_048_384,
        ),
        ({**LLAMA2_7B, "intermediate_size": 14336, "num_key_value_heads": 8, "vocab_size": 128256}, 8_030_261_248),
        (
            dict(
                model_type="qwen2",
                hidden_size=896,
                intermediate_size=4864,
                num_hidden_layers=24,
                num_attention_heads=14,
                num_key_value_heads=2,
                vocab_size=151936,
                tie_word_embeddings=True,
            ),
            494_032_768,
        ),
    ],
)
def test_hf_config_counts(tmp_path, cfg, expected):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert est.count_params_from_config(path) == expected
    assert est.count_params_from_config(str(path)) == expected


def test_hf_config_errors(tmp_path):
    bad_type = tmp_path / "t5.json"
    bad_type.write_text(json.dumps({"model_type": "t5"}))
    missing = tmp_path / "gpt2.json"
    missing.write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    for target, message in [
        (bad_type, "model_type 't5' unsupported"),
        (missing, "lacks the key"),
        ("no-such-model", "neither a config file nor a built-in"),
    ]:
        with pytest.raises(ValueError, match=message):
            est.count_params_from_config(target)


@pytest.mark.parametrize(
    "name, expected",
    [("gpt-small", 124_439_808), ("gpt-medium", 354_823_168), ("gpt-large", 774_030_080), ("gpt2-xl", 1_557_611_200)],
)
def test_builtin_gpt_matches_published_gpt2(name, expected):
    assert est.BUILTIN_MODELS[name].num_params() == expected == est.count_params_from_config(name)


def test_builtin_sizes_match_their_names():
    assert 2.6e9 < est.BUILTIN_MODELS["gpt-2.7b"].num_params() < 2.8e9
    assert 7.4e9 < est.BUILTIN_MODELS["gpt-7.5b"].num_params() < 7.6e9


class _ReferenceGPT(torch.nn.Module):
    """Naive GPT-2-style module, built only to count what GPTSpec claims to count."""

    def __init__(self, s: est.GPTSpec):
        super().__init__()
        d, lin, norm = s.n_embd, torch.nn.Linear, torch.nn.LayerNorm
        self.wte, self.wpe = torch.nn.Embedding(s.vocab, d), torch.nn.Embedding(s.block_size, d)
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleList([norm(d), lin(d, 3 * d), lin(d, d), norm(d), lin(d, 4 * d), lin(4 * d, d)])
            for _ in range(s.n_layer)
        )
        self.ln_f, self.head = norm(d), lin(d, s.vocab, bias=False)
        if s.tie:
            self.head.weight = self.wte.weight


@pytest.mark.parametrize("tie", [True, False])
def test_gptspec_counts_a_reference_module(tie):
    spec = est.GPTSpec(vocab=100, n_layer=3, n_embd=24, n_head=4, block_size=16, tie=tie)
    assert spec.num_params() == sum(p.numel() for p in _ReferenceGPT(spec).parameters())


# ---- 3D parallelism: tp and pp split Ψ first, ZeRO partitions each rank's part over dp ----


def test_mesh_divides_states_by_tp_pp_then_zero_over_dp():
    layout = est.Layout(dp=16, tp=2, pp=2)
    for stage in range(4):
        assert est.mesh_state_bytes(PSI, layout, stage) == est.model_state_bytes(PSI // 4, 16, stage)
    # Replicated parameters (LayerNorms, row-parallel biases) stay whole on every tp rank of a stage.
    assert est.local_params(1000, est.Layout(tp=2, pp=2), replicated=100) == 225 + 50
    assert est.local_params(1000, est.Layout(dp=8)) == 1000


def test_mesh_comm_per_dimension():
    acts = est.Activations(tokens=8, hidden=4, layers=2, micro_batches=3)
    got = est.mesh_comm_bytes(1000, est.Layout(dp=2, tp=2, pp=2), 2, dtype_bytes=4, activations=acts)
    act = 8 * 4 * 4 * 3  # tokens x hidden x bytes x micro-batches
    assert got == {"dp": 2 * 250 * 4, "tp": 8 * act * 1, "pp": 2 * act}  # one layer per pipeline stage
    assert est.mesh_comm_bytes(1000, est.Layout(dp=4), 3) == {"dp": 3 * 1000 * 2, "tp": 0, "pp": 0}
    assert est.mesh_comm_bytes(1000, est.Layout(dp=4, tp=2), 1)["tp"] is None  # needs activations


def test_mesh_layout_rejects_bad_sizes():
    with pytest.raises(ValueError, match="tp must be an integer >= 1"):
        est.Layout(dp=2, tp=0)
    with pytest.raises(ValueError, match="replicated params"):
        est.local_params(10, est.Layout(tp=2), replicated=11)


def test_cli_estimate_mesh(capsys):
    from zeroshard.tools.cli import main

    assert (
        main(["estimate", "--model", "gpt-7.5b", "--tp", "2", "--pp", "2", "--dp", "16", "--tokens", "8192", "--json"])
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["mesh"]["dp"] == 16 and result["ranks"] == 16
    row = result["stages"][3]
    local = est.local_params(result["params"], est.Layout(16, 2, 2), result["mesh"]["replicated_params"])
    assert row["local_params"] == local
    assert row["total_bytes"] == est.model_state_bytes(local, 16, 3).total
    assert set(row["comm_bytes_per_dim"]) == {"dp", "tp", "pp"} and row["comm_bytes_per_dim"]["tp"] > 0
    assert main(["estimate", "--params", "1e9", "--tp", "2", "--pp", "2", "--dp", "16"]) == 0
    assert "dp 16 x tp 2 x pp 2" in capsys.readouterr().out
