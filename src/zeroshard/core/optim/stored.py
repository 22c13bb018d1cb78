"""The states of whole-parameter optimizers (block-wise low-bit ones, Muon) kept in an NVMe store and
streamed through memory one flat group at a time.

[Note: whole-parameter states in a store]
Elementwise optimizers step an NVMe store's states sub-group by sub-group ([Note: streamed step] in
streamed.py). A whole-parameter optimizer steps each owned parameter as a tensor of its own shape
(whole.py), and a block-wise one keeps each moment as a tensor subclass: codes, one scale per
block and a code map (lowbit.py). Neither can be cut into sub-groups, but each state tensor can
live in a swap file: every tensor inside a state (a subclass's inner tensors, or a plain moment)
moves into a store tensor of its own after the step that created it, and the state becomes the
same subclass rebuilt over those files (or a view of the file shaped like the parameter). The
optimizer then updates the files' memory in place, as it updated its own buffers.

The step goes one flat group at a time (ZeroOptimizer._apply_in_memory): the store reads the next
group's states while this group's update computes, and writes this group's back behind it, so the
states in memory are those of about three groups whatever the model's size. A state loaded from a
checkpoint is copied into the same files at once. Files are reused: a state the optimizer replaces
rather than updating in place is copied into its file after the step.
"""

from __future__ import annotations

import torch

from zeroshard.core.optim import lowbit


class StoredStates:
    """Homes in `store` (an NVMeStore) for the per-parameter states of the views a whole-parameter
    optimizer steps."""

    def __init__(self, store):
        self.store = store
        # id(view) -> {state name: (1-D store tensor, the tensor the state holds: a view of it)}
        self._homes: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._states: dict[int, torch.Tensor] = {}  # id -> a state value living in the store
        self._current: dict[tuple[int, str], torch.Tensor] = {}  # (id(view), state name) -> that value

    def files(self, views) -> list[torch.Tensor]:
        """The store tensors of these views' states: what stage/ready/release move."""
        return [home for view in views for home, _ in self._homes.get(id(view), {}).values()]

    def holds(self, value: object) -> bool:
        """Is this state value (a plain tensor or a block-wise one) in the store's files?"""
        return id(value) in self._states

    def adopt(self, state: dict, views: list[tuple[torch.Tensor, str]]) -> None:
        """Each (view, name) whose optimizer state in `state` has tensors outside the store: they are
        copied into its files (made at the first call) and the state holds the files' tensors."""
        for view, name in views:
            entry = state.get(view)
            if not entry:
                continue
            homes = self._homes.setdefault(id(view), {})
            for key, value in list(entry.items()):
                if self.holds(value) or not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue  # in the store already, or a scalar (a step counter) kept in memory
                if lowbit.is_blockwise(value):
                    tensors = lowbit.inner(value).items()
                    stored = lowbit.over(
                        value, {n: self._home(homes, f"whole.{name}.{key}.{n}", t) for n, t in tensors}
                    )
                else:
                    stored = self._home(homes, f"whole.{name}.{key}", value)
                replaced = self._current.get((id(view), key))
                if replaced is not None:
                    self._states.pop(id(replaced), None)
                self._current[(id(view), key)] = self._states[id(stored)] = stored
                entry[key] = stored

    def _home(self, homes: dict, key: str, value: torch.Tensor) -> torch.Tensor:
        """`value` copied into its file (made when there is none of its size and dtype yet), and the
        file's tensor shaped like it."""
        file, _ = homes.get(key, (None, None))
        if file is None or file.numel() != value.numel() or file.dtype != value.dtype:
            file = self.store.tensor(key, value.numel(), value.dtype)
        file.copy_(value.reshape(-1))
        homes[key] = (file, file.view(value.shape))
        return homes[key][1]

    def move(self, verb: str, views) -> None:
        """The store's `verb` ("stage", "ready" or "release") for these views' state files."""
        getattr(self.store, verb)(self.files(views))

    def check(self) -> None:
        self.store.check([home for homes in self._homes.values() for home, _ in homes.values()])

    def wait(self) -> None:
        self.store.wait()
