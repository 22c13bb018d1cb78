"""ZeRO over 'dp' of a dp2 x tp2 mesh, with tensor parallelism two ways, against one process.

* DTensor: `parallelize_module` (ColwiseParallel `up`, RowwiseParallel `down`) before `shard()`;
  zeroshard flattens each parameter's local tensor and keeps the module's parameters DTensors.
* Megatron-style: plain tensors, hand-written column/row parallel linears (tests/tp_helpers.py) that
  mark their sharded parameters `tensor_model_parallel`, and an `mpu` object.
Both at stages 1-3 with gradient accumulation and clipping that bites, 10 steps: losses, gradient
norms and final parameters within 1e-5 relative of `train_single` over the dp ranks (tensor
parallelism sums in another order, so not bitwise). Four gloo ranks, one process group.
"""

from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import zeroshard
from tests import mesh_models as mm
from tests.harness import grid, run_distributed, subtests
from tests.tp_helpers import Mpu, dtensor_full, dtensor_model, megatron_full, megatron_model
from zeroshard.core.mesh import from_mpu

STEPS, GAS, CLIP = 10, 2, 0.05


def train(mesh, layout: str, stage: int) -> dict:
    if layout == "dtensor":
        model = dtensor_model(mesh)
        sharded = zeroshard.shard(
            model,
            mm.adamw(model.parameters()),
            stage=stage,
            mesh=mesh,
            communication=zeroshard.CommunicationPolicy(timeout_s=120),
        )
    else:
        model = megatron_model(mesh)
        sharded = zeroshard.shard(
            model,
            mm.adamw(model.parameters()),
            stage=stage,
            mesh=from_mpu(Mpu(mesh), model),
            communication=zeroshard.CommunicationPolicy(timeout_s=120),
        )
    sharded.set_gradient_clipping(CLIP)
    dp_rank = mesh.get_local_rank("dp")
    out = {"losses": [], "grad_norms": []}
    for step in range(STEPS):
        losses = []
        for micro in range(GAS):
            loss = mm.mse(sharded, *mm.batches(step, micro, dp_rank))
            sharded.backward(loss / GAS, boundary=micro == GAS - 1)
            losses.append(loss.item())
        sharded.step()
        out["losses"].append(losses)
        out["grad_norms"].append(sharded.optimizer.last_grad_norm)
    module = sharded.module
    with sharded.gathered_parameters(list(module.parameters())):
        if layout == "dtensor":
            assert all(isinstance(module.blocks[0].up.weight, DTensor) for _ in [0]), "DTensor parameters lost"
            out["params"] = dtensor_full(module)
        else:
            out["params"] = megatron_full(module, mesh)
    out["memory"] = sharded.memory_report()
    out["comm"] = sharded.comm_report()
    sharded.destroy()
    return out


def _case(mesh, ref, layout: str, stage: int) -> dict:
    ours = train(mesh, layout, stage)
    what = f"dp2 x tp2 {layout} stage {stage}"
    if mesh.get_local_rank("dp") == 0:
        mm.assert_losses_close(ours["losses"], ref["losses"], what=what)
    for step, (a, b) in enumerate(zip(ours["grad_norms"], ref["grad_norms"])):
        assert abs(a - b) <= 1e-5 * b, f"{what}: gradient norm of step {step}: {a} vs {b}"
    mm.assert_rel_close(ours["params"], ref["params"], what=what)
    return {"memory": ours["memory"], "comm": ours["comm"]}


def _worker(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref = mm.reference(2, steps=STEPS, gas=GAS, clip=CLIP)
    assert ref["grad_norms"][0] > CLIP, "the test's clipping must bite"
    cases = grid(layout=["dtensor", "megatron"], stage=[1, 2, 3])
    return subtests(cases, lambda layout, stage: _case(mesh, ref, layout, stage))


@pytest.mark.slow
def test_dp2_tp2_matches_single_process():
    per_rank = run_distributed(_worker, 4, timeout=600)
    assert len(per_rank) == 4


@pytest.mark.slow
def test_example_tp_zero_runs_on_four_ranks():
    losses = mm.run_example("tp_zero.py", "--steps", "20", "--stage", "3")
    assert len(losses) == 20 and losses[-1] < 0.7 * losses[0], losses
