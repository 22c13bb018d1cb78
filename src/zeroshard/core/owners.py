"""Which rank updates each whole parameter of a whole-parameter optimizer (Muon).

[Note: whole-parameter ownership]
Muon's update of a matrix depends on the whole matrix (Newton-Schulz orthogonalises its momentum),
so the flat slice a rank owns must not cut one. For the param groups of such an optimizer, a flat
group's layout puts every parameter whole inside one rank's slice, its owner (flat.py, `owners`):
the stage's reduce-scatter then leaves the whole averaged gradient on the owner, which alone runs
the update, and the stage's all-gather hands the new values to the others. No collective is added;
what it costs is padding, because slices are equal and the busiest one sets their size.

Owners are chosen per flat group in two steps. First the parameters are packed into `world_size`
bins by largest-first, each into the bin with the fewest elements (least padding: the slice size is
the largest bin). Then the bins go to ranks, the bin with the most Newton-Schulz work to the rank
with the least work so far over the whole model: one GPT block at 2 ranks packs 7d²|5d², and the
next block gives its 7d² to the other rank, so the update work evens out over the blocks while each
group keeps its least padding.

[Note: spans of units]
One unit rarely splits evenly: a GPT block's matrices (3d², d², 4d², 4d²) pad to 7d² | 5d² at 2
ranks (16.7% more elements to reduce-scatter and all-gather than AdamW's layout) and to 4 | 4 | 3 | 1
at 4 ranks (33.3%). Two blocks split 12d² | 12d² exactly, four blocks split in four. So at stages
1 and 2 the whole parameters of consecutive units share one flat group, held by the first unit of
the span: `plan_spans` grows each span until its padding is at most `SPAN_PADDING` (or it holds
`MAX_SPAN` units). What that costs: the span's gradients are reduced when its first unit's backward
ends, so the later units' reduction starts up to `MAX_SPAN - 1` units later (still overlapped with
the backward of the units before it); at stage 2 their full gradients live until then. Stage 1
keeps full gradients between steps anyway. Stage 3 gathers each unit's parameters for its own
forward, so there a span would keep `MAX_SPAN` units gathered: it keeps one unit per group.

[Note: owners with uneven slices]
At stage 3 a whole-parameter group's slices are uneven instead ([Note: uneven slices] in
flat.py): no padding, each rank's slice exactly its matrices, and the collectives told the sizes.
Then the owners need not split each group evenly, only the model: each matrix, largest first within
its group, goes to the rank holding the fewest whole-parameter elements so far (then the least
Newton-Schulz work). A GPT block at 2 ranks splits 7d² | 5d², the next 5d² | 7d²; over the model no
rank holds more than the mean plus its largest matrix (the bound of greedy list scheduling), which is
stage 3's memory per rank, and the update work follows the elements. ZeRO++'s qwZ, qgZ and hpZ cut
slices into equal blocks or rows: with them stage 3 keeps equal slices, padded (`summary()` says).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

SPAN_PADDING = 0.05  # [Note: spans of units]
MAX_SPAN = 8


def newton_schulz_flops(shape: torch.Size, steps: int = 5) -> float:
    """Multiply-adds of `steps` quintic Newton-Schulz iterations on a matrix of `shape` (trailing
    dimensions flattened): per step X Xᵀ, A A and B X, each about m·m·n with m = the smaller side."""
    rows = int(shape[0]) if len(shape) else 1
    cols = math.prod(int(d) for d in shape[1:]) if len(shape) > 1 else 1
    small, large = min(rows, cols), max(rows, cols)
    return float(steps) * (2 * small * small * large + small**3)


@dataclass
class OwnerPlan:
    """Owners for every whole-parameter flat group of one model, and what they cost."""

    world_size: int
    groups: frozenset[int | None]  # optimizer param groups that need whole parameters; None: frozen ones
    flops: list[float] = field(default_factory=list)  # Newton-Schulz work per rank so far
    numel: int = 0  # elements of whole parameters planned
    padded_numel: int = 0  # what their flat groups take, padding included
    span_units: list[list[str]] = field(default_factory=list)  # stages 1/2: units sharing a flat group
    uneven: bool = False  # groups get uneven slices: [Note: owners with uneven slices]
    elements: list[int] = field(default_factory=list)  # whole-parameter elements per rank so far

    def __post_init__(self) -> None:
        if not self.flops:
            self.flops = [0.0] * self.world_size
        if not self.elements:
            self.elements = [0] * self.world_size

    def plan_spans(self, units: list[list[torch.Size]]) -> list[list[int]]:
        """Consecutive runs of `units` (each: its whole parameters' shapes) that share a flat group
        ([Note: spans of units])."""
        spans: list[list[int]] = []
        for index, _ in enumerate(units):
            if (
                not spans
                or len(spans[-1]) >= MAX_SPAN
                or self._padding_of([units[i] for i in spans[-1]]) <= SPAN_PADDING
            ):
                spans.append([])
            spans[-1].append(index)
        return spans

    def _padding_of(self, units: list[list[torch.Size]]) -> float:
        sizes = [int(torch.Size(s).numel()) for shapes in units for s in shapes]
        filled = _pack(sizes, self.world_size)[1]
        return (max(filled) * self.world_size - sum(sizes)) / max(sum(sizes), 1)

    def assign(self, shapes: list[torch.Size]) -> list[int]:
        """The owning rank of each parameter of one flat group (see [Note: whole-parameter ownership])."""
        world = self.world_size
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        costs = [newton_schulz_flops(torch.Size(s)) for s in shapes]
        if self.uneven:
            return self._assign_uneven(sizes, costs)
        bins, filled = _pack(sizes, world)
        work = [sum(costs[i] for i in members) for members in bins]
        by_work = sorted(range(world), key=lambda b: (-work[b], -filled[b], b))
        by_load = sorted(range(world), key=lambda r: (self.flops[r], r))
        owners = [0] * len(shapes)
        for b, rank in zip(by_work, by_load):
            for index in bins[b]:
                owners[index] = rank
            self.flops[rank] += work[b]
        self.numel += sum(sizes)
        self.padded_numel += max(max(filled), 1) * world
        for rank in range(world):  # equal slices: every rank stores the fullest bin's size
            self.elements[rank] += max(filled)
        return owners

    def _assign_uneven(self, sizes: list[int], costs: list[float]) -> list[int]:
        """[Note: owners with uneven slices]"""
        owners = [0] * len(sizes)
        for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            rank = min(range(self.world_size), key=lambda r: (self.elements[r], self.flops[r], r))
            owners[index] = rank
            self.elements[rank] += sizes[index]
            self.flops[rank] += costs[index]
        self.numel += sum(sizes)
        self.padded_numel += sum(sizes)
        return owners

    @property
    def padding(self) -> float:
        """Padding as a fraction of the whole parameters' elements (what the collectives move extra)."""
        return (self.padded_numel - self.numel) / self.numel if self.numel else 0.0

    @property
    def imbalance(self) -> float:
        """The busiest rank's Newton-Schulz work over the mean (1.0: even)."""
        mean = sum(self.flops) / len(self.flops)
        return max(self.flops) / mean if mean else 1.0

    @property
    def fullest(self) -> float:
        """The most whole-parameter elements a rank stores, over the mean (1.0: even)."""
        mean = self.numel / self.world_size
        return max(self.elements) / mean if mean else 1.0

    def summary(self) -> str:
        spans = max((len(s) for s in self.span_units), default=1)
        return (
            f"{self.numel} elements of whole parameters over {self.world_size} ranks"
            + (", uneven slices" if self.uneven else "")
            + f": padding {100 * self.padding:.1f}%, fullest rank {self.fullest:.3f}x the mean, "
            f"busiest rank's Newton-Schulz work {self.imbalance:.3f}x the mean"
            + (f", flat groups spanning up to {spans} units" if spans > 1 else "")
        )


def _pack(sizes: list[int], world: int) -> tuple[list[list[int]], list[int]]:
    """Largest first, each into the bin with the fewest elements: (bins of indices, their sizes)."""
    bins: list[list[int]] = [[] for _ in range(world)]
    filled = [0] * world
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        target = min(range(world), key=lambda b: (filled[b], b))
        bins[target].append(index)
        filled[target] += sizes[index]
    return bins, filled
