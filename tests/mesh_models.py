"""A tiny model, its data and its single-process oracle for ZeRO inside tensor and pipeline parallelism
(tests/test_mesh.py, test_tensor_parallel.py, test_pipeline.py).

The model has what 3D parallelism cares about: per block a LayerNorm (replicated under tensor
parallelism), a column-parallel `up` and a row-parallel `down` linear (whose bias is replicated), and
a head. The oracle is `tests.reference.train_single` with `world_size` = the dp degree: the same math
as DDP over the data-parallel ranks, on the whole model in one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.reference import train_single

D, H, OUT, BATCH = 8, 16, 4, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x):  # (B, D) -> (B, D)
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyNet(nn.Module):
    def __init__(self, blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(D, OUT)

    def forward(self, x):  # (B, D) -> (B, OUT)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Part(nn.Module):
    """Pipeline stage `index` of `num_stages` of a TinyNet: its share of blocks, and the head on the
    last stage. Parameter names are the full model's (blocks.<i>...), so results compare by name."""

    def __init__(self, model: TinyNet, index: int, num_stages: int):
        super().__init__()
        per = len(model.blocks) // num_stages
        mine = range(index * per, (index + 1) * per)
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in mine})
        self.head = model.head if index == num_stages - 1 else None

    def forward(self, x):
        for block in self.blocks.values():
            x = block(x)
        return self.head(x) if self.head is not None else x


def model_fn(seed: int = 0, blocks: int = 2):
    def build():
        torch.manual_seed(seed)
        return TinyNet(blocks)

    return build


def batches(step: int, micro: int, rank: int):
    gen = torch.Generator().manual_seed((step * 1009 + micro) * 1009 + rank)
    return torch.randn(BATCH, D, generator=gen), torch.randn(BATCH, OUT, generator=gen)


def mse(model, inputs, targets) -> torch.Tensor:
    return F.mse_loss(model(inputs), targets)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def reference(dp: int, *, steps: int, gas: int, clip: float, blocks: int = 2) -> dict:
    return train_single(
        model_fn(blocks=blocks),
        batches,
        optimizer_fn=adamw,
        steps=steps,
        grad_accum=gas,
        clip=clip,
        world_size=dp,
        loss_fn=mse,
    )


def assert_rel_close(ours: dict, ref: dict, *, rtol: float = 1e-5, what: str = "") -> None:
    """Parameters by name (ours may be a subset: one pipeline stage) within `rtol` relative to the
    reference's largest magnitude of that tensor."""
    assert ours, f"{what}: no parameters to compare"
    for name, value in ours.items():
        expected = ref[name]
        scale = expected.abs().max().clamp_min(1e-12)
        err = float((value - expected).abs().max() / scale)
        assert err <= rtol, f"{what}: parameter {name} differs by {err:.3g} relative (allowed {rtol:g})"


def assert_losses_close(ours: list, ref: list, *, rtol: float = 1e-5, what: str = "") -> None:
    for step, (a, b) in enumerate(zip(ours, ref)):
        for micro, (x, y) in enumerate(zip(a, b)):
            assert abs(x - y) <= rtol * max(abs(y), 1e-12), f"{what}: loss of step {step} micro {micro}: {x} vs {y}"
    assert len(ours) == len(ref), (len(ours), len(ref))


def run_example(script: str, *args: str, nproc: int = 4) -> list[float]:
    """Run examples/<script> on `nproc` ranks as torchrun starts it (tests.harness.run_script); the
    losses it printed. The example destroys its process group at the end, which retires the ranks."""
    import re
    from pathlib import Path

    from tests.harness import run_script

    root = Path(__file__).resolve().parent.parent
    outputs = run_script(root / "examples" / script, *args, world_size=nproc, cwd=root, timeout=600)
    return [float(m) for output in outputs for m in re.findall(r"loss (\d+\.\d+)", output)]
