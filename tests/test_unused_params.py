"""Parameters that get no gradient are left alone, exactly as DDP and torch do.

A mixture-of-experts model routes each token to one of four experts per block by its id, and a
small adapter runs only on even steps. The data of each (step, micro step, rank) uses only some
experts, so in some steps an expert gets tokens on both ranks, on one rank only, or on none, and
one expert gets its first token only at step 3. Torch's meaning (DDP find_unused_parameters=True,
torch AdamW with weight decay): a parameter no rank used keeps its value, its optimizer state and
its step count; one used on some ranks is averaged over all ranks. Checked bit for bit at 2 ranks,
for stages 0-3, with and without offload (cpu, nvme with sub-groups that cut parameters apart),
with and without gradient accumulation: against DDP itself (accumulation steps 1) and, with 2
accumulation steps, against the single-process emulation of 2 ranks that leaves `.grad` None where
no rank had one (tests/reference.train_single for stages 0/1, which reduce once per step; for
stages 2/3, which reduce every micro step, the same with a reduction per micro step). A checkpoint
taken when parameters' step counts differ resumes bit for bit, also after a trip through 1 rank
and another stage (load there, save again, load back at 2 ranks).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import zeroshard
from tests.harness import run_distributed, subtests
from tests.reference import _train, train_single
from tests.zs_common import assert_close, make_config

VOCAB, WIDTH, EXPERTS, STEPS = 32, 16, 4, 6
# experts whose tokens appear, per (step, micro step, rank): expert e gets token ids t with t % 4 == e
ROUTES = {
    (0, 0, 0): (0, 1),
    (0, 0, 1): (0, 2),
    (0, 1, 0): (1,),
    (0, 1, 1): (0,),  # 3 never
    (1, 0, 0): (0, 1, 2),
    (1, 0, 1): (1, 2),
    (1, 1, 0): (2,),
    (1, 1, 1): (0, 2),
    (2, 0, 0): (1,),
    (2, 0, 1): (1,),
    (2, 1, 0): (1,),
    (2, 1, 1): (1,),  # only expert 1
    (3, 0, 0): (0, 3),
    (3, 0, 1): (2,),
    (3, 1, 0): (3,),
    (3, 1, 1): (2,),  # 3's first tokens
}


def _experts(step: int, micro: int, rank: int) -> tuple[int, ...]:
    return ROUTES.get((step, micro, rank), tuple(range(EXPERTS)))


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, 2 * WIDTH)
        self.proj = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):  # (N, C) -> (N, C)
        return self.proj(F.gelu(self.fc(x)))


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x, route):  # (B, T, C), (B, T) expert per token
        h = self.ln(x)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            chosen = route == index
            if bool(chosen.any()):  # an expert no token chose is not called: its parameters get no gradient
                out[chosen] = expert(h[chosen])
        return x + out


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(2))
        self.adapter = nn.Linear(WIDTH, WIDTH)  # used on even steps only
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx, targets, adapter):
        route = idx % EXPERTS
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h, route)
        if bool(adapter):
            h = h + self.adapter(h)
        logits = self.head(self.ln_f(h))  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _build():
    torch.manual_seed(0)
    return MoE()


def _batches(step: int, micro: int, rank: int):
    gen = torch.Generator().manual_seed(step * 131 + micro * 17 + rank)
    experts = torch.tensor(_experts(step, micro, rank))
    chosen = experts[torch.randint(0, len(experts), (4, 8), generator=gen)]  # (B, T)
    idx = chosen + EXPERTS * torch.randint(0, VOCAB // EXPERTS, (4, 8), generator=gen)
    targets = torch.randint(0, VOCAB, (4, 8), generator=gen)
    return (idx, torch.tensor(step % 2 == 0)), targets


def _loss(model, inputs, targets):
    idx, adapter = inputs
    return model(idx, targets, adapter)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _ddp_oracle() -> dict:
    """DDP with find_unused_parameters=True, accumulation steps 1, in this process group."""
    ddp = DistributedDataParallel(_build(), find_unused_parameters=True)
    rank = dist.get_rank()

    def step_grads(step: int) -> list[float]:
        loss = _loss(ddp, *_batches(step, 0, rank))
        loss.backward()
        return [loss.item()]

    return _train(ddp.module, step_grads, _adamw, None, STEPS, 0.0, True, False)


def _reduce_every_micro_step_oracle(gas: int) -> dict:
    """Stages 2/3 reduce each micro step: the sum over micro steps of each one's rank average (2
    emulated ranks, each gradient times 1/2, rank order), `.grad` None where no rank had one in
    any micro step (tests/reference.train_single's reduce_every_micro_step fills in zeros)."""
    model = _build()
    params = list(model.parameters())

    def rank_grads(step, micro, rank):
        model.zero_grad(set_to_none=True)
        loss = _loss(model, *_batches(step, micro, rank))
        (loss / gas).backward()
        return loss.item(), [p.grad for p in params]

    def add(a, b):
        return b if a is None else a if b is None else a + b

    def step_grads(step):
        losses, acc = [], [None] * len(params)
        for micro in range(gas):
            per_rank = [rank_grads(step, micro, rank) for rank in range(2)]
            losses.append(per_rank[0][0])
            for i in range(len(params)):
                halves = [g[i] * 0.5 for _, g in per_rank if g[i] is not None]
                reduced = halves[0] + halves[1] if len(halves) == 2 else (halves[0] if halves else None)
                acc[i] = add(acc[i], reduced)
        for p, g in zip(params, acc):
            p.grad = g
        return losses

    return _train(model, step_grads, _adamw, None, STEPS, 0.0, True, False)


def _config(stage: int, offload: str | None, gas: int, nvme: str) -> dict:
    zero = {}
    if offload:
        zero = {"offload_optimizer": {"device": offload, "nvme_path": nvme}, "sub_group_size": 500}
    config = make_config(stage, gas, **zero)
    config["zeroshard"]["wrap_modules"] = ["MoEBlock"]  # experts stay inside their block's unit
    return config


def _engine(stage, offload, gas, nvme):
    model = _build()
    engine, *_ = zeroshard.initialize(
        model=model, optimizer=_adamw(model.parameters()), config=_config(stage, offload, gas, nvme)
    )
    return engine


def _train_engine(engine, first: int, steps: int) -> dict:
    rank, gas = engine.global_rank, engine.gradient_accumulation_steps()
    out = {"losses": [], "params_per_step": []}
    for step in range(first, first + steps):
        losses = []
        for micro in range(gas):
            loss = _loss(engine, *_batches(step, micro, rank))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out["losses"].append(losses)
        out["params_per_step"].append(_full(engine))
    out["params"] = _full(engine)
    return out


def _full(engine) -> dict:
    with engine.gathered_parameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _case(stage, offload, gas, nvme, oracles) -> None:
    engine = _engine(stage, offload, gas, nvme)
    ours = _train_engine(engine, 0, STEPS)
    engine.destroy()
    ref = oracles[gas if stage < 2 or gas == 1 else "reduce every micro step"]
    if gas > 1 and dist.get_rank() != 0:  # train_single reports rank 0's losses
        ours["losses"] = ref["losses"]
    assert_close(ours, ref, exact=True, what=f"stage {stage} offload {offload} accumulation {gas}")


def _resume_case(stage, offload, nvme, root) -> dict:
    """Save at step 3, when experts' and the adapter's step counts differ; resume: bit for bit."""
    straight = _engine(stage, offload, 1, nvme)
    reference = _train_engine(straight, 0, STEPS)
    straight.destroy()
    half = _engine(stage, offload, 1, nvme)
    _train_engine(half, 0, 3)
    assert not all(half.optimizer.slot_states.is_uniform(g) for g in half.optimizer.groups), "step counts differ"
    half.save_checkpoint(f"{root}/s{stage}-{offload}", tag="t")
    half.destroy()
    _check_resume(stage, offload, nvme, f"{root}/s{stage}-{offload}", reference)
    return reference


def _check_resume(stage, offload, nvme, directory, reference) -> None:
    resumed = _engine(stage, offload, 1, nvme)
    resumed.load_checkpoint(directory)
    rest = _train_engine(resumed, 3, STEPS - 3)
    resumed.destroy()
    assert rest["losses"] == reference["losses"][3:], (rest["losses"], reference["losses"][3:])
    for name, value in reference["params"].items():
        assert torch.equal(rest["params"][name], value), f"'{name}' differs after resume"


RESUME_SETTINGS = [dict(stage=1, offload=None), dict(stage=3, offload=None), dict(stage=2, offload="cpu")]


def _resume_worker(rank: int, world: int, *, root: str) -> list:
    nvme = os.path.join(root, f"nvme{rank}")
    return subtests([dict(s, nvme=nvme, root=root) for s in RESUME_SETTINGS], _resume_case)


def _one_rank_worker(rank: int, world: int, *, root: str) -> None:
    """At 1 rank, another stage: load each 2-rank checkpoint, save it again."""

    def case(stage, offload):
        engine = _engine(3 if stage < 3 else 1, None, 1, os.path.join(root, "nvme-one"))
        engine.load_checkpoint(f"{root}/s{stage}-{offload}")
        engine.save_checkpoint(f"{root}/via-one-s{stage}-{offload}", tag="t")
        engine.destroy()

    subtests(RESUME_SETTINGS, case)


def _back_worker(rank: int, world: int, *, root: str, references: list) -> None:
    nvme = os.path.join(root, f"nvme{rank}")
    subtests(
        [
            dict(s, nvme=nvme, directory=f"{root}/via-one-s{s['stage']}-{s['offload']}", reference=r)
            for s, r in zip(RESUME_SETTINGS, references[rank])
        ],
        _check_resume,
    )


@pytest.mark.slow
def test_unused_state_resumes_and_reshards(tmp_path):
    """2 ranks -> resume; 2 ranks -> 1 rank (another stage) -> 2 ranks -> resume: bit for bit."""
    root = str(tmp_path)
    references = run_distributed(_resume_worker, 2, timeout=600, root=root)
    run_distributed(_one_rank_worker, 1, timeout=600, root=root)
    run_distributed(_back_worker, 2, timeout=600, root=root, references=references)


SETTINGS = [
    dict(stage=0, offload=None),
    dict(stage=1, offload=None),
    dict(stage=2, offload=None),
    dict(stage=3, offload=None),
    dict(stage=1, offload="cpu"),
    dict(stage=2, offload="nvme"),
    dict(stage=3, offload="cpu"),
]


def _worker(rank: int, world: int, *, root: str) -> dict:
    nvme = os.path.join(root, f"nvme{rank}")
    ddp = _ddp_oracle()
    single = train_single(
        _build, _batches, optimizer_fn=_adamw, steps=STEPS, world_size=2, loss_fn=_loss, record_params=True
    )
    assert_close(
        single if rank == 0 else {**single, "losses": ddp["losses"]}, ddp, exact=True, what="the emulation against DDP"
    )
    accumulated = train_single(
        _build,
        _batches,
        optimizer_fn=_adamw,
        steps=STEPS,
        grad_accum=2,
        world_size=2,
        loss_fn=_loss,
        record_params=True,
    )
    oracles = {1: ddp, 2: accumulated, "reduce every micro step": _reduce_every_micro_step_oracle(2)}
    subtests([dict(s, gas=g, nvme=nvme, oracles=oracles) for s in SETTINGS for g in (1, 2)], _case)
    # The adapter skipped odd steps: DDP's AdamW stepped it STEPS // 2 times, not STEPS.
    return {
        "adapter moved at odd steps": not torch.equal(
            ddp["params_per_step"][1]["adapter.weight"], ddp["params_per_step"][0]["adapter.weight"]
        )
    }


def test_unused_parameters_match_ddp(tmp_path):
    reports = run_distributed(_worker, 2, timeout=900, root=str(tmp_path))
    assert reports[0] == {"adapter moved at odd steps": False}
