"""Flat shard bookkeeping: where each parameter of a group lives in one padded 1-D buffer.

[Note: flat layout]
The parameters of a group are packed back to back into a 1-D buffer of `padded_numel` elements,
`padded_numel = world_size * shard_numel`, zero padding at the end. Rank r owns the contiguous slice
`[r * shard_numel, (r + 1) * shard_numel)`. Because the slices are equal, one all-gather or
reduce-scatter moves a whole group, and an elementwise optimizer can run on a rank's slice as if it
were one big parameter. Nothing here communicates; see comm.py for that.

With `owners` (a whole-parameter optimizer's groups: [Note: whole-parameter ownership] in
owners.py) each parameter sits whole inside its owner's slice instead, the parameters of one owner
back to back from the slice's start; `shard_numel` is the fullest slice, and the rest of each slice
is zero padding (`gaps`).

[Note: uneven slices]
With `owners` and `uneven` the slices are not equal: rank r's slice holds exactly the parameters it
owns, the slices back to back in rank order (`counts`, `starts`), and the buffer has no padding at
all (`padded_numel == numel`). The all-gather and reduce-scatter of such a group take the slice
sizes (comm.py `counts`), so they move the parameters' bytes and nothing else, and a rank stores
only what it owns. Stage 3 lays out whole-parameter groups so: there every unit is gathered for its
own forward, and one unit's matrices rarely split evenly ([Note: spans of units] in owners.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Slot:
    """One parameter's place in the flat buffer."""

    name: str
    shape: torch.Size
    offset: int  # first element in the full (unsharded) flat buffer
    numel: int


class FlatLayout:
    def __init__(
        self,
        names: list[str],
        shapes: list[torch.Size],
        world_size: int,
        owners: list[int] | None = None,
        uneven: bool = False,
    ):
        if not names:
            raise ValueError("a flat layout needs at least one parameter")
        numels = [int(torch.Size(shape).numel()) for shape in shapes]
        self.world_size = world_size
        self.numel = sum(numels)
        if uneven and owners is None:
            raise ValueError("uneven slices need owners")
        self.starts: tuple[int, ...] | None = None  # [Note: uneven slices]
        if owners is None:
            offsets = [sum(numels[:i]) for i in range(len(numels))]
            self.shard_numel = -(-self.numel // world_size)  # ceil
        else:
            self._check_owners(owners, len(names))
            filled = [0] * world_size
            for owner, numel in zip(owners, numels):
                filled[owner] += numel
            if uneven:  # [Note: uneven slices]: each slice its owner's parameters, back to back
                self.shard_numel = max(filled)  # the fullest slice
                starts = [sum(filled[:r]) for r in range(world_size)]
                self.starts, self._counts = tuple(starts), tuple(filled)
            else:  # equal slices, each padded to the fullest
                self.shard_numel = max(max(filled), 1)
                starts = [r * self.shard_numel for r in range(world_size)]
            offsets, used = [], [0] * world_size
            for owner, numel in zip(owners, numels):
                offsets.append(starts[owner] + used[owner])
                used[owner] += numel
        self.owners = tuple(owners) if owners is not None else None
        self.slots: tuple[Slot, ...] = tuple(
            Slot(name, torch.Size(shape), offset, numel)
            for name, shape, offset, numel in zip(names, shapes, offsets, numels)
        )
        self._in_buffer_order = tuple(sorted(self.slots, key=lambda s: s.offset))
        self.padded_numel = self.numel if self.starts is not None else self.shard_numel * world_size
        self.padding = tuple(self.gaps())  # the whole buffer's, zeroed in every fresh full gradient

    def _check_owners(self, owners: list[int], count: int) -> None:
        if len(owners) != count or any(not 0 <= o < self.world_size for o in owners):
            raise ValueError(f"owners {owners} do not give each of {count} parameters a rank < {self.world_size}")

    @property
    def even(self) -> bool:
        """Are all slices `shard_numel` long ([Note: flat layout]), or do they differ ([Note: uneven slices])?"""
        return self.starts is None

    @property
    def counts(self) -> tuple[int, ...] | None:
        """The slice size of each rank where they differ ([Note: uneven slices]); None where they are equal."""
        return None if self.starts is None else self._counts

    def shard_size(self, rank: int) -> int:
        start, end = self.shard_range(rank)
        return end - start

    def gaps(self, start: int = 0, end: int | None = None) -> list[tuple[int, int]]:
        """The ranges of [start, end) (default: the whole buffer) that no parameter covers: padding,
        which stays zero."""
        end = self.padded_numel if end is None else end
        out, at = [], start
        for slot in self._in_buffer_order:
            lo, hi = max(at, slot.offset), min(end, slot.offset + slot.numel)
            if lo < hi:
                if at < lo:
                    out.append((at, lo))
                at = hi
        if at < end:
            out.append((at, end))
        return out

    def shard_range(self, rank: int) -> tuple[int, int]:
        if self.starts is not None:
            return self.starts[rank], self.starts[rank] + self._counts[rank]
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views into `full` (1-D, numel = padded_numel)."""
        assert full.dim() == 1 and full.numel() == self.padded_numel, (full.shape, self.padded_numel)
        return [full[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots]

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """A new full buffer holding `tensors` (one per slot), zero padded."""
        full = torch.zeros(self.padded_numel, dtype=dtype, device=tensors[0].device)
        for slot, tensor in zip(self.slots, tensors):
            assert tensor.shape == slot.shape, (slot.name, tensor.shape, slot.shape)
            full[slot.offset : slot.offset + slot.numel].copy_(tensor.reshape(-1))
        return full

    def pieces_in(self, start: int, end: int) -> Iterator[tuple[Slot, int, int]]:
        """(slot, lo, hi) for each parameter overlapping [start, end) of the padded buffer, in buffer
        order: elements [lo, hi) of the flattened parameter sit at [slot.offset + lo, slot.offset + hi).
        How checkpoints re-slice a parameter between layouts of different world sizes."""
        for slot in self._in_buffer_order:
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if lo < hi:
                yield slot, lo - slot.offset, hi - slot.offset
