"""Shared by the checkpoint tests: build an engine like a user does, train micro steps, read back; train
one global batch at any world size; read a checkpoint's training state offline and compare two."""

from __future__ import annotations

import torch

import zeroshard
from tests.reference import gpt_batches, gpt_loss
from tests.zs_common import adamw, gpt_model_fn, make_config
from zeroshard.checkpoint import open_checkpoint
from zeroshard.checkpoint.reader import CheckpointReader
from zeroshard.tools.models.gpt import tiny_gpt_config

SCHEDULER = {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 6, "warmup_type": "linear"},
}


def build_engine(
    stage: int,
    *,
    seed: int = 0,
    gas: int = 1,
    clip: float = 0.0,
    micro: int = 4,
    scheduler: bool = True,
    optimizer_fn=adamw,
    zero: dict | None = None,
    precision: str = "fp32",
    extras: dict | None = None,
    **model_overrides,
):
    model = gpt_model_fn(seed, **model_overrides)()
    config = make_config(stage, gas, clip, micro, **(zero or {}))
    if precision != "fp32":  # fp16: a short window, so that the loss scale moves within a test
        config[precision] = {"enabled": True, **({"loss_scale_window": 2} if precision == "fp16" else {})}
    config["zeroshard"]["comm_timeout_s"] = 30
    config["zeroshard"].update(extras or {})
    if scheduler:
        config["scheduler"] = SCHEDULER
    engine, _, _, _ = zeroshard.initialize(model=model, optimizer=optimizer_fn(model.parameters()), config=config)
    return engine


def train_micro_steps(engine, batches, start: int, count: int) -> dict:
    """Micro steps [start, start + count) of a run (step = index // gas, micro = index % gas)."""
    gas, rank = engine.gradient_accumulation_steps(), engine.global_rank
    losses, lrs = [], []
    for index in range(start, start + count):
        inputs, targets = batches(index // gas, index % gas, rank)
        loss = gpt_loss(engine, inputs, targets)
        engine.backward(loss)
        lrs.append(engine.get_lr())
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "lrs": lrs}


def full_params(engine) -> dict[str, torch.Tensor]:
    module = engine.module
    with engine.gathered_parameters(list(module.parameters())):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def tiny_batches(seed: int = 0):
    return gpt_batches(tiny_gpt_config(), batch_size=4, seed=seed)


def assert_equal_params(ours: dict, ref: dict, what: str) -> None:
    assert ours.keys() == ref.keys(), what
    for name in ref:
        difference = (ours[name] - ref[name]).abs().max()
        assert torch.equal(ours[name], ref[name]), f"{what}: '{name}' differs by {difference}"


# ---------------------------------------------------------------- one global batch at any world size
# The same GLOBAL_BATCH samples every step however many ranks share them, so that runs at 2, 3 and 4
# ranks differ only in the order of their gradient sums (tests/test_checkpoint_reshard.py, whose
# docstring says why continued runs are compared with SGD, and test_mics_checkpoint.py).

GLOBAL_BATCH = 12  # divisible by 2, 3 and 4 ranks
RESHARD_RTOL = 1e-6  # relative, per loss and per parameter tensor
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
}


def rank_batch(step: int, rank: int, world: int):
    """This rank's share of the step's global batch (the same samples at any world size)."""
    config = tiny_gpt_config()
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, config.vocab_size, (GLOBAL_BATCH, 1), generator=gen)
    tokens = (start + torch.arange(config.block_size + 1)) % config.vocab_size  # (B, T + 1)
    per = GLOBAL_BATCH // world
    mine = tokens[rank * per : (rank + 1) * per]
    return mine[:, :-1], mine[:, 1:]


def train_global_steps(engine, first_step: int, steps: int) -> dict:
    """Steps [first_step, first_step + steps) of the global batch: each step's loss averaged over the
    ranks, and the full parameters after the last."""
    world, rank = engine.world_size, engine.global_rank
    losses = []
    for step in range(first_step, first_step + steps):
        loss = gpt_loss(engine, *rank_batch(step, rank, world))
        engine.backward(loss)
        engine.step()
        every = engine.comm.all_gather_objects(loss.item(), "test: losses")
        losses.append(sum(every) / world)  # the mean over the global batch
    return {"losses": losses, "params": full_params(engine)}


def assert_close_run(ours: dict, ref: dict, what: str) -> None:
    """Two train_global_steps results within RESHARD_RTOL."""
    for a, b in zip(ours["losses"], ref["losses"]):
        assert abs(a - b) <= RESHARD_RTOL * abs(b), f"{what}: loss {a} vs {b}"
    for name, b in ref["params"].items():
        error = float((ours["params"][name] - b).norm() / b.norm())  # see tests/zs_common.assert_close
        assert error <= RESHARD_RTOL, f"{what}: '{name}' relative error {error:.2e}"


# ---------------------------------------------------------------- a checkpoint's state, read offline


def checkpoint_states(directory) -> dict:
    """Everything a checkpoint says about the training state, by parameter name (read offline)."""
    path, manifest = open_checkpoint(directory)
    objects = torch.load(path / "objects.pt", weights_only=False)
    out = {
        "steps": (manifest["global_steps"], manifest["micro_steps"]),
        "scheduler": objects["lr_scheduler"],
        "param_groups": objects["optimizer"]["param_groups"],
    }
    with CheckpointReader(path, manifest) as reader:
        for index, group in enumerate(manifest["groups"]):
            for param in group["params"]:
                entry = {}
                for key, kind in group["state"] + [["master", "elementwise"]]:
                    if kind == "scalar":
                        entry[key] = objects["optimizer"]["scalars"][index][key][0]
                        continue
                    entry[key] = torch.empty(param["numel"])
                    reader.read_param(param["name"], key, 0, param["numel"], entry[key])
                out[param["name"]] = entry
    return out


def state_difference(a: dict, b: dict) -> str | None:
    """The first difference between two checkpoint_states, or None where they are equal bit for bit."""
    if a.keys() != b.keys():
        return f"different entries: {sorted(a.keys() ^ b.keys())}"
    for name in a:
        if name in ("steps", "scheduler", "param_groups"):
            if a[name] != b[name]:
                return f"{name}: {a[name]} != {b[name]}"
            continue
        if a[name].keys() != b[name].keys():
            return f"'{name}': states {sorted(a[name])} != {sorted(b[name])}"
        for key in a[name]:
            if not torch.equal(torch.as_tensor(a[name][key]), torch.as_tensor(b[name][key])):
                return f"'{name}' {key} differs"
    return None


def check_same_states(engine, saved: str, source: str, what: str) -> None:
    """Rank 0 compares the files; every rank raises (so no rank runs on into a collective alone)."""
    problem = None
    if engine.global_rank == 0:
        problem = state_difference(checkpoint_states(saved), checkpoint_states(source))
    problem = engine.comm.all_gather_objects(problem, "test: state check")[0]
    assert problem is None, f"{what}: {problem}"


def resumes_at_stage_1(directory: str, optimizer_fn, quantized, zero: tuple[dict, dict] = ({}, {})) -> None:
    """Save after 2 steps at stage 3, resume at stage 1: the next 2 steps are those of the run that
    went on, bit for bit, with the same parameters' states quantized (`quantized(engine)`: how many
    this rank holds) as before the save. A block-wise optimizer's checkpoint cases share this.
    `zero`: the zero_optimization keys (offload) of the stage-3 run and of the stage-1 one."""
    batches = gpt_batches(tiny_gpt_config(), batch_size=4)
    build = dict(scheduler=False, optimizer_fn=optimizer_fn)
    straight = build_engine(3, **build, zero=zero[0])
    train_micro_steps(straight, batches, 0, 2)
    straight.save_checkpoint(directory, tag="two")
    held = quantized(straight)
    assert sum(straight.comm.all_gather_objects(held, "test: quantized count")) >= 4, "too few quantized"
    went_on = train_micro_steps(straight, batches, 2, 2)
    params = full_params(straight)
    straight.destroy()
    resumed = build_engine(1, **build, zero=zero[1])
    resumed.load_checkpoint(directory, tag="two")
    assert quantized(resumed) == held
    again = train_micro_steps(resumed, batches, 2, 2)
    assert again["losses"] == went_on["losses"], (again["losses"], went_on["losses"])
    ours = full_params(resumed)
    for key, value in params.items():
        assert torch.equal(ours[key], value), key
    resumed.destroy()


def reloads_unchanged_at_stage_2(directory: str, again: str, optimizer_fn) -> None:
    """`resumes_at_stage_1`'s checkpoint loaded at this world size and stage 2 and saved again into
    `again`: every parameter's state (codes, scales, step) is what was saved."""
    engine = build_engine(2, scheduler=False, optimizer_fn=optimizer_fn)
    engine.load_checkpoint(directory, tag="two")
    engine.save_checkpoint(again, tag="two")
    what = f"2 ranks stage 3 -> {engine.world_size} ranks stage 2"
    check_same_states(engine, f"{again}/two", f"{directory}/two", what)
    engine.destroy()
