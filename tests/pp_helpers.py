"""The tiny model of tests/mesh_models.py trained as a pipeline with `torch.distributed.pipelining`
under zeroshard over a mesh's 'dp' dimension, and the check of a run against the single-process oracle
(tests/test_pipeline.py, whose docstring describes the run, and tests/test_mesh.py with tensor
parallelism inside each stage).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import zeroshard
from tests import mesh_models as mm

STEPS, MICRO, CLIP = 10, 2, 0.05
# torch.distributed.pipelining (and torch._dynamo, which it imports) is imported where a stage is
# built, so that collecting the suite does not import it in every pytest worker.
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def pipeline_step(schedule, pp_rank: int, num_stages: int, step: int, dp_rank: int) -> list[float]:
    """One step: MICRO micro-batches through the schedule; the last stage's losses (unscaled)."""
    pairs = [mm.batches(step, micro, dp_rank) for micro in range(MICRO)]
    inputs = torch.cat([x for x, _ in pairs])  # (MICRO * B, D): the schedule splits it again
    targets = torch.cat([y for _, y in pairs])
    losses: list[torch.Tensor] = []
    if pp_rank == 0:
        schedule.step(inputs)
    elif pp_rank == num_stages - 1:
        schedule.step(target=targets, losses=losses)
    else:
        schedule.step()
    return [float(loss.detach()) * MICRO for loss in losses]


def build_stage(mesh, stage: int, *, blocks: int = 2, tensor_parallel=None):
    """This rank's pipeline stage under zeroshard; `tensor_parallel(part)` parallelizes it first."""
    pp_rank, num_stages = mesh.get_local_rank("pp"), mesh["pp"].size()
    part = mm.Part(mm.model_fn(blocks=blocks)(), pp_rank, num_stages)
    if tensor_parallel is not None:
        part = tensor_parallel(part)
    sharded = zeroshard.shard(
        part,
        mm.adamw(part.parameters()),
        stage=stage,
        mesh=mesh,
        communication=zeroshard.CommunicationPolicy(timeout_s=120),
    )
    sharded.set_gradient_clipping(CLIP)
    from torch.distributed.pipelining import PipelineStage

    pipe = PipelineStage(
        part,
        pp_rank,
        num_stages,
        torch.device("cpu"),
        group=mesh.get_group("pp"),
        input_args=torch.empty(mm.BATCH, mm.D),
    )
    return sharded, pipe


def _loss(output, target):
    # The schedule calls backward on each micro-batch's loss: divide here (scale_grads=False, since
    # zeroshard moves gradients out of .grad as they arrive and torch's rescaling would miss them).
    return F.mse_loss(output, target) / MICRO


def train(mesh, stage: int, schedule_name: str, *, blocks: int = 2, tensor_parallel=None) -> dict:
    from torch.distributed import pipelining

    sharded, pipe = build_stage(mesh, stage, blocks=blocks, tensor_parallel=tensor_parallel)
    schedule = getattr(pipelining, SCHEDULES[schedule_name])(
        pipe, n_microbatches=MICRO, loss_fn=_loss, scale_grads=False
    )
    pp_rank, num_stages, dp_rank = mesh.get_local_rank("pp"), mesh["pp"].size(), mesh.get_local_rank("dp")
    out = {"losses": [], "grad_norms": []}
    for step in range(STEPS):
        with sharded.backward_by_caller():
            losses = pipeline_step(schedule, pp_rank, num_stages, step, dp_rank)
        sharded.step()
        out["losses"].append(losses)
        out["grad_norms"].append(sharded.optimizer.last_grad_norm)
    module = sharded.module
    with sharded.gathered_parameters(list(module.parameters())):
        out["params"] = {n: p.detach().clone() for n, p in module.named_parameters()}
    out["memory"] = sharded.memory_report()
    out["comm"] = sharded.comm_report()
    out["local_params"], out["groups"] = sharded.num_parameters(), len(sharded._groups)
    sharded.destroy()
    return out


def check(mesh, ours: dict, ref: dict, what: str) -> None:
    if mesh.get_local_rank("dp") == 0 and mesh.get_local_rank("pp") == mesh["pp"].size() - 1:
        mm.assert_losses_close(ours["losses"], ref["losses"], what=what)
    for step, (a, b) in enumerate(zip(ours["grad_norms"], ref["grad_norms"])):
        assert abs(a - b) <= 1e-5 * b, f"{what}: gradient norm of step {step}: {a} vs {b}"
    mm.assert_rel_close(ours["params"], ref["params"], what=what)
