"""`zeroshard.shard()`, the composable core without an engine or a config, against DDP.

The same oracle as tests/test_parity.py: bit-for-bit at 2 ranks in fp32, for every stage, with
gradient accumulation and clipping, through `backward(loss, boundary=...)` and through a plain
`loss.backward()` with `set_requires_gradient_sync`, with the offload policies (`CPUOffload`,
`NVMeOffload`), which work out their stores from the rank alone; plus the shard-local `state_dict()`
round trip, and the policies' checks.
The README's example runs as written in tests/test_doc_blocks.py.
"""

from __future__ import annotations

import tempfile

import pytest

import zeroshard
from tests.harness import run_distributed, subtests
from tests.reference import gpt_batches, gpt_loss, train_ddp
from tests.zs_common import adamw, assert_close, gpt_model_fn
from zeroshard.tools.models.gpt import tiny_gpt_config

STEPS = 6


def _gathered(sharded) -> dict:
    module = sharded.module
    with sharded.gathered_parameters(list(module.parameters())):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def train_sharded(
    model_fn,
    batches,
    *,
    stage: int,
    gas: int,
    clip: float,
    steps: int,
    torch_backward: bool = False,
    offload=None,
) -> dict:
    model = model_fn()
    sharded = zeroshard.shard(
        model,
        adamw(model.parameters()),
        stage=stage,
        offload=offload,
        gathering=zeroshard.GatheringPolicy(persistence_threshold=0),
        communication=zeroshard.CommunicationPolicy(timeout_s=60),
    )
    sharded.set_gradient_clipping(clip)
    rank = sharded.comm.rank
    out = {"losses": [], "params_per_step": []}
    for step in range(steps):
        losses = []
        for micro in range(gas):
            loss = gpt_loss(sharded, *batches(step, micro, rank))
            if torch_backward:  # a torch loop: only the last micro-batch reduces (DDP's no_sync before)
                sharded.set_requires_gradient_sync(micro == gas - 1)
                (loss / gas).backward()
            else:
                sharded.backward(loss / gas, boundary=micro == gas - 1)
            losses.append(loss.item())
        sharded.step()
        out["losses"].append(losses)
        out["params_per_step"].append(_gathered(sharded))
    out["params"] = _gathered(sharded)
    sharded.destroy()
    return out


def _parity_case(stage: int, gas: int, clip: float, torch_backward: bool = False, offload: str = "") -> dict:
    batches = gpt_batches(tiny_gpt_config(), batch_size=4)
    ref = train_ddp(
        gpt_model_fn(),
        batches,
        optimizer_fn=adamw,
        steps=STEPS,
        grad_accum=gas,
        clip=clip,
        reduce_every_micro_step=stage >= 2,
        record_params=True,
    )
    with tempfile.TemporaryDirectory() as nvme:
        policy = {
            "": None,
            "cpu": zeroshard.CPUOffload(params=stage == 3),
            "nvme": zeroshard.NVMeOffload(nvme, params=stage == 3),
        }[offload]
        ours = train_sharded(
            gpt_model_fn(),
            batches,
            stage=stage,
            gas=gas,
            clip=clip,
            steps=STEPS,
            torch_backward=torch_backward,
            offload=policy,
        )
    what = f"shard() stage {stage} gas {gas} clip {clip}{' loss.backward()' * torch_backward} offload {policy}"
    assert_close(ours, ref, exact=True, what=what)
    return {"stage": stage, "final_loss": ours["losses"][-1][-1]}


def _state_round_trip(stage: int) -> dict:
    """state_dict() of step 3 loaded into a fresh Sharded gives the same steps 4-5 as going on."""
    batches = gpt_batches(tiny_gpt_config(), batch_size=4)

    def build():
        model = gpt_model_fn()()
        return zeroshard.shard(
            model, adamw(model.parameters()), stage=stage, gathering=zeroshard.GatheringPolicy(persistence_threshold=0)
        )

    def run(sharded, steps):
        losses = []
        for step in steps:
            loss = gpt_loss(sharded, *batches(step, 0, sharded.comm.rank))
            sharded.backward(loss)
            sharded.step()
            losses.append(loss.item())
        return losses

    straight = build()
    run(straight, range(3))
    saved = straight.state_dict()
    expected = run(straight, range(3, 5))
    resumed = build()
    resumed.load_state_dict(saved)
    got = run(resumed, range(3, 5))
    assert got == expected, (stage, got, expected)
    with pytest.raises(ValueError, match="another layout"):
        resumed.load_state_dict({**saved, "masters": saved["masters"][:-1]})
    straight.destroy()
    resumed.destroy()
    return {"stage": stage, "losses": got}


def _worker(rank: int, world: int) -> dict:
    cases = [dict(stage=s, gas=g, clip=c) for s in range(4) for g, c in ((1, 0.0), (2, 0.05))]
    cases += [dict(stage=s, gas=2, clip=0.05, torch_backward=True) for s in range(4)]
    cases += [dict(stage=s, gas=2, clip=0.05, offload=o) for s in (2, 3) for o in ("cpu", "nvme")]
    return {
        "parity": subtests(cases, _parity_case),
        "state": subtests([dict(stage=s) for s in range(4)], _state_round_trip),
    }


def test_shard_matches_ddp_and_round_trips_its_state():
    run_distributed(_worker, 2, timeout=600)


def test_policies_are_checked_when_made_and_passed():
    """Each policy names its field, the value and what is allowed; shard() names the keyword a value
    of the wrong kind was passed to, before it touches the model or the process group."""
    with pytest.raises(ValueError, match=r"NVMeOffload.path=''"):
        zeroshard.NVMeOffload("")
    with pytest.raises(ValueError, match="offloads nothing"):
        zeroshard.NVMeOffload("/tmp", optimizer=False, params=False)
    with pytest.raises(ValueError, match=r"CPUOffload.params='yes': True or False"):
        zeroshard.CPUOffload(params="yes")
    with pytest.raises(ValueError, match=r"NVMeOffload.threads=0: an int >= 1"):
        zeroshard.NVMeOffload("/tmp", threads=0)
    with pytest.raises(ValueError, match=r"CommunicationPolicy.timeout_s=0"):
        zeroshard.CommunicationPolicy(timeout_s=0)
    model = gpt_model_fn()()
    with pytest.raises(TypeError, match=r"shard\(offload='cpu'\): zeroshard.CPUOffload\(\)"):
        zeroshard.shard(model, offload="cpu")
    with pytest.raises(TypeError, match=r"shard\(gathering=.*a zeroshard.GatheringPolicy"):
        zeroshard.shard(model, gathering=zeroshard.CommunicationPolicy())


def test_offload_policy_refuses_parameters_below_stage_3():
    """CPUOffload(params=True) at stage 2 would place parameter shards that do not exist."""
    from zeroshard.core.placement import OffloadContext

    context = OffloadContext(rank=0, world_size=2, model_numel=10, optimizer=None, shards_parameters=False)
    with pytest.raises(ValueError, match=r"CPUOffload\(params=True\) places stage 3's parameter shards"):
        zeroshard.CPUOffload(params=True).build(context)
    placement = zeroshard.CPUOffload().build(context)  # inference: no optimizer, nothing to place
    assert placement.optimizer_store is None and placement.param_store is None
