"""Shared pieces of the engine tests: build an engine the way users do, train it like the oracle."""

from __future__ import annotations

import contextlib

import torch

import zeroshard
from tests.reference import gpt_loss
from zeroshard.tools.models.gpt import GPT, tiny_gpt_config

LR = 1e-2


def gpt_model_fn(seed: int = 0, **overrides):
    def build():
        torch.manual_seed(seed)
        return GPT(tiny_gpt_config(**overrides))

    return build


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


@contextlib.contextmanager
def torch_compile(enabled: bool):
    """Whether torchao's optimizers compile their update inside the block, as they do for users.

    They call `torch.compile` on one function per parameter shape, and inductor builds C++ kernels for
    each shape in every rank process: much of a test's CPU when the inductor cache is cold, as on a
    fresh CI machine (docs/bench/test_suite.txt). Off (torch.compiler's "force_eager" stance), the
    same function runs eagerly, on DDP's side as on zeroshard's, so a parity case still compares like
    with like. On, the block compiles afresh (code an earlier block of this rank process compiled is
    dropped first) and must have compiled a graph."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    if not enabled:
        with torch.compiler.set_stance("force_eager"):
            yield
        return
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    yield
    assert counters["stats"]["unique_graphs"] > before, "torch.compile compiled nothing in a case that runs it"


def make_config(stage: int, gas: int = 1, clip: float = 0.0, micro: int = 4, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "overlap_comm": True, **zero},
        "zeroshard": {"comm_timeout_s": 60},
    }


def train_engine(
    model_fn, batches, *, config: dict, optimizer_fn=adamw, steps: int, loss_fn=gpt_loss, record_params: bool = False
) -> dict:
    """Train with zeroshard; returns the same keys as tests.reference.train_ddp plus the engine's reports."""
    model = model_fn()
    optimizer = optimizer_fn(model.parameters()) if optimizer_fn is not None else None  # None: config's
    engine, _, _, _ = zeroshard.initialize(model=model, optimizer=optimizer, config=config)
    rank, gas = engine.global_rank, engine.gradient_accumulation_steps()
    out = {"losses": [], "grad_norms": [], "params_per_step": []}
    comm_before = engine.comm.counter.data_bytes()
    for step in range(steps):
        losses = []
        for micro in range(gas):
            inputs, targets = batches(step, micro, rank)
            loss = loss_fn(engine, inputs, targets)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out["losses"].append(losses)
        out["grad_norms"].append(engine.get_global_grad_norm())
        if record_params:
            out["params_per_step"].append(full_params(engine))
    engine.sharded.wait_parameters()  # the last step's all-gathers, issued as the next forward needs them
    out["comm_per_step"] = (engine.comm.counter.data_bytes() - comm_before) / steps
    out["params"] = full_params(engine)
    out["memory"] = engine.memory_report()
    out["num_parameters"] = engine.num_parameters()
    out["groups"] = len(engine.groups)
    out["units"] = [unit.name for unit in engine.units]
    plan = engine.sharded._owner_plan
    out["whole_padding"] = plan.padding if plan is not None else None
    engine.destroy()
    return out


def full_params(engine) -> dict:
    module = engine.module
    with engine.gathered_parameters(list(module.parameters())):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def gather_masters(engine) -> dict:
    """fp32 master values by parameter name, assembled from every rank's shard."""
    out = {}
    for group in engine.groups:
        full = group.master
        if group.sharded_master:
            full = torch.empty(group.layout.padded_numel, dtype=group.master.dtype)
            engine.comm.all_gather(full, group.master.contiguous(), "test: gather masters", counts=group.layout.counts)
        for slot, view in zip(group.layout.slots, group.layout.views(full)):
            out[slot.name] = view.clone()
    return out


def without_key_bias(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as a comparison to tolerance should see it: a fused attention bias (`...attn.qkv.bias`,
    laid out q, k, v) without its key third.

    [Note: the key bias has no gradient]: adding b_k to every key adds q . b_k to a whole row of scores, which
    softmax ignores, so its true gradient is zero and what backward returns is rounding noise; AdamW divides
    that noise by its own running scale, so the key bias moves by up to lr per step in a direction set by the
    noise. Two runs that differ by one unit in the last place anywhere (a CUDA and a CPU Adam, another
    summation order) end with key biases 1e-3 apart relative to the tensor after 5 steps, where every other
    tensor is within 1e-5 (measured on the test GPT by nudging every initial weight one ulp). Bit-exact
    comparisons keep it: equal runs are equal."""
    if name.endswith("attn.qkv.bias"):
        width = tensor.numel() // 3
        return torch.cat([tensor[:width], tensor[2 * width :]])
    return tensor


def relative_error(name: str, ours: torch.Tensor, ref: torch.Tensor) -> float:
    """|ours - ref| / |ref| over the tensor as `without_key_bias` leaves it: relative to the tensor's norm,
    since an elementwise relative error is meaningless for the near-zero entries where Adam's m / sqrt(v)
    amplifies a different summation order."""
    ours, ref = without_key_bias(name, ours.float()), without_key_bias(name, ref.float())
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-12))


def assert_close(ours: dict, ref: dict, *, exact: bool, rtol: float = 1e-5, what: str = "") -> None:
    """Losses at every micro step and parameters at every recorded step agree."""
    if exact:
        assert ours["losses"] == ref["losses"], f"{what}: losses differ\n{ours['losses']}\n{ref['losses']}"
    else:
        for a, b in zip(sum(ours["losses"], []), sum(ref["losses"], [])):
            assert abs(a - b) <= rtol * abs(b) + 1e-7, f"{what}: loss {a} vs {b}"
    pairs = list(zip(ours.get("params_per_step") or [], ref.get("params_per_step") or []))
    pairs.append((ours["params"], ref["params"]))
    for step, (mine, theirs) in enumerate(pairs):
        assert mine.keys() == theirs.keys(), (what, sorted(mine), sorted(theirs))
        for name in theirs:
            a, b = mine[name], theirs[name]
            if exact:
                assert torch.equal(a, b), f"{what}: step {step} '{name}' differs by {(a - b).abs().max()}"
            else:
                error = relative_error(name, a, b)
                assert error <= rtol, f"{what}: step {step} '{name}' relative error {error:.2e} > {rtol}"
