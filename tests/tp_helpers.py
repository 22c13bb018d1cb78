"""The tiny model of tests/mesh_models.py under tensor parallelism over a mesh's 'tp' dimension, two ways,
and each layout's full parameters gathered back (tests/test_tensor_parallel.py, test_mesh.py and
test_checkpoint_3d.py train and checkpoint them):

* DTensor: `parallelize_module` (ColwiseParallel `up`, RowwiseParallel `down`);
* Megatron-style: plain tensors, hand-written column/row parallel linears that mark their sharded
  parameters `tensor_model_parallel`, and an `mpu` object over the (dp, tp) mesh.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests import mesh_models as mm

# ---------------------------------------------------------------- Megatron-style tensor parallelism


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input gradient over tp."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward over tp, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnLinear(nn.Module):
    def __init__(self, full: nn.Linear, rank: int, size: int, group):
        super().__init__()
        rows = full.out_features // size
        self.weight = nn.Parameter(full.weight.detach()[rank * rows : (rank + 1) * rows].clone())
        self.bias = nn.Parameter(full.bias.detach()[rank * rows : (rank + 1) * rows].clone())
        for p in (self.weight, self.bias):
            p.tensor_model_parallel = True  # Megatron's flag, set by the model, read by zeroshard
        self.group = group

    def forward(self, x):
        return F.linear(_CopyToTP.apply(x, self.group), self.weight, self.bias)


class RowLinear(nn.Module):
    def __init__(self, full: nn.Linear, rank: int, size: int, group):
        super().__init__()
        cols = full.in_features // size
        self.weight = nn.Parameter(full.weight.detach()[:, rank * cols : (rank + 1) * cols].clone())
        self.weight.tensor_model_parallel = True
        self.bias = nn.Parameter(full.bias.detach().clone())  # replicated over tp
        self.group = group

    def forward(self, x):
        return _ReduceFromTP.apply(F.linear(x, self.weight), self.group) + self.bias


class Mpu:
    """DeepSpeed/Megatron's mpu interface over a (dp, tp) DeviceMesh."""

    def __init__(self, mesh):
        self.mesh = mesh

    def get_data_parallel_group(self):
        return self.mesh.get_group("dp")

    def get_data_parallel_rank(self):
        return self.mesh.get_local_rank("dp")

    def get_data_parallel_world_size(self):
        return self.mesh["dp"].size()

    def get_tensor_model_parallel_group(self):
        return self.mesh.get_group("tp")

    def get_tensor_model_parallel_rank(self):
        return self.mesh.get_local_rank("tp")

    def get_tensor_model_parallel_world_size(self):
        return self.mesh["tp"].size()


def megatron_model(mesh):
    model = mm.model_fn()()
    rank, size, group = mesh.get_local_rank("tp"), mesh["tp"].size(), mesh.get_group("tp")
    for block in model.blocks:
        block.up = ColumnLinear(block.up, rank, size, group)
        block.down = RowLinear(block.down, rank, size, group)
    return model


def megatron_full(model, mesh) -> dict:
    """Full parameters of a Megatron-style model: slices all-gathered over tp and concatenated."""
    size, group, out = mesh["tp"].size(), mesh.get_group("tp"), {}
    for name, param in model.named_parameters():
        value = param.detach().clone()
        if getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(value) for _ in range(size)]
            dist.all_gather(parts, value, group=group)
            value = torch.cat(parts, dim=1 if name.endswith("down.weight") else 0)
        out[name] = value
    return out


# ---------------------------------------------------------------- DTensor tensor parallelism


def dtensor_model(mesh):
    model = mm.model_fn()()
    plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    return parallelize_module(model, mesh["tp"], plan)


def dtensor_full(model) -> dict:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
