"""ZeRO over 'dp' of a dp2 x pp2 mesh with `torch.distributed.pipelining`, against one process.

Each pp rank holds one `PipelineStage` (tests.mesh_models.Part) under `zeroshard.shard(..., mesh=)`;
the schedule (GPipe or 1F1B) runs the micro-batches, which are the gradient-accumulation steps, inside
`Sharded.backward_by_caller()`. Stages 1-3, clipping that bites, 10 steps: losses (last stage),
gradient norms (global over both stages) and every stage's final parameters within 1e-5 relative of
`train_single` over the dp ranks. (Stage 3 holds parity; inside a schedule step it keeps a stage's
units gathered, see `backward_by_caller`.)
"""

from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh

from tests import mesh_models as mm
from tests.harness import grid, run_distributed, subtests
from tests.pp_helpers import CLIP, MICRO, STEPS, check, train


def _case(mesh, ref, stage: int, schedule: str) -> dict:
    ours = train(mesh, stage, schedule)
    check(mesh, ours, ref, f"dp2 x pp2 {schedule} stage {stage}")
    return {"memory": ours["memory"], "comm": ours["comm"]}


def _worker(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    ref = mm.reference(2, steps=STEPS, gas=MICRO, clip=CLIP)
    assert ref["grad_norms"][0] > CLIP, "the test's clipping must bite"
    return subtests(
        grid(stage=[1, 2, 3], schedule=["gpipe", "1f1b"]), lambda stage, schedule: _case(mesh, ref, stage, schedule)
    )


def test_dp2_pp2_matches_single_process():
    per_rank = run_distributed(_worker, 4, timeout=600)
    assert len(per_rank) == 4


@pytest.mark.slow
def test_example_pp_zero_runs_on_four_ranks():
    losses = mm.run_example("pp_zero.py", "--steps", "20")
    assert len(losses) == 20 and losses[-1] < 0.7 * losses[0], losses
