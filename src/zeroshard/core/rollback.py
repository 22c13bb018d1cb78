"""What an optimizer step changes, copied before it so that a failed step can be undone.

[Note: transactional step]
Everything in ZeroOptimizer.step that can disagree between ranks or fail on a collective (the fp16
overflow check, the gradient norm, which parameters got a gradient) is decided before the update;
the update itself is only this rank's arithmetic: gradient scaling and the torch optimizer over the
masters and the optimizer state, which a user's optimizer, an out-of-memory error or a store may
interrupt half-way. A `Snapshot` of the masters, of the optimizer state and of the per-parameter
scalar state ([Note: parameters without a gradient] in masked.py) is taken before and put back if
the update raises, so the step leaves them as they were. The cost is one more copy of this rank's
masters and optimizer state while the step runs (ZeroOptimizer.transactional = False saves it),
less, at stages 2/3, the gradient shards the step frees as it goes ([Note: one group at a time]).
Where the update cannot fail once it has started (torch's fused Adam/AdamW over masters in CPU
memory: [Note: an update that cannot fail half-way] in atomic.py) only the `step` counters are
copied; `transactional = "copy"` copies anyway. For any other update no cheaper copy keeps the
guarantee: when the last group's update fails, every earlier group has
its new values and must get its old ones back, so both are in memory then, unless the update could
be undone exactly, which floating-point arithmetic does not allow. At stage 0 that
copy is kept between steps (`SnapshotBuffers`) and overwritten in place by the next one: a fresh
copy of hundreds of MB is mostly page faults on a CPU (torch's CPU allocator caches nothing: 8x the
time of copying into a kept buffer, docs/performance.md), and stage 0 is chosen for speed; stages
1-3 are chosen for memory, where a kept copy would sit on top of the activations through forward
and backward, so they take a fresh copy each step and free it ([Note: the copy taken ahead] moves
two thirds of stage 0's and 1's out of the step). Optimizer states offloaded to a CPU store are in
memory and are copied there like any other (in host memory; the store's host gradient is kept, so the
copy takes no gradient memory). With states on NVMe no copy is taken (Sharded sets transactional =
False): the copy would bring the states back into the memory they were offloaded from; the streamed
step instead checks every swap file before it updates anything, so a damaged store still fails
before any change. The gradients of
the window are then scaled or partly consumed: the caller must zero_grad() before the next backward
(Sharded enforces it, [Note: failed steps] in sharded.py).

[Note: one group at a time]
Where one optimizer.step() per flat group is the same update as one step() over all of them
(`steps_apart_alike`: torch's optimizers, which keep every state per tensor), ZeroOptimizer steps the
groups one after the other: it copies a group's master and state just before that group's update,
and frees the group's gradient shard as soon as the update has read it ([Note: gradient shard
lifetime] in grad_buffers.py). So the copies of the groups already stepped take the memory their gradients
leave: at the step's peak a rank holds its masters, optimizer state and their copy, and no gradient
(on the 202M GPT at stage 3: 403 MB less than copying everything before one step() over all,
docs/stage3_memory.md). An optimizer that counts steps per param group (apex's and DeepSpeed's
FusedAdam) would count one step per group: it gets one step() over all groups, and the copy of
everything before it. A failing group's update is undone with every group before it (all were
copied); the gradients are spent either way ([Note: failed steps] in sharded.py). A hook registered
on the inner torch optimizer (`register_step_pre_hook` / `post_hook`) therefore runs once per flat
group per step.

[Note: the copy taken ahead]
At stages 0 and 1 the last reductions of a backward are still in flight when the backward's last
gradient is taken, and the step cannot start before they complete (45-48 ms a step of idle main
thread on the 33.7M GPT, docs/performance.md). The optimizer state does not change between then and
the step, so the lifecycle asks the optimizer to copy it then (`ZeroOptimizer.copy_ahead`, before
end_backward waits: two thirds of Adam's copy), and the step's `Snapshot.keep` takes those copies
instead of copying again. A copy is taken only if its tensor is still the same object with the same
in-place write counter (`Tensor._version`, which every write through it, a view or a detach() of it
advances): a state loaded or replaced between the backward and the step is copied again. The state
is keyed by the flat masters, which a script never sees, so nothing writes it behind the counter.
The masters are copied in the step, as before: at stages 0/1 in fp32 they are the parameters'
storage, which a script may write through `param.data` (a tensor with a counter of its own) or a
collective may fill, neither of which the counter sees. Stage 0 copies into its kept buffers; stage
1 into fresh ones, freed at the end of the step: the copy then lives from the end of the backward,
when the activations are gone, and the step held all of it by its last group anyway, so the peak
is the same. Stages 2 and 3 free each group's gradient shard as its update reads it, and a copy
taken before the step would sit on top of all of them ([Note: one group at a time]): they copy in
the step.
"""
from __future__ import annotations

import copy
import weakref

import torch


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


class SnapshotBuffers:
    """Tensors a snapshot copies into: kept from one step to the next (stage 0), or from the copy
    taken ahead to the end of the step (stage 1) ([Note: the copy taken ahead])."""

    def __init__(self, keep_between_steps: bool = True) -> None:
        self.keep_between_steps = keep_between_steps
        self.kept: dict[tuple, torch.Tensor] = {}
        self._ahead: dict[tuple, tuple[weakref.ref, int]] = {}  # key -> (its source, the source's version)

    def copy(self, key: tuple, value: torch.Tensor) -> torch.Tensor:
        """`value`'s copy: the one taken ahead if `value` has not changed since, else a new one."""
        ahead = self._ahead.pop(key, None)
        kept = self.kept.get(key)
        if kept is None or kept.shape != value.shape or kept.dtype != value.dtype or kept.device != value.device:
            kept = self.kept[key] = value.clone()
        elif ahead is None or ahead[0]() is not value or ahead[1] != _version(value):
            kept.copy_(value)
        return kept

    def copy_ahead(self, key: tuple, value: torch.Tensor) -> None:
        """Copy `value` now, for the step that follows; `copy` takes it if `value` is unchanged then."""
        version = _version(value)
        self.copy(key, value)
        if version is not None:
            self._ahead[key] = (weakref.ref(value), version)

    def copy_state_ahead(self, state: dict, params: list[torch.Tensor]) -> None:
        """Copy the optimizer state of `params` for the step that follows; the masters are copied in
        the step. Memory this needs and cannot get is the step's to report: a copy that fails here
        only leaves the copying to the step."""
        try:
            for param in params:
                for key, value in state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        self.copy_ahead(("state", id(param), key), value)
        except (RuntimeError, MemoryError):  # torch's out-of-memory is a RuntimeError on CPU
            self.step_done()

    def step_done(self) -> None:
        """After a step (or a copy ahead that failed): no copy taken ahead is current any more; at
        stage 1 the copies are freed, so that they do not sit under the next forward's activations."""
        self._ahead.clear()
        if not self.keep_between_steps:
            self.kept.clear()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kept.values())

    @property
    def copies_ahead(self) -> int:
        """How many copies taken ahead wait for the step."""
        return len(self._ahead)


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place write counter (autograd's, shared with its views); None for an
    inference tensor, which has none: its copy is then always taken again."""
    try:
        return tensor._version
    except RuntimeError:
        return None


class Snapshot:
    """Copies of what an update changes, taken group by group just before each group's update
    ([Note: one group at a time]), put back by `restore` if the update raises."""

    def __init__(self, optimizer: torch.optim.Optimizer, slot_states, buffers: SnapshotBuffers | None = None,
                 atomic: bool = False) -> None:
        self.optimizer = optimizer
        self.slot_states = slot_states
        self.buffers = buffers
        # An update that cannot fail half-way ([Note: an update that cannot fail half-way] in
        # atomic.py): only the 0-dim state (Adam's `step`) is copied, and the groups updated noted.
        self.atomic = atomic
        self.updated: list = []
        self.before = set(optimizer.state)  # entries made by the update are dropped by restore
        self.diverged = copy.deepcopy(slot_states.diverged)
        self.masters: list[tuple] = []  # (group, its master's copy: 1-D fp32)
        self.state: dict = {}  # param -> {key: copy} for the entries of the groups kept
        self.nbytes = 0  # bytes copied (kept buffers included)

    def _copy(self, key: tuple | None, value):
        if not isinstance(value, torch.Tensor):
            return copy.deepcopy(value)
        self.nbytes += value.numel() * value.element_size()
        return value.clone() if self.buffers is None or key is None else self.buffers.copy(key, value)

    def keep(self, group, params) -> None:
        """Copy `group`'s master and the optimizer state of `params`, the tensors the optimizer keys
        that group's state by (its master, or its sub-groups), before they change. Stage 1 copies
        the master into its gradient buffer's stale part ([Note: the master's copy in the stale
        gradient] in grad_buffers.py) where that has room, stage 0 into its kept buffer."""
        if self.atomic:
            for param in params:
                if param in self.before:
                    self.state[param] = {k: self._copy(None, v) for k, v in self.optimizer.state[param].items()
                                         if v.dim() == 0}
            return
        place = group.stale_grad_part(group.master)  # None but at stage 1
        if place is not None:
            self.nbytes += place.numel() * place.element_size()
            self.masters.append((group, place.copy_(group.master)))
        else:
            self.masters.append((group, self._copy(("master", id(group)), group.master)))
        for param in params:
            if param in self.before:
                self.state[param] = {k: self._copy(("state", id(param), k), v)
                                     for k, v in self.optimizer.state[param].items()}

    @torch.no_grad()
    def restore(self) -> list:
        """Masters and optimizer state back as they were: in place where a tensor survives (a
        store's tensor stays that store's), entries created since dropped. Returns the groups an
        atomic update had updated, which nothing can put back."""
        if self.atomic:
            done = {id(group.master) for group in self.updated}
            for param, entry in self.state.items():
                for key, value in entry.items() if id(param) not in done else ():
                    self.optimizer.state[param][key].copy_(value)
            self.slot_states.diverged = self.diverged
            return self.updated
        for group, saved in self.masters:
            group.master.copy_(saved)
        state = self.optimizer.state
        for param in [p for p in state if p not in self.before]:
            del state[param]
        for param, entry in self.state.items():
            current = state[param]
            for key in [k for k in current if k not in entry]:
                del current[key]
            for key, value in entry.items():
                old = current.get(key)
                if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) and old.shape == value.shape:
                    old.copy_(value)
                else:  # a copy: a kept buffer must never become the live state it is a copy of
                    current[key] = _copy(value)
        self.slot_states.diverged = self.diverged
        return []


def steps_apart_alike(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Is one `optimizer.step()` per flat group (the other groups' gradients None) the same update
    as one step() over all of them ([Note: one group at a time])? True for torch's optimizers,
    which keep every state per tensor; False for one that counts steps per param group (apex's and
    DeepSpeed's FusedAdam keep `group["step"]`). Asked of twins over two 3-element tensors on
    `device` (the masters') with each param group's hyper-parameters, three steps each, so the
    user's optimizer is not touched; a twin that cannot step there answers False (one step() over
    all groups, which is never wrong)."""
    try:
        return _alike(optimizer, device)
    except Exception:  # noqa: BLE001 - a probe only: the real step reports the optimizer's errors
        return False


def _alike(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    generator = torch.Generator().manual_seed(0)
    rounds = [[torch.randn(3, generator=generator).to(device) for _ in range(2)] for _ in range(3)]
    for param_group in optimizer.param_groups:
        hyper = {k: v for k, v in param_group.items() if k != "params"}
        twins = []
        for _ in range(2):
            params = [torch.linspace(-1.0, 1.0, 3, device=device).requires_grad_() for _ in range(2)]
            twins.append((params, type(optimizer)([{**copy.deepcopy(hyper), "params": params}])))  # type: ignore[call-arg]  # the subclass's constructor: its defaults are its own arguments
        (together, one), (apart, other) = twins
        for grads in rounds:
            for param, grad in zip(together, grads):
                param.grad = grad.clone()
            one.step()
            for param, grad in zip(apart, grads):
                for q in apart:
                    q.grad = None
                param.grad = grad.clone()
                other.step()
        if not all(torch.equal(a, b) for a, b in zip(together, apart)):
            return False
        if not all(_same(one.state[a], other.state[b]) for a, b in zip(together, apart)):
            return False
        if not _same({k: v for k, v in one.param_groups[0].items() if k != "params"},
                     {k: v for k, v in other.param_groups[0].items() if k != "params"}):
            return False
    return True


def _same(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)
