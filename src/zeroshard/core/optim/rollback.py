"""What a failed optimizer step leaves behind: refused further use (the default), or undone by a copy.

[Note: failed optimizer steps]
Everything in ZeroOptimizer.step that can disagree between ranks or fail on a collective (the fp16
overflow check, the gradient norm, which parameters got a gradient) is decided before the update;
the update itself is only this rank's arithmetic: the torch optimizer over the masters and the
optimizer state, which a user's optimizer, an out-of-memory error or a store may interrupt half-way.
Undoing that needs a copy of what the update changes, taken before it: a copy of this rank's
masters and optimizer state (12 bytes an element with Adam), which neither DDP, FSDP2 nor DeepSpeed
pays. So a failure is handled in one of two ways, chosen by `ZeroOptimizer.on_failed_update`:

* "fail_stop" (the default) takes no copy. A step that raises before its first update changed
  nothing and can be retried after zero_grad(), as any failed step; one that raises after an update
  began marks the optimizer `UpdateFailed`: every later forward, backward and step refuses, naming
  the flat groups that changed, until a checkpoint is loaded. Nothing is silently half-applied.
  Ctrl-C there is raised as the KeyboardInterrupt it is; the later calls refuse all the same.
* "copy" (a config's `zeroshard.transactional_step: "copy"`) copies each group's master and optimizer state
  just before that group's update (`Snapshot`) and puts them back if the update raises, so the step
  leaves them as they were and training can go on after zero_grad().

Stores are checked before anything is updated in both modes (a damaged swap file fails the step
with nothing changed): that costs no copy. With optimizer states on NVMe, "copy" copies them into
host memory for the step, which is the memory their offload saves.

[Note: one group at a time]
Where one optimizer.step() per flat group is the same update as one step() over all of them
(`steps_apart_alike`: torch's optimizers, which keep every state per tensor), ZeroOptimizer steps the
groups one after the other and frees each group's gradient shard as soon as its update has read it
([Note: gradient shard lifetime] in core/group.py). The first step allocates the optimizer state
group by group, then into the memory the earlier groups' gradients left, and with "copy" the copies
of the groups already stepped take that memory too. An optimizer that counts steps per param group
(apex's and DeepSpeed's FusedAdam) would count one step per group: it gets one step() over all
groups. A hook registered on the inner torch optimizer (`register_step_pre_hook` / `post_hook`)
therefore runs once per flat group per step.
"""

from __future__ import annotations

import copy

import torch

from zeroshard.core.optim import lowbit

ON_FAILED_UPDATE = ("fail_stop", "copy")


class UpdateFailed(RuntimeError):
    """An optimizer step raised after it began updating masters and optimizer state, without a copy
    to undo it ([Note: failed optimizer steps])."""

    @classmethod
    def after(cls, error: BaseException, updated: list, total: int) -> UpdateFailed:
        first = f" (the first holds '{updated[0].names[0]}')" if updated else ""
        return cls(
            f"the optimizer step raised {type(error).__name__}: {error} after it began updating {len(updated)} of "
            f"{total} flat groups{first}: their master weights and optimizer state are partly updated and cannot "
            'be put back. Load the last checkpoint to continue; on_failed_update="copy" keeps a copy that undoes '
            "such a failure ([Note: failed optimizer steps] in core/optim/rollback.py)"
        )


class Snapshot:
    """Copies of what an update changes, taken group by group just before each group's update
    ([Note: one group at a time]), put back by `restore` if the update raises."""

    def __init__(self, optimizer: torch.optim.Optimizer, slot_states) -> None:
        self.optimizer = optimizer
        self.slot_states = slot_states
        self.before = set(optimizer.state)  # entries made by the update are dropped by restore
        self.diverged = copy.deepcopy(slot_states.diverged)
        self.masters: list[tuple] = []  # (group, its master's copy: 1-D fp32)
        self.state: dict = {}  # param -> {key: copy} for the entries of the groups kept
        self.nbytes = 0  # bytes copied

    def _copy(self, value):
        if not isinstance(value, torch.Tensor):
            return copy.deepcopy(value)
        self.nbytes += lowbit.state_nbytes(value)
        return lowbit.clone(value) if lowbit.is_blockwise(value) else value.clone()

    def keep(self, group, params) -> None:
        """Copy `group`'s master and the optimizer state of `params`, the tensors the optimizer keys
        that group's state by (its master, or its sub-groups), before they change."""
        self.masters.append((group, self._copy(group.master)))
        for param in params:
            if param in self.before:
                self.state[param] = {k: self._copy(v) for k, v in self.optimizer.state[param].items()}

    @torch.no_grad()
    def restore(self) -> None:
        """Masters and optimizer state back as they were: in place where a tensor survives (a
        store's tensor stays that store's), entries created since dropped."""
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
                if lowbit.is_blockwise(old) and type(old) is type(value):
                    lowbit.copy_into(old, value)
                elif isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) and old.shape == value.shape:
                    old.copy_(value)
                else:
                    current[key] = value
        self.slot_states.diverged = self.diverged


def steps_apart_alike(
    optimizer: torch.optim.Optimizer, device: torch.device, whole: set | frozenset = frozenset()
) -> bool:
    """Is one `optimizer.step()` per flat group (the other groups' gradients None) the same update
    as one step() over all of them ([Note: one group at a time])? True for torch's optimizers,
    which keep every state per tensor; False for one that counts steps per param group (apex's and
    DeepSpeed's FusedAdam keep `group["step"]`). Asked of twins over two 3-element tensors on
    `device` (the masters') with each param group's hyper-parameters, three steps each, so the
    user's optimizer is not touched; a twin that cannot step there answers False (one step() over
    all groups, which is never wrong). The param groups in `whole` step whole parameters, each with
    state of its own (Muon): they are not asked."""
    try:
        return _alike(optimizer, device, whole)
    except Exception:  # noqa: BLE001 - a probe only: the real step reports the optimizer's errors
        return False


def _alike(optimizer: torch.optim.Optimizer, device: torch.device, whole) -> bool:
    generator = torch.Generator().manual_seed(0)
    rounds = [[torch.randn(3, generator=generator).to(device) for _ in range(2)] for _ in range(3)]
    for index, param_group in enumerate(optimizer.param_groups):
        if index in whole:
            continue
        hyper = {k: v for k, v in param_group.items() if k != "params"}
        twins = []
        for _ in range(2):
            params = [torch.linspace(-1.0, 1.0, 3, device=device).requires_grad_() for _ in range(2)]
            # the subclass's constructor: its defaults are its own arguments
            twins.append((params, type(optimizer)([{**copy.deepcopy(hyper), "params": params}])))  # type: ignore[call-arg]
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
        if not _same(
            {k: v for k, v in one.param_groups[0].items() if k != "params"},
            {k: v for k, v in other.param_groups[0].items() if k != "params"},
        ):
            return False
    return True


def _same(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)
