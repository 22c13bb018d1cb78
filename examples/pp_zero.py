"""ZeRO over the data-parallel dimension, pipeline parallelism (torch.distributed.pipelining) over the other.

    torchrun --nproc_per_node 4 examples/pp_zero.py                          # dp 2 x pp 2, stage 2, 1F1B
    torchrun --nproc_per_node 4 examples/pp_zero.py --schedule gpipe --stage 1

Each pp rank builds its stage of the model, `zeroshard.shard(..., mesh=...)` shards it over 'dp', and a
`PipelineStage` runs it. The schedule runs forward and backward of every micro-batch itself, so the
step goes inside `sharded.backward_by_caller()`: the micro-batches are the gradient accumulation.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import zeroshard

WIDTH, DEPTH, MICRO, BATCH = 32, 4, 4, 16
SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):  # (B, WIDTH) -> (B, WIDTH)
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Stage(nn.Module):
    """Blocks [first, last) of the model, and the head on the last stage."""

    def __init__(self, first: int, last: int, head: bool):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(first, last))
        self.head = nn.Linear(WIDTH, WIDTH) if head else None

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def loss_fn(output, target):
    # scale_grads=False below: zeroshard takes gradients out of .grad as they arrive, so the
    # micro-batch average is taken here.
    return F.mse_loss(output, target) / MICRO


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (the rest is dp)")
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    args = parser.parse_args()

    zeroshard.init_distributed()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    world = dist.get_world_size()
    if world % args.pp or DEPTH % args.pp:
        raise SystemExit(f"--pp {args.pp} must divide the {world} ranks and the {DEPTH} blocks")
    mesh = init_device_mesh(device.type, (world // args.pp, args.pp), mesh_dim_names=("dp", "pp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    last = pp_rank == args.pp - 1

    torch.manual_seed(pp_rank)  # each stage its own layers; zeroshard broadcasts within 'dp'
    per = DEPTH // args.pp
    part = Stage(pp_rank * per, (pp_rank + 1) * per, head=last).to(device)
    sharded = zeroshard.shard(part, torch.optim.AdamW(part.parameters(), lr=3e-3), stage=args.stage, mesh=mesh)
    sharded.set_gradient_clipping(1.0)
    pipe = PipelineStage(
        part,
        pp_rank,
        args.pp,
        device,
        group=mesh.get_group("pp"),
        input_args=torch.empty(BATCH // MICRO, WIDTH, device=device),
    )
    schedule = SCHEDULES[args.schedule](pipe, n_microbatches=MICRO, loss_fn=loss_fn, scale_grads=False)
    teacher = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(1)) / WIDTH**0.5

    for step in range(args.steps):
        gen = torch.Generator().manual_seed(step * 1009 + dp_rank)  # data per dp rank
        inputs = torch.randn(BATCH, WIDTH, generator=gen)
        targets = torch.tanh(inputs @ teacher)
        losses = []
        with sharded.backward_by_caller():
            if pp_rank == 0:
                schedule.step(inputs.to(device))
            elif last:
                schedule.step(target=targets.to(device), losses=losses)
            else:
                schedule.step()
        sharded.step()
        if last and dp_rank == 0:
            loss = sum(float(x.detach()) for x in losses)  # each is a micro-batch's loss / MICRO
            print(f"step {step:3d} loss {loss:.4f} grad_norm {sharded.optimizer.last_grad_norm:.4f}", flush=True)
    sharded.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
