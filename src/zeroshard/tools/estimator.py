"""Model-state memory and communication of ZeRO stages 0-3, as closed-form arithmetic.

The formulas are those of ZeRO (Rajbhandari et al., arXiv 1910.02054), §5 and Figure 1, with
Ψ = parameters, N = ranks and K = optimizer-state bytes per parameter, generalised from the paper's
2 + 2 + K (fp16 params, fp16 grads) to any `Recipe`. A sharded state costs ceil(Ψ/N) elements per rank:
that is what a flat buffer padded to a multiple of N holds, it equals Ψ/N for the paper's example, and it
keeps every byte count an exact integer. No torch here; the engine's measured bytes are checked against this.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from zeroshard.core.policy import stage_policy

# Re-exported: callers read and print sizes through the estimator (est.parse_bytes, est.format_bytes).
from zeroshard.tools.units import format_bytes, format_count, parse_bytes, parse_count  # noqa: F401

OFFLOAD_TARGETS = ("cpu", "nvme")
PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes of a parameter held for compute
# fp32 states each optimizer keeps per parameter (Adam: m and v; SGD with momentum: the buffer).
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}
# torchao's block-wise optimizers ([Note: block-wise optimizer states] in core/optim/lowbit.py): bytes
# per parameter of their two moments, each a code per element plus an fp32 scale per block (8-bit and
# fp8: 1 + 4/256; 4-bit: 1/2 + 4/128). Modelled: a tensor under 4096 elements keeps fp32 moments and
# each quantized one a code map (1 KiB at 8 bits), which a model's large matrices make negligible.
BLOCKWISE_STATE_BYTES = {
    "adamw8bit": 2 * (1 + Fraction(4, 256)),
    "adamw4bit": 2 * (Fraction(1, 2) + Fraction(4, 128)),
    "adamwfp8": 2 * (1 + Fraction(4, 256)),
}
OPTIMIZERS = (*OPTIMIZER_STATES, *BLOCKWISE_STATE_BYTES)


def format_k(k: int | Fraction) -> str:
    """K for people: 12, or 6.03 for a block-wise recipe."""
    return str(k) if int(k) == k else f"{float(k):.2f}"


@dataclass(frozen=True)
class Recipe:
    """Bytes per parameter: `param_bytes` held for compute, `grad_bytes` of its gradient, and `k` for the
    optimizer, which includes the fp32 master copy whenever the compute dtype is not fp32 (paper §3.1)."""

    name: str
    param_bytes: int
    grad_bytes: int
    k: int | Fraction  # a Fraction for block-wise states; byte counts round up to whole bytes


MASTERS = ("fp32", "bf16")  # the master weights' dtype ([Note: bf16 master weights] in core/precision.py)


def recipe(precision: str = "bf16", optimizer: str = "adam", k: int | None = None, master: str = "fp32") -> Recipe:
    """Mixed-precision Adam gives the paper's K = 12 (4 master + 4 m + 4 v); fp32 Adam K = 8, since the
    parameter is its own master; torchao's AdamW8bit K = 4 + 2.03 mixed (`BLOCKWISE_STATE_BYTES`).
    `master="bf16"` (bf16 only): the bf16 parameters are the masters and torch's optimizers keep their
    states in bf16, so Adam's K = 4 (AdamW8bit's 2.03). `k` overrides the derived value."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} unknown; allowed: {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} unknown; allowed: {', '.join(OPTIMIZERS)}")
    if master not in MASTERS:
        raise ValueError(f"master {master!r} unknown; allowed: {', '.join(MASTERS)}")
    if master == "bf16" and precision != "bf16":
        raise ValueError(f"bf16 master weights need bf16 precision, got {precision!r}")
    width = PRECISIONS[precision]
    copy = 0 if width == 4 or master == "bf16" else 4  # a separate fp32 master
    state_width = 2 if master == "bf16" else 4
    states = BLOCKWISE_STATE_BYTES.get(optimizer, state_width * OPTIMIZER_STATES.get(optimizer, 0))
    derived = copy + states
    if k is not None and (not isinstance(k, int) or k < 0):
        raise ValueError(f"K must be a non-negative integer number of bytes per parameter, got {k!r}")
    name = f"{precision} {optimizer}" + (" bf16 masters" if master == "bf16" else "")
    return Recipe(name, width, width, derived if k is None else k)


MIXED_ADAM = recipe("fp16", "adam")  # the paper's recipe, K = 12
LOW_BIT_ADAM = ("adamw8bit", "adamw4bit")  # block-wise states in place of Adam's fp32 moments


def adam_recipes(precision: str) -> list[tuple[str, str, Recipe]]:
    """(master, optimizer, Recipe) of every model-state recipe for Adam at `precision`: fp32 masters
    (or the fp32 parameters themselves), then bf16 masters (bf16 only), each with Adam's states,
    then torchao's 8- and 4-bit ones."""
    masters = MASTERS if precision == "bf16" else ("fp32",)
    return [(m, o, recipe(precision, o, master=m)) for m in masters for o in ("adam", *LOW_BIT_ADAM)]


def bytes_per_param(rec: Recipe) -> int | Fraction:
    """Model-state bytes per parameter before sharding: 2 + 2 + K at 16-bit compute."""
    return rec.param_bytes + rec.grad_bytes + rec.k


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes of one rank. `params`, `grads`, `optimizer` and `total` are on the device;
    what offload moved off it is counted in `offloaded_cpu` / `offloaded_nvme` instead."""

    params: int
    grads: int
    optimizer: int
    total: int
    offloaded_cpu: int = 0
    offloaded_nvme: int = 0


@dataclass(frozen=True)
class _Term:
    kind: str  # "params" | "grads" | "optimizer"
    bytes_per_param: int | Fraction
    sharded: bool  # costs ceil(Ψ/N) elements per rank instead of Ψ
    tier: str  # "device" | "cpu" | "nvme"


def offload_error(stage: int, offload_optimizer: str | None, offload_param: str | None) -> str | None:
    """Why this offload setting is invalid at `stage` (None when it is valid)."""
    for flag, value in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if value is not None and value not in OFFLOAD_TARGETS:
            return f"{flag}={value!r} unknown; allowed: None, {', '.join(OFFLOAD_TARGETS)}"
    # Same rules as DeepSpeed's config: optimizer offload needs ZeRO (stage >= 1), param offload stage 3.
    if offload_optimizer is not None and stage < 1:
        return "offload_optimizer needs ZeRO stage 1, 2 or 3"
    if offload_param is not None and stage != 3:
        return "offload_param needs ZeRO stage 3"
    return None


def _check_offload(stage: int, offload_optimizer: str | None, offload_param: str | None) -> None:
    reason = offload_error(stage, offload_optimizer, offload_param)
    if reason is not None:
        raise ValueError(f"{reason} (stage {stage})")


def _terms(stage: int, rec: Recipe, offload_optimizer: str | None, offload_param: str | None) -> list[_Term]:
    policy = stage_policy(stage)
    _check_offload(stage, offload_optimizer, offload_param)
    terms = [_Term("params", rec.param_bytes, policy.shard_parameters, offload_param or "device")]
    if offload_optimizer is None:
        terms.append(_Term("grads", rec.grad_bytes, policy.shard_gradients, "device"))
        terms.append(_Term("optimizer", rec.k, policy.shard_optimizer, "device"))
        return terms
    # ZeRO-Offload (Ren et al., arXiv 2101.06840, §4) runs the optimizer where its states live, so the
    # gradient partition it consumes lives there too, in fp32 as DeepSpeed keeps it (its estimator counts
    # 16 B/param on the host = 4 fp32 grad + K 12). Stage 1 still holds full-size gradients on the device;
    # from stage 2 on, gradients on the device exist only in transient reduce buckets, not model states.
    if not policy.shard_gradients:
        terms.append(_Term("grads", rec.grad_bytes, False, "device"))
    terms.append(_Term("grads", 4, True, offload_optimizer))
    terms.append(_Term("optimizer", rec.k, True, offload_optimizer))
    return terms


def _count(value: float, name: str, minimum: int) -> int:
    """An integral count; integral floats such as 7.5e9 are accepted."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def model_state_bytes(
    params: int,
    ranks: int,
    stage: int,
    recipe: Recipe = MIXED_ADAM,
    offload_optimizer: str | None = None,
    offload_param: str | None = None,
) -> StateBytes:
    """Per-rank model-state bytes (paper §5.1-5.3): stage 0 (2+2+K)Ψ, 1 4Ψ+KΨ/N, 2 2Ψ+(2+K)Ψ/N, 3 (4+K)Ψ/N."""
    params, ranks = _count(params, "params", 0), _count(ranks, "ranks", 1)
    shard = -(-params // ranks)  # ceil(Ψ/N): elements of a flat buffer padded to a multiple of N
    device = {"params": 0, "grads": 0, "optimizer": 0}
    off = {"cpu": 0, "nvme": 0}
    for term in _terms(stage, recipe, offload_optimizer, offload_param):
        nbytes = math.ceil(term.bytes_per_param * (shard if term.sharded else params))
        if term.tier == "device":
            device[term.kind] += nbytes
        else:
            off[term.tier] += nbytes
    return StateBytes(**device, total=sum(device.values()), offloaded_cpu=off["cpu"], offloaded_nvme=off["nvme"])


def _largest_within(replicated: int | Fraction, sharded: int | Fraction, memory: int, ranks: int) -> int | None:
    """Largest Ψ with replicated*Ψ + sharded*ceil(Ψ/N) <= memory; None when nothing bounds Ψ."""
    if replicated == 0 and sharded == 0:
        return None
    if sharded == 0:
        return int(memory // replicated)
    if replicated == 0:
        return int(memory // sharded) * ranks
    # Write s = ceil(Ψ/N). The largest feasible s is the one whose smallest Ψ, (s-1)N + 1, still fits;
    # within it, Ψ is capped by both the memory left and sN.
    s = int((memory + replicated * (ranks - 1)) // (replicated * ranks + sharded))
    return max(0, min(s * ranks, int((memory - sharded * s) // replicated))) if s > 0 else 0


def largest_model(
    memory_bytes: int,
    ranks: int,
    stage: int,
    recipe: Recipe = MIXED_ADAM,
    offload_optimizer: str | None = None,
    offload_param: str | None = None,
    cpu_bytes: int | None = None,
    nvme_bytes: int | None = None,
) -> int:
    """Largest Ψ whose per-rank model states fit in `memory_bytes` of device memory (and in `cpu_bytes` /
    `nvme_bytes` per rank when given; an offload tier without a budget is taken as unbounded)."""
    ranks = _count(ranks, "ranks", 1)
    budgets = {"device": memory_bytes, "cpu": cpu_bytes, "nvme": nvme_bytes}
    budgets = {tier: None if b is None else _count(b, f"{tier} memory (bytes)", 0) for tier, b in budgets.items()}
    coefficients: dict[str, list[int | Fraction]] = {tier: [0, 0] for tier in budgets}  # [replicated, sharded] B/param
    for term in _terms(stage, recipe, offload_optimizer, offload_param):
        coefficients[term.tier][int(term.sharded)] += term.bytes_per_param
    found = [
        _largest_within(rep, shd, budget, ranks)
        for tier, (rep, shd) in coefficients.items()
        if (budget := budgets[tier]) is not None
    ]
    limits = [limit for limit in found if limit is not None]
    if not limits:
        raise ValueError("nothing bounds the model size: all model states are offloaded; give a cpu/nvme budget")
    return min(limits)


def comm_elements_per_step(params: int, stage: int) -> int:
    """Paper convention (§7): all-reduce of Ψ = 2Ψ (reduce-scatter + all-gather); stages 0-2 move 2Ψ,
    stage 3 moves 3Ψ (all-gather in forward, again in backward, reduce-scatter of gradients)."""
    return (3 if stage_policy(stage).shard_parameters else 2) * _count(params, "params", 0)


def comm_bytes_per_step(params: int, stage: int, dtype_bytes: int = 2) -> int:
    return comm_elements_per_step(params, stage) * dtype_bytes


def ring_bytes_sent_per_rank(params: int, ranks: int, stage: int, dtype_bytes: int = 2) -> float:
    """A ring collective over N ranks makes each rank send (N-1)/N of the paper-convention volume."""
    ranks = _count(ranks, "ranks", 1)
    return comm_bytes_per_step(params, stage, dtype_bytes) * (ranks - 1) / ranks


# ---- 3D parallelism: ZeRO over dp of what tensor and pipeline parallelism leave on a rank ----


@dataclass(frozen=True)
class Layout:
    """A dp x tp x pp mesh. Tensor and pipeline parallelism split the Ψ parameters over tp·pp ranks
    first; ZeRO then partitions each rank's part over its dp group (ZeRO §8, "3D parallelism")."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        for name in ("dp", "tp", "pp"):
            _count(getattr(self, name), name, 1)

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp


def local_params(params: int, layout: Layout, replicated: int = 0) -> int:
    """Parameters one model-parallel rank holds: ceil((Ψ - R)/(tp·pp)) + R/pp, where the `replicated`
    R (LayerNorms, row-parallel biases) is held whole by every tp rank of its pipeline stage."""
    params, replicated = _count(params, "params", 0), _count(replicated, "replicated params", 0)
    if replicated > params:
        raise ValueError(f"replicated params ({replicated}) exceed params ({params})")
    split = -(-(params - replicated) // layout.model_parallel)
    return split + -(-replicated // layout.pp)


def mesh_state_bytes(
    params: int,
    layout: Layout,
    stage: int,
    recipe: Recipe = MIXED_ADAM,
    *,
    replicated: int = 0,
    offload_optimizer: str | None = None,
    offload_param: str | None = None,
) -> StateBytes:
    """Per-rank model-state bytes under `layout`: the §5 formulas for the rank's `local_params`, N = dp."""
    return model_state_bytes(
        local_params(params, layout, replicated), layout.dp, stage, recipe, offload_optimizer, offload_param
    )


@dataclass(frozen=True)
class Activations:
    """What tp and pp traffic scale with: `tokens` per micro-batch on a rank (micro batch x sequence),
    `hidden` size, `layers` of the model, `micro_batches` per step."""

    tokens: int
    hidden: int
    layers: int
    micro_batches: int = 1


def mesh_comm_bytes(
    params: int,
    layout: Layout,
    stage: int,
    dtype_bytes: int = 2,
    *,
    replicated: int = 0,
    activations: Activations | None = None,
) -> dict:
    """Paper-convention bytes per step and rank, per mesh dimension. dp: ZeRO's 2Ψ_local (3Ψ_local at
    stage 3). tp (Megatron-LM, Shoeybi et al. §3): per layer and micro-batch 2 all-reduces of the
    activations in forward and 2 in backward, tokens x hidden each (all-reduce = 2x). pp: per
    micro-batch each stage boundary sends the activations forward and their gradient back. tp and pp
    are None without `activations`; 0 when that dimension is 1."""
    out = {
        "dp": comm_bytes_per_step(local_params(params, layout, replicated), stage, dtype_bytes) if layout.dp > 1 else 0,
        "tp": None,
        "pp": None,
    }
    if activations is None:
        out.update(tp=0 if layout.tp == 1 else None, pp=0 if layout.pp == 1 else None)
        return out
    act = activations.tokens * activations.hidden * dtype_bytes * activations.micro_batches
    layers_here = -(-activations.layers // layout.pp)
    out["tp"] = 0 if layout.tp == 1 else 4 * 2 * act * layers_here
    out["pp"] = 0 if layout.pp == 1 else 2 * act
    return out


# ---- parameter counts: built-in GPT configs and HuggingFace-style config JSON ----


@dataclass(frozen=True)
class GPTSpec:
    """A GPT-2-style decoder (pre-LayerNorm, biases everywhere, 4x MLP); `zeroshard.tools.models.gpt` builds it."""

    vocab: int
    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    tie: bool = True  # LM head shares the token embedding's weight

    def num_params(self) -> int:
        d = self.n_embd
        block = (
            2 * d  # ln_1 weight + bias
            + d * 3 * d
            + 3 * d  # attention qkv Linear
            + d * d
            + d  # attention output projection
            + 2 * d  # ln_2
            + d * 4 * d
            + 4 * d
            + 4 * d * d
            + d
        )  # MLP up and down
        embeddings = self.vocab * d + self.block_size * d
        head = 0 if self.tie else self.vocab * d  # the head has no bias, as in GPT-2
        return embeddings + self.n_layer * block + 2 * d + head  # + final LayerNorm

    def tp_replicated_params(self) -> int:
        """Parameters every tensor-parallel rank holds whole. Megatron-LM splits embeddings and linears
        over tp; LayerNorms, the biases of row-parallel linears and position embeddings stay whole
        (6 per layer: 2 LayerNorms x 2, 2 biases; plus the final LayerNorm)."""
        return self.n_layer * 6 * self.n_embd + 2 * self.n_embd + self.block_size * self.n_embd


# gpt-small .. gpt2-xl are GPT-2's published shapes (124M, 355M, 774M, 1.56B); gpt-2.7b is GPT-3's 2.7B
# shape; gpt-7.5b (7.46B) is sized for the paper's 7.5B example. The vocab is padded to a multiple of 64
# for the large ones, as Megatron-style training does.
BUILTIN_MODELS: dict[str, GPTSpec] = {
    "gpt-tiny": GPTSpec(vocab=512, n_layer=2, n_embd=64, n_head=4, block_size=64),
    "gpt-mini": GPTSpec(vocab=4096, n_layer=4, n_embd=256, n_head=4, block_size=256),
    "gpt-small": GPTSpec(vocab=50257, n_layer=12, n_embd=768, n_head=12, block_size=1024),
    "gpt-medium": GPTSpec(vocab=50257, n_layer=24, n_embd=1024, n_head=16, block_size=1024),
    "gpt-large": GPTSpec(vocab=50257, n_layer=36, n_embd=1280, n_head=20, block_size=1024),
    "gpt2-xl": GPTSpec(vocab=50257, n_layer=48, n_embd=1600, n_head=25, block_size=1024),
    "gpt-2.7b": GPTSpec(vocab=50304, n_layer=32, n_embd=2560, n_head=32, block_size=2048),
    "gpt-7.5b": GPTSpec(vocab=50304, n_layer=36, n_embd=4096, n_head=32, block_size=2048),
}


def _gpt2_config_params(cfg: dict) -> int:
    # transformers' GPT2LMHeadModel: Conv1D layers with bias, LayerNorms with bias, head without bias.
    if cfg.get("add_cross_attention"):
        raise ValueError("GPT-2 configs with add_cross_attention are not supported")
    d, inner = cfg["n_embd"], cfg.get("n_inner") or 4 * cfg["n_embd"]
    block = 4 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * inner + inner) + (inner * d + d)
    head = 0 if cfg.get("tie_word_embeddings", True) else cfg["vocab_size"] * d
    return (cfg["vocab_size"] + cfg["n_positions"]) * d + cfg["n_layer"] * block + 2 * d + head


def _llama_config_params(cfg: dict, qkv_bias: bool = False) -> int:
    # transformers' LlamaForCausalLM (Mistral, and Qwen2 with q/k/v biases, share the layout): RMSNorms
    # with weight only, no biases unless attention_bias / mlp_bias, rotary embeddings have no parameters.
    h, inter, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    attn_bias, mlp_bias = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv) * (attn_bias or qkv_bias) + h * attn_bias
    layer = attn + 3 * h * inter + (2 * inter + h) * mlp_bias + 2 * h
    head = 0 if cfg.get("tie_word_embeddings", False) else cfg["vocab_size"] * h
    return cfg["vocab_size"] * h + cfg["num_hidden_layers"] * layer + h + head


_HF_COUNTERS = {
    "gpt2": _gpt2_config_params,
    "llama": _llama_config_params,
    "mistral": _llama_config_params,
    "qwen2": lambda cfg: _llama_config_params(cfg, qkv_bias=True),
}


def count_params_from_config(path_or_name: str | Path) -> int:
    """Parameters of a built-in model name (see BUILTIN_MODELS) or of a HuggingFace-style config.json."""
    if str(path_or_name) in BUILTIN_MODELS:
        return BUILTIN_MODELS[str(path_or_name)].num_params()
    path = Path(path_or_name)
    if not path.is_file():
        raise ValueError(
            f"model {str(path_or_name)!r} is neither a config file nor a built-in model ({', '.join(BUILTIN_MODELS)})"
        )
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    model_type = cfg.get("model_type") or ("gpt2" if "n_embd" in cfg else "llama" if "hidden_size" in cfg else None)
    if model_type not in _HF_COUNTERS:
        raise ValueError(f"{path}: model_type {model_type!r} unsupported; supported: {', '.join(_HF_COUNTERS)}")
    try:
        return _HF_COUNTERS[model_type](cfg)
    except KeyError as err:
        raise ValueError(f"{path}: {model_type} config lacks the key {err.args[0]!r}") from None
