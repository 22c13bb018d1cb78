"""The optimizer step over flat master shards.

The user's (or the config's) torch optimizer is kept — its class, hyper-parameters and param-group
dicts, so LR schedulers built against it keep working — but each param group's `params` is
re-pointed at the fp32 master shards of the flat groups (see [Note: flat layout]). That is correct
exactly for optimizers whose update of an element depends only on that element's own state
(SGD, Adam, AdamW, ...), which `check_shardable` enforces. Param groups of a whole-parameter
optimizer (Muon) step views of the whole matrices this rank owns instead (core/optim/whole.py).
Its state is also kept per flat group in the form checkpoints save and load (`group_state`,
`load_group_state`: the checkpoint contract).
"""

from __future__ import annotations

import collections
import contextlib
import math

import torch

from zeroshard.core import consistency
from zeroshard.core.comm import CollectiveError, Communicator
from zeroshard.core.group import FlatGroup
from zeroshard.core.mesh import NormScope
from zeroshard.core.optim import lowbit
from zeroshard.core.optim.groups import keeps_state
from zeroshard.core.optim.masked import PER_PARAMETER, SlotStates, scalars_of, step_runs
from zeroshard.core.optim.norm import NormWhenAsked, sum_of_squares
from zeroshard.core.optim.rollback import ON_FAILED_UPDATE, Snapshot, UpdateFailed, steps_apart_alike
from zeroshard.core.optim.stored import StoredStates
from zeroshard.core.optim.streamed import StreamedStep, is_elementwise
from zeroshard.core.optim.whole import Owned, flat_state, load_flat_state, state_keys
from zeroshard.core.param_gather import refresh_parameters
from zeroshard.core.policy import StagePolicy
from zeroshard.core.precision import DynamicLossScaler


class ZeroOptimizer(torch.optim.Optimizer):
    """What `initialize` returns as the optimizer: the torch optimizer over this rank's shards.

    A `torch.optim.Optimizer` so that torch's LR schedulers (which check `isinstance`) and code that
    type-checks the optimizer take it. It shares the wrapped optimizer's `param_groups`, `state` and
    `defaults` (the same objects, so a scheduler built against either drives both) and does not run
    `Optimizer.__init__`, which would build param groups of its own; it sets the hook registries
    that `Optimizer`'s methods (step hooks, state-dict hooks) read.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        groups: list[FlatGroup],
        comm: Communicator,
        policy: StagePolicy,
        clip: float,
        loss_scaler: DynamicLossScaler | None = None,
        streamed: StreamedStep | None = None,
        norm: NormScope | None = None,
        replica: Communicator | None = None,
        matrices: dict[int, list[Owned]] | None = None,
        whole_store=None,
    ):
        self._optimizer_step_pre_hooks = collections.OrderedDict()
        self._optimizer_step_post_hooks = collections.OrderedDict()
        self._optimizer_state_dict_pre_hooks = collections.OrderedDict()
        self._optimizer_state_dict_post_hooks = collections.OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = collections.OrderedDict()
        self._optimizer_load_state_dict_post_hooks = collections.OrderedDict()
        self._warned_capturable_if_run_uncaptured = True
        self._patch_step_function()  # torch's step hooks (register_step_pre_hook/post_hook) run
        self.optimizer = optimizer
        self.groups = [g for g in groups if g.trainable]
        self.comm = comm
        self.policy = policy
        self.clip = clip
        self.loss_scaler = loss_scaler
        self._last_norm: float | NormWhenAsked | None = None  # last_grad_norm
        self.skipped_steps = 0
        self.streamed = streamed  # offload: step sub-group by sub-group through a store
        self.norm = norm or NormScope()  # beyond dp: see [Note: ZeRO over the data-parallel dimension]
        # MiCS: `comm` is one partition group, whose shards hold every gradient (so the norm is
        # complete there); a parameter's flag must still count every rank ([Note: ZeRO++ and MiCS]).
        self.replica = replica
        self.slot_states = SlotStates()  # per-parameter scalar state where it differs (masked.py)
        self._on_failed_update = "fail_stop"  # [Note: failed optimizer steps] in rollback.py
        self.failed_update: UpdateFailed | None = None  # set by a failed fail-stop update, until a reload
        self.snapshot_peak_bytes = 0  # what the last step copied with "copy" ([Note: one group at a time])
        self._per_group: bool | None = None  # steps_apart_alike(optimizer), asked at the first step
        self.deferred_gather = None  # set by Sharded: [Note: deferred parameter gather]
        # id(flat group) -> the parameters this rank updates whole in it (whole-parameter param groups)
        self.matrices = matrices or {}
        # An NVMe optimizer store: the whole-parameter groups' states live there too ([Note:
        # whole-parameter states in a store] in stored.py); a CPU store's are in memory anyway.
        self.stored = (
            StoredStates(whole_store)
            if whole_store is not None and not whole_store.in_memory and self.matrices
            else None
        )
        # After the first step or a loaded state, each whole-parameter group saves every key its
        # optimizer creates, on every rank (flat_state); by param group, asked once: (the keys of
        # tensors shaped like the parameter, {scalar key: dtype}).
        self._whole_keys: dict[int | None, tuple[tuple[str, ...], dict]] | None = None
        # Whole-parameter groups, by id: the steps in which each slot had a gradient (every rank
        # counts every slot, from the step's global `seen`), which is a step counter's value (Adam's
        # `step`) on the slot's owner; and which slots the optimizer keeps block-wise (lowbit.py).
        self._whole_steps: dict[int, list[int]] = {
            id(g): [0] * len(g.layout.slots) for g in self.groups if id(g) in self.matrices
        }
        self._quantized: dict[int, list[bool]] = {}

    @property
    def name(self) -> str:  # the torch optimizer's class name, which checkpoints record and check
        return type(self.optimizer).__name__

    # Users and LR schedulers read and write these as on a torch optimizer: the wrapped optimizer's.
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict) -> None:
        raise ValueError(
            "add_param_group() after sharding: zeroshard laid out the shards for the param groups the "
            "optimizer had when it was sharded; give it every group before"
        )

    def __repr__(self) -> str:
        return f"ZeroOptimizer({self.optimizer!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard every gradient accumulated since the last step (DeepSpeed's and torch's meaning:
        a dropped micro-batch leaves no trace). Gradients live in the flat buffers, not in `.grad`."""
        for group in self.groups:
            group.zero_grads()

    def grad_norm(self, grads: list[torch.Tensor]) -> float:
        """Global L2 norm of the reduced gradients (fp64, all ranks' shards; `grads` as `self.groups`)."""
        return self._norm_and_seen(grads)[0]

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global gradient norm (None before one; [Note: the stage-0 norm, computed
        when asked] in norm.py)."""
        last = self._last_norm
        return last.value() if isinstance(last, NormWhenAsked) else last

    def _norm_when_asked(self, grads: list[torch.Tensor]) -> bool:
        """Can this step leave the norm until asked? Stage 0, nothing to clip or unscale, the fp32
        gradients in the buffers the groups keep, no model-parallel groups to sum over."""
        return (
            not self.policy.shard_optimizer
            and self.clip <= 0
            and self.loss_scaler is None
            and self.streamed is None
            and not self.norm.comms
            and not self.norm.skip
            and all(grad.dtype == torch.float32 for grad in grads)
        )

    def _norm_and_seen(self, grads: list[torch.Tensor], squares: bool = True) -> tuple[float, dict[int, list[bool]]]:
        """The global gradient norm, and per group which slots got a gradient on any rank ([Note:
        parameters without a gradient] in masked.py), both in one all-reduce: the fp64 sum of
        squares of this rank's part, and one fp64 count per parameter tensor. Stages 1-3 count their
        shard. At stage 0 every rank holds the same reduced gradient, so each counts its 1/N of every
        piece: the squares are read once over the ranks instead of N times (measured:
        docs/performance.md); only the fp64 summation order changes. Under
        tensor/pipeline parallelism the norm (not the flags, which are this dp group's) is then
        summed over the model-parallel groups, tp-replicated parameters counted once. Without
        `squares` the flags only (the norm is 0.0)."""
        flags = [seen for g in self.groups for seen in g.grad_seen]
        # (norm, flags..., h, h*h): the last two compare the ranks' collectives ([Note: collective
        # fingerprint] in core/consistency.py)
        total = torch.zeros(3 + len(flags), dtype=torch.float64, device=self.comm.device)
        for group, grad in zip(self.groups, grads) if squares else ():
            for piece in self.norm.counted(group, grad):
                total[:1] += sum_of_squares(self._counted_here(piece)).to(total.device)
        total[1:-2] = torch.tensor(flags, dtype=torch.float64)
        total[-2:] = torch.tensor(consistency.fingerprint_terms(self.comm.fingerprint), dtype=torch.float64)
        self.comm.all_reduce(total, "gradient norm and parameters with a gradient", kind="control")
        sum_h, sum_h2 = total[-2:].tolist()
        if not consistency.fingerprints_agree(sum_h, sum_h2, self.comm.world_size):
            raise CollectiveError(
                f"rank {self.comm.rank}: the gradient norm's all-reduce found that ranks diverged before this step: "
                "they did not run the same collectives "
                "(kind, size, description) since the start; every rank must run the same units in the same order "
                "and call backward()/step() alike. CommunicationPolicy(check_collectives=True) names the first one "
                "([Note: collective fingerprint] in core/consistency.py)"
            )
        everywhere = (total[1:-2] > 0).tolist()
        if self.replica is not None and flags:
            seen = torch.tensor(everywhere, dtype=torch.uint8, device=self.replica.device)
            self.replica.all_reduce(
                seen, "parameters with a gradient, across partition groups", op="max", kind="control"
            )
            everywhere = seen.bool().tolist()
        norm = total[:1].clone()
        self.norm.all_reduce(norm)  # tp and pp ranks hold other parameters: sum over them too
        out, position = {}, 0
        for group in self.groups:
            out[id(group)] = everywhere[position : position + len(group.grad_seen)]
            position += len(group.grad_seen)
        return math.sqrt(norm.item()), out

    def _counted_here(self, piece: torch.Tensor) -> torch.Tensor:
        """The part of a norm piece this rank sums: all of its shard (stages 1-3), or its 1/N of a
        gradient every rank holds whole (stage 0)."""
        if self.policy.shard_optimizer:
            return piece
        n, rank, world = piece.numel(), self.comm.rank, self.comm.world_size
        return piece[n * rank // world : n * (rank + 1) // world]

    @property
    def on_failed_update(self) -> str:
        """ "fail_stop" (no copy; a step that fails half-way refuses further use) or "copy" (undone
        from a copy): [Note: failed optimizer steps] in rollback.py."""
        return self._on_failed_update

    @on_failed_update.setter
    def on_failed_update(self, value: str) -> None:
        if value not in ON_FAILED_UPDATE:
            raise ValueError(f"on_failed_update={value!r}: expected one of {', '.join(map(repr, ON_FAILED_UPDATE))}")
        self._on_failed_update = value

    def check_usable(self, what: str) -> None:
        """Refuse `what` after an update that failed half-way, until a checkpoint is loaded."""
        if self.failed_update is not None:
            raise UpdateFailed(f"{what}() refused: {self.failed_update}")

    def step(self) -> bool:  # type: ignore[override]  # no closure; says whether the step was applied
        """One optimizer step on this rank's shards; False when fp16 overflow skipped it."""
        self.check_usable("step")
        if self.deferred_gather is not None:  # the update writes the masters the gathers read
            self.deferred_gather.wait_all()
        if self.loss_scaler is not None and self._overflow():
            for group in self.groups:
                group.zero_grads()
            self.loss_scaler.update(overflow=True)
            self.skipped_steps += 1
            return False
        # The optimizer needs gradients in its master's dtype; a copy only where they differ.
        grads = [g.grad_for_optimizer() for g in self.groups]
        later = self._norm_when_asked(grads)
        grads = [
            grad if grad.dtype == g.master.dtype else grad.to(g.master.dtype) for grad, g in zip(grads, self.groups)
        ]
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        norm, seen = self._norm_and_seen(grads, squares=not later)
        norm /= scale
        coef = 1.0 / scale  # unscale and clip in one pass, as DeepSpeed does
        if self.clip > 0 and self.clip / (norm + 1e-6) < 1.0:  # DeepSpeed's and torch's epsilon
            coef *= self.clip / (norm + 1e-6)
        held = NormWhenAsked(grads) if later else None  # before the step drops its gradients
        with self._update() as update:
            for i in range(len(grads)) if coef != 1.0 else ():  # no loop variable left holding a gradient
                grads[i].mul_(coef)
            self._apply(grads, seen, update)
        for key, counts in self._whole_steps.items():
            self._whole_steps[key] = [count + bool(got) for count, got in zip(counts, seen[key])]
        self._last_norm = held if held is not None else norm
        if self.matrices and self._whole_keys is None:
            self._note_whole_keys()
        self.refresh_parameters()
        for group in self.groups:
            group.zero_grads()
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=False)
        return True

    def _steps_per_group(self) -> bool:  # steps_apart_alike, asked once
        self._per_group = (
            self._per_group
            if self._per_group is not None
            else bool(self.groups)
            and steps_apart_alike(
                self.optimizer,
                self.groups[0].master.device,
                {g.optimizer_group for g in self.groups if id(g) in self.matrices},
            )
        )
        return self._per_group

    def _apply(self, grads: list[torch.Tensor], seen: dict[int, list[bool]], update: _Update) -> None:
        """The update; groups with parameters that got no gradient step in runs ([Note: parameters
        without a gradient] in masked.py)."""
        uniform = {id(g): self._uniform_state(g) for g in self.groups}
        plans = {
            id(g): None if id(g) in self.matrices else self.slot_states.plan(g, seen[id(g)], uniform[id(g)])
            for g in self.groups
        }
        if self.streamed is not None:
            streamed = [(g, grad) for g, grad in zip(self.groups, grads) if id(g) not in self.matrices]
            for group, _ in streamed:
                update.begin(group, self._stepping_params(group))
            results = self.streamed.run({id(g): grad.to(g.master.device) for g, grad in streamed}, plans)
            whole = [i for i, g in enumerate(self.groups) if id(g) in self.matrices]
            results.update(self._apply_in_memory(grads, plans, update, seen, whole))
        else:
            results = self._apply_in_memory(grads, plans, update, seen)
        advanced: dict = {}
        for group in self.groups:
            if plans[id(group)] is not None and any(seen[id(group)]):
                self._settle(group, uniform[id(group)], seen[id(group)], results.get(id(group), []), advanced)

    def _apply_in_memory(
        self, grads: list, plans, update: _Update, seen: dict[int, list[bool]], indices: list[int] | None = None
    ) -> dict[int, list]:
        """The groups at `indices` (default all): one group at a time where that is the same update,
        each group's gradient freed once it is spent; else all of them in one optimizer step ([Note:
        one group at a time] in rollback.py)."""
        indices = list(range(len(self.groups))) if indices is None else indices
        if not indices:
            return {}
        results = {}
        batches = [[i] for i in indices] if self._steps_per_group() else [indices]
        if self.stored is not None:
            self._whole_io("stage", batches[0])
        for n, batch in enumerate(batches):
            if self.stored is not None:  # the next group's states are read while this one computes
                if n + 1 < len(batches):
                    self._whole_io("stage", batches[n + 1])
                self._whole_io("ready", batch)
            batch_groups = [self.groups[i] for i in batch]
            for group in batch_groups:
                update.begin(group, self._stepping_params(group))
            for group, i in zip(batch_groups, batch):
                if id(group) in self.matrices:  # whole parameters; one never given a gradient stays as it is
                    grad = grads[i].to(group.master.device)  # an offloaded master: stepped where its states are
                    for m in self.matrices[id(group)]:
                        m.view.grad = grad[m.lo : m.hi].view(m.view.shape) if seen[id(group)][m.slot] else None
                else:
                    group.master.grad = grads[i] if plans[id(group)] is None else None  # torch skips grad None
            try:
                if any(plans[id(g)] is None for g in batch_groups):
                    self.optimizer.step()
                if self.stored is not None:
                    self.stored.adopt(self.optimizer.state, self._whole_names(batch))
            finally:
                for group in batch_groups:
                    group.master.grad = None
                    for m in self.matrices.get(id(group), ()):
                        m.view.grad = None
                if self.stored is not None:
                    self._whole_io("release", batch)
            for group, i in zip(batch_groups, batch):
                if plans[id(group)]:
                    results[id(group)] = step_runs(
                        self.optimizer,
                        group.optimizer_group,
                        group.master,
                        grads[i],
                        plans[id(group)],
                        lambda key, dtype, g=group: torch.zeros_like(g.master, dtype=dtype),
                    )
                if self._per_group:  # [Note: gradient shard lifetime] in core/group.py
                    grads[i] = None
                    group.free_grad_shard()
        if self.stored is not None:
            self.stored.wait()
            for store in {id(g.master_store): g.master_store for g in self._offloaded_masters(indices)}.values():
                store.wait()
        return results

    def _whole_io(self, verb: str, indices: list[int]) -> None:
        """The store's `verb` ("stage", "ready" or "release") for the stored states of the
        whole-parameter groups at `indices` and for their masters where a store holds them (stage
        3's parameter store): read, waited for and written back together."""
        assert self.stored is not None
        self.stored.move(verb, self._whole_views(indices))
        for group in self._offloaded_masters(indices):
            getattr(group.master_store, verb)([group.master])

    def _offloaded_masters(self, indices: list[int]) -> list[FlatGroup]:
        groups = (self.groups[i] for i in indices)
        return [g for g in groups if id(g) in self.matrices and g.master_store is not None]

    def _whole_names(self, indices: list[int]) -> list[tuple[torch.Tensor, str]]:
        """(view, parameter name) of the whole parameters this rank steps in the groups at `indices`."""
        out = []
        for group in (self.groups[i] for i in indices):
            out += [(m.view, group.layout.slots[m.slot].name) for m in self.matrices.get(id(group), ())]
        return out

    def _whole_views(self, indices: list[int]) -> list[torch.Tensor]:
        return [view for view, _ in self._whole_names(indices)]

    def _note_whole_keys(self) -> None:
        indices = {g.optimizer_group for g in self.groups if id(g) in self.matrices}
        self._whole_keys = {i: state_keys(self.optimizer, i) for i in indices if i is not None}

    def _advance(self, group: FlatGroup, status: dict | None) -> dict:
        """The scalar state one step makes of `status` (None: never stepped), for a parameter this
        rank does not hold: the torch optimizer steps a one-element stand-in with a zero gradient
        (first from nothing, which gives it its elementwise state, then from `status`)."""
        stand_in = torch.zeros(1, device=group.master.device)
        zero = torch.zeros(1, device=group.master.device)

        def new_state(key, dtype):
            return torch.zeros(1, dtype=dtype, device=group.master.device)

        try:
            fresh = step_runs(self.optimizer, group.optimizer_group, stand_in, zero, [(0, 1, None)], new_state)
            if status is None:
                return fresh[0][2]
            return step_runs(self.optimizer, group.optimizer_group, stand_in, zero, [(0, 1, status)], new_state)[0][2]
        finally:
            self.optimizer.state.pop(stand_in, None)

    def _stepping_params(self, group: FlatGroup) -> list[torch.Tensor]:
        """The tensors the torch optimizer keys this group's state by: its master, its sub-groups, or
        the views of the whole parameters this rank owns."""
        if id(group) in self.matrices:
            return [m.view for m in self.matrices[id(group)]]
        return [s.param for s in self.streamed.subs_of(group)] if self.streamed is not None else [group.master]

    def _uniform_state(self, group: FlatGroup) -> dict | None:
        if id(group) in self.matrices:  # per-parameter state only (Muon's momentum)
            return None
        param = self._stepping_params(group)[0]
        return scalars_of(self.optimizer.state.get(param), param)

    def _settle(self, group: FlatGroup, uniform: dict | None, seen: list[bool], results: list, advanced: dict) -> None:
        """After a group stepped in runs: its scalar state is one again, or one per slot."""

        def advance(status):
            key = (group.optimizer_group, repr(status and sorted((k, float(v)) for k, v in status.items())))
            if key not in advanced:
                advanced[key] = self._advance(group, status)
            return advanced[key]

        agreed = self.slot_states.settle(group, uniform, seen, results, advance)
        if self.streamed is not None:
            self.streamed.complete_state(group)
        for param in self._stepping_params(group):
            state = self.optimizer.state[param]
            for key in [k for k, v in state.items() if not is_elementwise(v, param)]:
                del state[key]
            if agreed is not None and state:  # empty: a shard of padding only, never stepped here
                state.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in agreed.items()})

    @contextlib.contextmanager
    def _update(self):
        """The update, with what a failure leaves: [Note: failed optimizer steps] in rollback.py."""
        for group in self.groups:  # a damaged swap file fails here, before it is read
            if group.master_store is not None:
                group.master_store.check([group.master])
        if self.streamed is not None:
            self.streamed.check()
        if self.stored is not None:
            self.stored.check()
        update = _Update(self.optimizer, self.slot_states, copy=self.on_failed_update == "copy")
        try:
            yield update
        except BaseException as error:
            if update.snapshot is not None:
                update.snapshot.restore()
            elif update.began:
                self.failed_update = UpdateFailed.after(error, update.began, len(self.groups))
                if isinstance(error, Exception):  # Ctrl-C stays a KeyboardInterrupt; later calls refuse all the same
                    raise self.failed_update from error
            raise
        finally:
            self.snapshot_peak_bytes = update.snapshot.nbytes if update.snapshot is not None else 0

    def reloaded(self) -> None:
        """Masters and optimizer state were replaced (a checkpoint loaded): a failed update is gone."""
        self.failed_update = None

    def _overflow(self) -> bool:
        """Did any rank's gradients overflow? One all-reduce, so every rank decides alike."""
        bad = any(not bool(torch.isfinite(g.grad_for_optimizer()).all()) for g in self.groups)
        flag = torch.tensor([1.0 if bad else 0.0], device=self.comm.device)
        self.comm.all_reduce(flag, "fp16 overflow check", op="max", kind="control")
        return bool(flag.item())

    def refresh_parameters(self) -> None:
        refresh_parameters(self.groups, self.comm, self.deferred_gather)

    def keeps_state(self) -> bool:
        return keeps_state(self.optimizer)

    def state_bytes(self, stores=()) -> int:
        """Bytes of optimizer state in this process's memory (not those an NVMe store holds)."""
        total = 0
        for state in self.optimizer.state.values():
            for value in state.values():
                stored = self.stored is not None and self.stored.holds(value)
                if isinstance(value, torch.Tensor) and not stored and all(s.resident(value) for s in stores):
                    total += lowbit.state_nbytes(value)
        return total

    # -- state for checkpoints -------------------------------------------------------------------------
    def group_state(self, group: FlatGroup) -> dict:
        """The optimizer state of one flat group as if the torch optimizer stepped `group.master` in
        one piece: elementwise tensors (1-D, numel = master.numel()) and scalars (Adam's `step`),
        whatever sub-groups the streamed step cuts it into. {} before the first step. A whole-parameter
        group's state is each owned parameter's, laid out like the master (core/optim/whole.py)."""
        if id(group) in self.matrices:
            return self._whole_group_state(group)
        state = (
            self.streamed.state_of(group)
            if self.streamed is not None
            else dict(self.optimizer.state.get(group.master, {}))
        )
        if not self.slot_states.is_uniform(group):
            state = {k: v for k, v in state.items() if is_elementwise(v, group.master)}
            state.update(self.slot_states.expand(group))
        return state

    def load_group_state(self, group: FlatGroup, state: dict, take: bool = False) -> None:
        """Replace one group's optimizer state with `state` (the form `group_state` returns), copied
        as torch's load_state_dict copies. `take=True`: `state` is the caller's to give up (a load's
        freshly read tensors, [Note: a load hands its tensors over] in checkpoint/apply.py), and an
        elementwise tensor that is the whole of its storage is kept rather than copied."""
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and not is_elementwise(value, group.master):
                raise ValueError(
                    f"optimizer state '{key}' of '{group.names[0]}...' has {value.numel()} elements, "
                    f"the group's shard has {group.master.numel()}"
                )
        if id(group) in self.matrices:
            self._load_whole_group_state(group, state)
            return
        state = self.slot_states.absorb(group, state)
        if self.streamed is not None:
            self.streamed.load_state(group, state)
        elif state:  # copies unless taken, as torch's load_state_dict copies: the caller keeps its tensors
            self.optimizer.state[group.master] = {k: _loaded(v, group.master, take) for k, v in state.items()}
        else:
            self.optimizer.state.pop(group.master, None)

    def _quantized_slots(self, group: FlatGroup) -> list[bool]:
        if id(group) not in self._quantized:
            self._quantized[id(group)] = [lowbit.quantizes(self.optimizer, s.shape) for s in group.layout.slots]
        return self._quantized[id(group)]

    def _whole_group_state(self, group: FlatGroup) -> dict:
        """A whole-parameter group's `group_state`: its parameters' tensors laid out like the master
        (flat_state), and their step counter, one value when every slot agrees, else per parameter
        (`PER_PARAMETER`, as masked.py keeps the scalar state of slots that skipped steps)."""
        tensors, scalars = (self._whole_keys or {}).get(group.optimizer_group, ((), {}))
        out = flat_state(
            self.optimizer.state, self.matrices[id(group)], group.master, tensors, self._quantized_slots(group)
        )
        if not scalars:
            return out
        if set(scalars) != {"step"}:
            raise ValueError(
                f"{self.name} keeps scalar state {sorted(scalars)} per parameter; zeroshard saves a whole-parameter "
                "optimizer's scalar state only when it is a step counter named 'step'"
            )
        counts = self._whole_steps[id(group)]

        def status(count: int) -> dict | None:
            return None if count == 0 else {"step": torch.tensor(float(count), dtype=scalars["step"])}

        if len(set(counts)) == 1:
            return {**out, **(status(counts[0]) or {})} if counts[0] else {}
        return {**out, PER_PARAMETER: {s.name: status(c) for s, c in zip(group.layout.slots, counts)}}

    def _load_whole_group_state(self, group: FlatGroup, state: dict) -> None:
        """Inverse of `_whole_group_state`."""
        flat = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and is_elementwise(v, group.master)}
        scalars = {k: v for k, v in state.items() if k not in flat and k != PER_PARAMETER}
        slots = group.layout.slots
        statuses: list | None
        if PER_PARAMETER in state:
            statuses = [state[PER_PARAMETER].get(s.name) for s in slots]
        else:
            statuses = [dict(scalars) if scalars else None] * len(slots)
        if scalars or PER_PARAMETER in state:
            self._whole_steps[id(group)] = [int(float(s["step"])) if s else 0 for s in statuses]
        else:  # an optimizer without scalar state (Muon): every parameter takes its tensors
            statuses = None
            self._whole_steps[id(group)] = [0] * len(slots)
        load_flat_state(
            self.optimizer.state, self.matrices[id(group)], flat, self.optimizer, self._quantized_slots(group), statuses
        )
        if self.stored is not None:  # into the files at once: a loaded model's states never all in memory
            index = next(i for i, g in enumerate(self.groups) if g is group)
            self.stored.adopt(self.optimizer.state, self._whole_names([index]))
            self.stored.move("release", self._whole_views([index]))
            self.stored.wait()
        if state:
            self._note_whole_keys()

    def state_dict(self) -> dict:
        """This rank's optimizer state in torch's form: `state` maps the index of each trainable flat
        group to its `group_state`; `param_groups` holds the hyper-parameters and, as `params`, the
        indices of the flat groups each optimizer param group steps."""
        param_groups = []
        for index, param_group in enumerate(self.param_groups):
            saved = {k: v for k, v in param_group.items() if k != "params"}
            saved["params"] = [i for i, g in enumerate(self.groups) if g.optimizer_group == index]
            param_groups.append(saved)
        return {
            "state": {i: self.group_state(group) for i, group in enumerate(self.groups)},
            "param_groups": param_groups,
        }

    def load_state_dict(self, state: dict) -> None:
        """Inverse of `state_dict` for the same layout (same world size, stage and model)."""
        saved_groups = state["param_groups"]
        if len(state["state"]) != len(self.groups) or len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state of {len(state['state'])} flat groups and {len(saved_groups)} param "
                f"groups does not fit this optimizer ({len(self.groups)} and {len(self.param_groups)})"
            )
        for param_group, saved in zip(self.param_groups, saved_groups):
            param_group.update({k: v for k, v in saved.items() if k != "params"})
        for index, group in enumerate(self.groups):
            self.load_group_state(group, state["state"][index])


class _Update:
    """The groups an update has begun on, and their copies with "copy" ([Note: failed optimizer
    steps] in rollback.py)."""

    def __init__(self, optimizer: torch.optim.Optimizer, slot_states: SlotStates, copy: bool) -> None:
        self.snapshot = Snapshot(optimizer, slot_states) if copy else None
        self.began: list[FlatGroup] = []

    def begin(self, group: FlatGroup, params: list[torch.Tensor]) -> None:
        """`group`'s update is about to change its master and the state of `params`."""
        if self.snapshot is not None:
            self.snapshot.keep(group, params)
        self.began.append(group)


def _loaded(value, master: torch.Tensor, take: bool):
    """One value of a loaded state as the optimizer keeps it (ZeroOptimizer.load_group_state): a
    copy, unless taken. Only a plain elementwise tensor that is all of its storage is taken: a view
    would keep the rest of its storage alive, and scalar state (Adam's `step`, updated in place) may
    be shared between groups loaded from one saved group."""
    if not isinstance(value, torch.Tensor):
        return value
    plain = take and type(value) is torch.Tensor and is_elementwise(value, master)
    if plain and value.storage_offset() == 0 and value.untyped_storage().nbytes() == value.nbytes:
        return value
    return value.clone()
