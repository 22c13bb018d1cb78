"""When units gather, free and reduce: the hooks that drive a training step.

Forward (stage 3): a unit's forward pre-hook gathers it (or waits on the prefetch issued by the
unit before it) and prefetches the next units in the order recorded on the first step, within the
bounds of [Note: bounded gathering] (gathered.py); its forward hook frees it again (unless it is
reused soon enough to keep) and hooks its outputs, so that the gradient arriving at those outputs
gathers it once more before its own backward. Backward (every stage): each parameter's
post-accumulate-grad hook moves its gradient into the group's flat gradient buffer; when the last
trainable parameter of a unit has its gradient, the unit's reduction is issued (asynchronously) and
the unit is freed. `end_backward` reduces units whose parameters were unused, waits for every
reduction and frees whatever is still gathered.

[Note: frozen parameters in backward]
A unit's last trainable gradient does not mean backward is done with its parameters when some of them
have no gradient of their own: in a LoRA layer `y = x W^T + B(A(x))` the adapter's gradients can land
before the frozen W is read to carry the gradient on to x. Freeing W at the adapters' last gradient
would leave backward a parameter with no storage. So a unit with frozen parameters watches its
forward's tensor inputs (positional and keyword) that require grad, with one multi-grad hook per
forward call (mode "all"): every read of its parameters that sends a gradient out of the unit happens
before those inputs' gradients are complete. It is freed once both its trainable gradients and its
inputs' gradients are in; a unit whose inputs need no gradient (the first layers under a frozen
embedding) is freed at its last gradient, since nothing then needs its frozen weights in backward.
Reentrant activation checkpointing runs the forward without autograd and recomputes it inside
backward, so a unit not watched in the forward is watched in its recomputation; non-reentrant
checkpointing backpropagates through the first forward's graph, so its recomputation is not watched.
Whatever a hook never reports (a forward with no backward after it) is freed by end_backward, as
unused units are. A unit that encloses other units (the root) is the exception: its frozen parameters
are read in the middle of backward and the gradient they carry goes into the units inside it, never
to its own inputs: a PEFT reward model's trainable score head (the root's) gets its gradient first,
and the frozen final norm is read right after it. Such a unit, when it has frozen parameters, stays
gathered until end_backward.

[Note: inference prefetch]
A forward without autograd (eval, ZeRO-Inference, HF `generate`, which calls the model directly and so
never passes through begin_forward) has no backward to prepare and may run many times between steps:
the order of its units is recorded on the first pass, until a unit runs a second time, separately from
the training order. On later passes each unit's pre-forward prefetches the units after it in that
order, and a pass starts again whenever the order's first unit runs. Nothing is enforced (every rank
runs the same model code, so the collectives still match): from a unit that is off the order the pass
is simply not prefetched (a unit the order does not hold at all means it was recorded from a shorter
pass, such as a module called on its own: the order is then recorded again from this pass), and a unit prefetched but not run is freed when the pass ends: when no call
of a unit's module is open any more (a module called on its own, [Note: calls below a unit's module]
in wrap.py, is a pass of its own), or when the next pass starts.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
from collections.abc import Callable, Mapping
from typing import NoReturn

import torch
from torch.utils._pytree import tree_flatten

from zeroshard.core.comm import CollectiveError
from zeroshard.core.gathered import LiveCount, reuse_offsets
from zeroshard.core.group import SpentGradients
from zeroshard.core.policy import GatheringPolicy, StagePolicy
from zeroshard.core.unit import InflightReductions, Unit, UnitState
from zeroshard.core.wrap import entry_modules, is_inside

log = logging.getLogger(__name__)


def _tensors_in(output) -> list[torch.Tensor]:
    """Tensors of a module output: pytree containers, and any Mapping (HuggingFace's ModelOutput is an
    OrderedDict that older transformers releases do not register with torch's pytree)."""
    if isinstance(output, Mapping):
        return [t for value in output.values() for t in _tensors_in(value)]
    leaves, _ = tree_flatten(output)
    if len(leaves) == 1 and leaves[0] is output:
        return [output] if isinstance(output, torch.Tensor) else []
    return [t for leaf in leaves for t in _tensors_in(leaf)]


tensors_in = _tensors_in  # for Sharded's output hooks ([Note: loss.backward() on the outputs] in sharded.py)


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class Lifecycle:
    def __init__(
        self,
        units: list[Unit],
        policy: StagePolicy,
        rank: int,
        world_size: int,
        *,
        limits: GatheringPolicy,
        overlap_comm: bool,
        max_inflight_reductions: int = 1,
    ):
        self.units, self.policy, self.rank, self.world_size = units, policy, rank, world_size
        self.limits = limits if overlap_comm else dataclasses.replace(limits, prefetch_numel=0)
        self.live = LiveCount()  # gathered elements of this model's units, now and at most
        self.spent = SpentGradients()  # shared by every unit's groups: [Note: spent full gradients reused]
        for unit in units:
            assert unit.state is not UnitState.GATHERING, unit.name
            unit.live = self.live
            self.live.add(unit.numel if unit.reshards and unit.state is UnitState.UNSHARDED else 0)
            for group in unit.groups:
                group.spent = self.spent
        self.max_inflight = max_inflight_reductions
        self.phase = Phase.IDLE
        # Set by Sharded after a forward whose outputs it hooked: a gradient reaching a unit before
        # Sharded's own output hook opens the backward through it ([Note: loss.backward() on the
        # outputs] in sharded.py). Cleared by the next forward or backward.
        self.backward_opener: Callable[[], None] | None = None
        self.grad_factor = 1.0  # multiplies each gradient as it is taken (a loss.backward() the engine scales)
        self.boundary = True  # reduce in this backward? (always at stages 2/3)
        # Keep units gathered until end_backward: a pipeline schedule's later micro-batches still
        # need the parameters their saved activations view (Sharded.backward_by_caller).
        self.hold_gathered = False
        # Keep units gathered after forwards without autograd: the whole model, gathered once for many
        # generation forwards (Sharded.gathered_model).
        self.keep_gathered = False
        self.forward_order: list[Unit] | None = None
        self.backward_order: list[Unit] | None = None
        self._recording: list[Unit] = []
        self._position = 0
        self._seen_in_backward: set[int] = set()
        self._inflight = InflightReductions()
        self._handles: list = []
        self._forward_grad = True  # was autograd on when begin_forward ran?
        self.inference_order: list[Unit] | None = None  # see [Note: inference prefetch]
        self._inference_recording: list[Unit] = []
        self._inference_next: int | None = None  # index in inference_order of the unit expected next
        self._retained: list[Unit] = []  # kept gathered from forward for backward (reuse distance)
        self._reuse: dict[int, tuple[int, int | None]] | None = None  # see reuse_offsets (gathered.py)
        self._forward_suffix: list[int] = []  # [i]: elements of forward_order[i:]
        self._input_watches: list = []  # multi-grad hook handles: [Note: frozen parameters in backward]
        self._watched_in_forward: set[int] = set()
        self._frozen_enclosing = {  # [Note: frozen parameters in backward]
            id(u) for u in units if u.frozen and any(o is not u and is_inside(o.name, u.name) for o in units)
        }
        self._open_calls: dict[int, list] = {}  # id(unit) -> its entry modules' calls in progress, outermost first
        self._units_in_call = 0  # units with a call in progress

    # -- registration ------------------------------------------------------------------------------
    def register(self) -> None:
        for unit in self.units:
            if unit.reshards and unit.module is not None:  # [Note: calls below a unit's module] in wrap.py
                params = {id(p) for group in unit.groups for p in group.params}
                for module in entry_modules(unit.module, params):
                    enter, leave = functools.partial(self._enter, unit), functools.partial(self._leave, unit)
                    self._handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
                    self._handles.append(module.register_forward_hook(leave, always_call=True))
            for group in unit.groups:
                for index, param in enumerate(group.params):
                    if param.requires_grad:
                        hook = functools.partial(self._on_grad, unit, group, index)
                        self._handles.append(param.register_post_accumulate_grad_hook(hook))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- forward -----------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        if self.phase is Phase.BACKWARD:
            raise RuntimeError("forward called while backward is still running")
        self.release_retained()  # a forward with no backward after it kept them
        self.phase = Phase.FORWARD
        self.backward_opener = None
        self._forward_grad = torch.is_grad_enabled()
        self._position = 0
        self._recording = []

    def end_forward(self) -> None:
        if self.forward_order is None and self._recording:
            self.forward_order = self._recording
            log.debug("forward unit order: %s", [u.name for u in self.forward_order])
        self.phase = Phase.IDLE

    def _training_forward(self) -> bool:
        return self.phase is Phase.FORWARD and torch.is_grad_enabled()

    def _inference_forward(self) -> bool:
        """A pass with no backward to come: see [Note: inference prefetch]. (A no-grad region inside a
        training forward, such as reentrant activation checkpointing, is not one.)"""
        outer_grad = self._forward_grad if self.phase is Phase.FORWARD else self.phase is Phase.BACKWARD
        return not torch.is_grad_enabled() and not outer_grad

    def _enter(self, unit: Unit, module, args, kwargs) -> None:
        """A call of one of `unit`'s entry modules begins; the outermost gathers the unit."""
        calls = self._open_calls.setdefault(id(unit), [])
        calls.append(module)
        if len(calls) == 1:
            self._units_in_call += 1
            self._pre_forward(unit, module, args)
            if unit.frozen:  # [Note: frozen parameters in backward]
                self._watch_inputs(unit, module, args, kwargs)

    def _leave(self, unit: Unit, module, args, output):
        """The call ends, normally or by an exception (the hook is always called); the outermost frees."""
        calls = self._open_calls.get(id(unit))
        if not calls or calls[-1] is not module:
            return None  # its pre-hook never ran: a hook before it raised
        calls.pop()
        if calls:
            return None  # an outer call still needs it
        self._units_in_call -= 1
        if unit.state is UnitState.GATHERING:
            return None  # its gather failed: the failure's cleanup frees it
        output = self._post_forward(unit, module, args, output)
        if self.inference_order and self._inference_forward() and not self._units_in_call:
            self._free_prefetched(self.inference_order)  # the pass is over: [Note: inference prefetch]
        return output

    def _pre_forward(self, unit: Unit, module, args) -> None:
        inference = self._inference_forward()
        if self._training_forward():
            self._check_order(unit)
        elif inference:
            self.release_retained()  # kept by a training forward that no backward followed
            self._follow_inference_order(unit)
        unit.unshard("backward" if self.phase is Phase.BACKWARD else "forward")
        training = self._training_forward() and self.forward_order is not None
        if (
            training and self.forward_order is not None
        ):  # issued before this unit's wait: [Note: prefetch before the wait]
            self._prefetch(self.forward_order, self._position, "forward")
        unit.wait_unshard()
        if not training and inference and self._inference_next is not None and self.inference_order is not None:
            self._prefetch(self.inference_order, self._inference_next, "forward")

    def _follow_inference_order(self, unit: Unit) -> None:
        order = self.inference_order
        if order is None:
            if not any(u is unit for u in self._inference_recording):
                self._inference_recording.append(unit)
                return
            order = self.inference_order = self._inference_recording  # a unit ran twice: a new pass
            log.debug("inference unit order: %s", [u.name for u in order])
        if unit is order[0]:
            self._free_prefetched(order)  # by the previous pass
            self._inference_next = 1
        elif (
            self._inference_next is not None
            and self._inference_next < len(order)
            and order[self._inference_next] is unit
        ):
            self._inference_next += 1
        else:
            if self._inference_next is not None and not any(u is unit for u in order):
                # Recorded from a shorter pass (a module called on its own): record this one instead.
                self._inference_recording = [*order[: self._inference_next], unit]
                self.inference_order = None
            self._inference_next = None  # off the recorded order: no prefetch for the rest of this pass

    @staticmethod
    def _free_prefetched(order: list[Unit]) -> None:
        """Free the units a pass prefetched and never ran."""
        for straggler in order:
            if straggler.state is UnitState.GATHERING:
                straggler.reshard()

    def _check_order(self, unit: Unit) -> None:
        position = self._position
        self._position += 1
        if self.forward_order is None:
            self._recording.append(unit)
            return
        expected = self.forward_order[position] if position < len(self.forward_order) else None
        if expected is not unit:
            raise RuntimeError(
                f"rank {self.rank}: unit '{unit.name}' ran as forward unit #{position}, where the first step ran "
                f"'{expected.name if expected else '(none)'}': zeroshard prefetches parameters in the "
                "recorded order, so every step (and every rank) must run units in the same order"
            )

    def _post_forward(self, unit: Unit, module, args, output):
        if self.phase is Phase.BACKWARD:  # recomputation (activation checkpointing): backward is next
            return output
        if torch.is_grad_enabled():
            self._hook_outputs(unit, output)
            if self._reused_soon(unit):
                self._retained.append(unit)
                return output
        elif self.keep_gathered:  # Sharded.gathered_model()
            return output
        unit.reshard()
        return output

    def release_retained(self) -> None:
        """Free the units a forward kept for a backward that did not come (a forward with autograd
        on and no backward, or a step or load that changed the shards under them)."""
        for unit in self._retained:
            if not self.hold_gathered:
                unit.reshard()
        self._retained.clear()

    def _reused_soon(self, unit: Unit) -> bool:
        """Keep `unit` gathered from its forward to its backward? See [Note: bounded gathering]."""
        if (
            not unit.reshards
            or self.phase is not Phase.FORWARD
            or self.backward_order is None
            or self.forward_order is None
        ):
            return False
        if self._reuse is None:
            self._reuse = reuse_offsets(self.forward_order, self.backward_order)
            self._forward_suffix = [0] * (len(self.forward_order) + 1)
            for i in range(len(self.forward_order) - 1, -1, -1):
                self._forward_suffix[i] = self._forward_suffix[i + 1] + self.forward_order[i].numel
        later_forward, before_backward = self._reuse.get(id(unit), (None, None))
        if before_backward is None or later_forward is None or later_forward >= self._position:
            return False  # no backward of its own, or it runs again in this forward: not looked for
        distance = self._forward_suffix[self._position] + before_backward
        if distance >= self.limits.reuse_distance:
            return False
        # Kept only if the next unit to run can still be gathered within max_live beside it.
        order, index = (
            (self.forward_order, self._position)
            if self._position < len(self.forward_order)
            else (self.backward_order, 0)
        )
        following = order[index]
        need = following.numel if following.state is UnitState.SHARDED and following is not unit else 0
        return self.limits.live_allows(self.live.numel, need)

    def _watch_inputs(self, unit: Unit, module, args, kwargs) -> None:
        """[Note: frozen parameters in backward]"""
        if not torch.is_grad_enabled():
            return
        if self.phase is Phase.FORWARD:
            self._watched_in_forward.add(id(unit))
        elif self.phase is not Phase.BACKWARD or id(unit) in self._watched_in_forward:
            return  # not a training pass, or a non-reentrant recomputation
        inputs = [t for t in _tensors_in(args) + _tensors_in(kwargs) if t.requires_grad]
        if not inputs:
            return
        unit.input_grads_pending += 1
        done = functools.partial(self._inputs_done, unit)
        self._input_watches.append(torch.autograd.graph.register_multi_grad_hook(inputs, done, mode="all"))

    def _inputs_done(self, unit: Unit, grads) -> None:
        if self.phase is not Phase.BACKWARD or unit.input_grads_pending == 0:
            return
        unit.input_grads_pending -= 1
        if unit.input_grads_pending == 0 and unit.grads_done and not self._held_in_backward(unit):
            unit.reshard()

    def _held_in_backward(self, unit: Unit) -> bool:
        """Kept gathered to the end of backward? [Note: frozen parameters in backward]"""
        return self.hold_gathered or id(unit) in self._frozen_enclosing

    def _clear_input_watches(self) -> None:
        for handle in self._input_watches:
            handle.remove()
        self._input_watches.clear()
        self._watched_in_forward.clear()
        for unit in self.units:
            unit.input_grads_pending = 0

    def _hook_outputs(self, unit: Unit, output) -> None:
        for tensor in _tensors_in(output):
            if tensor.requires_grad:
                tensor.register_hook(functools.partial(self._pre_backward, unit))

    # -- backward ----------------------------------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        self.phase = Phase.BACKWARD
        self.backward_opener = None
        self.boundary = boundary or self.policy.shard_gradients
        self._seen_in_backward.clear()
        self._recording = []
        for unit in self.units:
            unit.grads_pending = unit.trainable_params
            unit.grads_done = unit.trainable_params == 0
            unit.reduced_this_backward = False
            for group in unit.groups:
                group.set_aside_reduced_slice()  # stages 0/1; see its note in group.py

    # [Note: gradients from another backward]
    # A backward that is not this engine's can reach its parameters: a GAN's generator loss flows
    # through the discriminator, which has an engine of its own. torch accumulates such gradients in
    # `.grad`, and so do we at stages 0-2: they stay there (the script's `netD.zero_grad()` drops them,
    # as in torch), and what is still there at this engine's next backward is folded into the flat
    # buffer with that backward's gradient (the post-accumulate-grad hook sees the sum). At stage 3 a
    # unit's parameters are gathered only inside this engine's forward and backward, so such a
    # backward cannot be run; it stops with the cause named.
    def _outside_backward(self, unit: Unit) -> NoReturn:
        raise RuntimeError(
            f"rank {self.rank}: a backward reached unit '{unit.name}' of a stage-3 model outside its own "
            "backward: either another engine's backward flows through this model's parameters (a GAN's generator "
            "loss through the discriminator: detach() the input, or use stage 0-2 for that model), or "
            "loss.backward() was called on a loss not computed through the sharded model (compute it by calling "
            "the sharded model or the engine, not the module inside it)"
        )

    def _pre_backward(self, unit: Unit, grad):
        if self.phase is not Phase.BACKWARD:
            if self.backward_opener is None:
                self._outside_backward(unit)
            self.backward_opener()
        if id(unit) in self._seen_in_backward:
            return None
        self._seen_in_backward.add(id(unit))
        unit.unshard("backward")
        if self.backward_order is None:
            self._recording.append(unit)
        else:
            position = self.backward_order.index(unit) + 1 if unit in self.backward_order else 0
            if position:
                self._prefetch(self.backward_order, position, "backward")  # [Note: prefetch before the wait]
        unit.wait_unshard()
        return None

    def _on_grad(self, unit: Unit, group, index: int, param) -> None:
        if self.phase is not Phase.BACKWARD:
            if unit.reshards:
                self._outside_backward(unit)
            return  # stays in param.grad: see [Note: gradients from another backward]
        if unit.grads_pending == unit.trainable_params:
            # A new micro-batch's first gradient (backward_by_caller): the previous micro-batch's
            # reduction reads the full gradient buffer, so it completes first. No-op otherwise.
            unit.finish_reduce()
        if group.trainable:
            if group.full_grad is None and not group.grads_persist_full:
                self._inflight.take_landed()  # its new full gradient reuses theirs: [Note: taken as they land]
            group.add_grad(
                index,
                param.grad if self.grad_factor == 1.0 else param.grad * self.grad_factor,
                scale=1.0 / self.world_size if self.boundary else None,
            )
        param.grad = None  # the flat buffer owns the gradient now; free autograd's copy
        if not group.trainable:
            return
        unit.grads_pending -= 1
        if unit.grads_pending == 0:
            self._unit_backward_done(unit)
            # Re-armed for the next micro-batch of the same backward phase (a pipeline schedule runs
            # several inside `Sharded.backward_by_caller`); one backward() never gets here twice.
            unit.grads_pending = unit.trainable_params

    # [Note: one reduction in flight]
    # A unit's gradient reduction is issued when its backward is done and stays in flight while
    # backward goes on with the units before it; how many may stay in flight (`max_inflight`) bounds
    # the memory held by full gradients, which stages 2/3 free once their reduction is taken. There
    # unit k's reduction is waited for once k+1's (the next in backward order) is issued: two full
    # gradients at most, the one in flight and the one being filled. A second in flight would keep a
    # third alive and buy no time, since the link carries the reductions in turn and the second only
    # queues behind the first (measured: docs/multinode.md, "One reduction in flight";
    # docs/stage3_memory.md). Stages 0/1 are not bounded inside backward: their full gradient buffers
    # live across steps, so waiting frees nothing and only stalls backward (docs/performance.md); what
    # has completed is still taken as it lands ([Note: taken as they land]). With overlap_comm off the
    # bound is 0 at every stage: each reduction is waited for as soon as it is issued.
    def _unit_backward_done(self, unit: Unit) -> None:
        unit.grads_done = True
        if self.boundary:
            unit.reduce_grads(self.world_size)
            self._inflight.add(unit)
            self._inflight.take_landed()  # [Note: taken as they land]
            # Stages 0/1 with overlap_comm on wait for nothing here: [Note: one reduction in flight]
            if not (self.max_inflight and all(g.grads_persist_full for g in unit.groups)):
                self._inflight.keep_at_most(self.max_inflight)
        if unit.input_grads_pending == 0 and not self._held_in_backward(unit):  # [Note: frozen parameters in backward]
            unit.reshard()

    def end_backward(self) -> None:
        """Reduce what unused parameters held back, wait for all reductions, free everything."""
        for unit in self.units:
            # Not yet reduced, or a micro-batch left it partly reduced (unused parameters).
            partial = unit.grads_pending != unit.trainable_params or not unit.reduced_this_backward
            if unit.trainable_params and self.boundary and partial:
                self._unit_backward_done(unit)
        self._inflight.finish_all()
        self._clear_input_watches()
        for unit in self.units:
            unit.reshard()
        self._retained.clear()  # freed above with every other unit
        self.spent.clear()
        if self.backward_order is None and self._recording:
            self.backward_order = self._recording
        self.phase = Phase.IDLE

    def abort(self, wait: bool) -> None:
        """After a forward or backward raised, on this rank (see [Note: failed steps] in sharded.py):
        every unit's in-flight collectives completed (`wait`: every rank that got this far issued
        the same ones) or abandoned (a collective already failed: waiting again would only time out
        again), their results dropped, gathered parameters freed, nothing recorded from the
        partial pass. Raises the first CollectiveError met while waiting, after cleaning up."""
        self._inflight.clear()
        self._clear_input_watches()
        self._retained.clear()  # every unit is freed below
        self.spent.clear()
        self._recording = []
        self._seen_in_backward.clear()
        self.phase = Phase.IDLE
        self.grad_factor = 1.0  # a loss.backward() that raised never reached the callback resetting it
        self.backward_opener = None
        first = None
        for unit in self.units:
            try:
                unit.abort(wait=wait and first is None)
            except CollectiveError as error:
                first = first or error
        if first is not None:
            raise first

    # -- prefetch ----------------------------------------------------------------------------------
    # [Note: prefetch before the wait]
    # A training pass issues the prefetch of the units after the current one before it waits for the
    # current one's own gather, not after: otherwise, where the current unit was not prefetched (the
    # first unit of a forward, whose gather cannot start before the step that changes it, and the first
    # unit of a backward after a unit it did not keep), its gather and the next one's would run one
    # after the other with the link idle in between, and the next unit's compute would wait for both.
    # What is gathered at any moment is the same (the current unit counts as live from its `unshard`,
    # [Note: bounded gathering]); only the moment the next gather starts moves earlier. Without autograd
    # the order stays ([Note: inference prefetch]): the store's reads ahead decide the I/O's.
    def _prefetch(self, order: list[Unit], start: int, phase: str) -> None:
        """Gather ahead the units after `order[start - 1]`, within [Note: bounded gathering]."""
        limits = self.limits
        if limits.prefetch_numel <= 0:
            return
        ahead = 0  # elements gathered (or in flight) ahead of the unit being computed
        for unit in order[start:]:
            if ahead >= limits.prefetch_numel:
                break
            if unit.state is not UnitState.SHARDED:  # prefetched earlier, or kept for reuse
                ahead += unit.numel
                continue
            fits = ahead == 0 or ahead + unit.numel <= limits.prefetch_numel
            if not fits or not limits.live_allows(self.live.numel, unit.numel):
                break
            unit.unshard(phase)
            ahead += unit.numel
