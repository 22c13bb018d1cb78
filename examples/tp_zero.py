"""ZeRO over the data-parallel dimension, tensor parallelism (DTensor) over the other.

    torchrun --nproc_per_node 4 examples/tp_zero.py               # dp 2 x tp 2, ZeRO stage 2
    torchrun --nproc_per_node 4 examples/tp_zero.py --stage 3 --tp 4

The model is parallelized first, as torch does it (`parallelize_module`: column-parallel `up`,
row-parallel `down`); `zeroshard.initialize(mesh=...)` then shards each rank's local tensor-parallel
slice over 'dp'. Every rank of a dp group reads its own data; the ranks of a tp group read the same.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import zeroshard


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):  # (B, width) -> (B, width)
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step: int, dp_rank: int, width: int, teacher: torch.Tensor, device):
    """A learnable task: y = tanh(x @ teacher), the same teacher everywhere, data per dp rank."""
    gen = torch.Generator().manual_seed(step * 1009 + dp_rank)
    x = torch.randn(16, width, generator=gen)
    return x.to(device), torch.tanh(x @ teacher).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (the rest is dp)")
    args = parser.parse_args()

    zeroshard.init_distributed()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    world = dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the {world} ranks")
    mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))

    torch.manual_seed(0)
    width = 32
    model = MLP(width).to(device)
    plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.up"], plan[f"blocks.{i}.down"] = ColwiseParallel(), RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    teacher = torch.randn(width, width, generator=torch.Generator().manual_seed(1)) / width**0.5

    config = {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": args.stage},
    }
    engine, *_ = zeroshard.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3), mesh=mesh, config=config
    )
    dp_rank = mesh.get_local_rank("dp")
    for step in range(args.steps):
        inputs, targets = batch(step, dp_rank, width, teacher, device)
        loss = F.mse_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        if dist.get_rank() == 0:
            print(f"step {step:3d} loss {loss.item():.4f} grad_norm {engine.get_global_grad_norm():.4f}")
    if dist.get_rank() == 0:
        print(
            f"model states on rank 0: {engine.memory_report()['total']} bytes "
            f"(dp {mesh['dp'].size()} x tp {mesh['tp'].size()}, stage {args.stage})"
        )
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
