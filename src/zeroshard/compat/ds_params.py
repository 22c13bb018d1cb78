"""DeepSpeed's read-only parameter metadata (`ds_id`, `ds_status`, `ds_numel`, `ds_shape`,
`ds_tensor`) on the parameters of a stage-3 engine, so that DeepSpeed-aware code (DeepSpeed-Chat's
save_zero_three_model, transformers, PEFT, Accelerate) finds them partitioned and gathers them with
`zero.GatheredParameters`.

[Note: DeepSpeed's parameter metadata]
STYLE.md habit 3 forbids state on nn.Parameter, with this one exception for compatibility: expose
these names read-only, backed by our objects, from the compatibility layer alone. How:
  * `register(sharded)` gives each parameter of a stage-3 engine the class `PartitionedParameter`
    (`param.__class__ = ...`), an nn.Parameter subclass that defines no storage and no attributes of
    its own: its properties look the answer up in `_PLACES`, a weak map parameter -> (weak reference
    to the Sharded object, unit, group, slot index) — the same pattern as core/registry.py's
    [Note: the parameter registry], with entries vanishing with their parameter. Nothing is set on
    the parameter's `__dict__`; `isinstance(p, nn.Parameter)` stays true; `ds_status` is derived
    from the unit's state at every read, so it cannot go stale.
    Why a class and not attributes: properties compute from the live unit, and a parameter that is
    no longer registered (engine destroyed, or a copy) simply has no `ds_id` (AttributeError, so
    `hasattr(p, "ds_id")` is False), as DeepSpeed-aware code expects of a plain parameter.
  * Pickling a parameter whose unit is sharded (`torch.save(param)`, `copy.deepcopy`) raises
    `NotGatheredError` naming the parameter and the ways to get full weights; gathered, it pickles as
    a plain nn.Parameter (no zeroshard type in the file).
  * `model.state_dict()` returns a sharded parameter as DeepSpeed does, an empty tensor, and warns
    (`PartitionedStateDictWarning`) with the same advice. Scripts written for DeepSpeed rely on it:
    DeepSpeed-Chat saves `model.state_dict()` on rank 0 and overwrites the file with gathered
    weights right after; PEFT's `save_pretrained` takes the whole state dict and keeps only the
    adapter's entries, which are whole when they are below the persistence threshold or gathered.
Every stage-3 parameter is registered, persistent ones too (their status is always AVAILABLE), as
DeepSpeed marks every parameter of a ZeRO-3 model; stages 0-2 register nothing (DeepSpeed neither).
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from zeroshard.compat.partition_parameters import ZeroParamStatus  # the enum scripts import
from zeroshard.core.unit import UnitState

_PLACES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # see [Note: DeepSpeed's parameter metadata]
_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sharded -> its state-dict hook handles


_STATUS = {
    UnitState.UNSHARDED: ZeroParamStatus.AVAILABLE,
    UnitState.SHARDED: ZeroParamStatus.NOT_AVAILABLE,
    UnitState.GATHERING: ZeroParamStatus.INFLIGHT,
}


class NotGatheredError(RuntimeError):
    """A partitioned parameter was pickled outside a gather."""


class PartitionedStateDictWarning(UserWarning):
    """`state_dict()` of a stage-3 model returned partitioned parameters as empty tensors."""


def _place(param):
    entry = _PLACES.get(param)
    sharded = entry[0]() if entry is not None else None
    if sharded is None or not sharded.owns(param):
        raise AttributeError("not a partitioned parameter of a live zeroshard engine")
    return entry[1:4]


_EMPTY_IN_STATE_DICT = (
    "state_dict() of a ZeRO stage-3 model: partitioned parameters come back as empty tensors, as in DeepSpeed. "
    "For full values gather them (`with zeroshard.zero.GatheredParameters(params): ...`), or save the full model "
    "with engine.save_16bit_model() / zeroshard.checkpoint.full_state_dict(engine)"
)


def _not_gathered(name: str) -> NotGatheredError:
    return NotGatheredError(
        f"parameter '{name}' is partitioned (ZeRO stage 3) and not gathered here: saving it would write an "
        "empty tensor. Gather it first (`with zeroshard.zero.GatheredParameters([param]): ...`), or save the "
        "full model with engine.save_16bit_model() / zeroshard.checkpoint.full_state_dict(engine), or save a "
        "checkpoint and run `zeroshard consolidate`"
    )


class PartitionedParameter(nn.Parameter):
    """A parameter of a stage-3 engine; see [Note: DeepSpeed's parameter metadata]."""

    @property
    def ds_id(self) -> int:
        _place(self)  # raises AttributeError when not registered
        return _PLACES[self][4]

    @property
    def ds_status(self) -> ZeroParamStatus:
        unit, _, _ = _place(self)
        return _STATUS[unit.state]

    @property
    def ds_numel(self) -> int:
        _, group, index = _place(self)
        return group.layout.slots[index].numel

    @property
    def ds_shape(self) -> torch.Size:
        _, group, index = _place(self)
        return group.layout.slots[index].shape

    @property
    def ds_tensor(self) -> torch.Tensor:
        """This rank's elements of the parameter: a 1-D view of its fp32 master shard (DeepSpeed's
        is in the compute dtype; zeroshard keeps no other copy). Empty where the rank holds none."""
        _, group, index = _place(self)
        slot = group.layout.slots[index]
        for piece, _lo, _hi, view in group.master_pieces():
            if piece is slot:
                return view.detach()
        return group.master.detach()[:0]

    def _check_gathered(self) -> None:
        try:
            unit, group, index = _place(self)
        except AttributeError:
            return  # no longer an engine's: whatever it holds is what it is
        if unit.state is not UnitState.UNSHARDED:
            raise _not_gathered(group.layout.slots[index].name)

    def __reduce_ex__(self, protocol):
        self._check_gathered()
        return nn.Parameter.__reduce_ex__(self, protocol)  # rebuilt as a plain nn.Parameter

    def __deepcopy__(self, memo):
        self._check_gathered()
        copied = nn.Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = copied
        return copied

    def __repr__(self) -> str:  # type: ignore[override]  # DeepSpeed's repr: no tensor_contents
        try:
            unit, group, index = _place(self)
        except AttributeError:
            return super().__repr__()
        if unit.state is UnitState.UNSHARDED:
            return super().__repr__()
        slot = group.layout.slots[index]
        return f"PartitionedParameter('{slot.name}', shape={tuple(slot.shape)}, status=NOT_AVAILABLE)"


def register(sharded) -> None:
    """Expose DeepSpeed's metadata on the parameters of a stage-3 `Sharded` (no-op below stage 3)."""
    if not sharded.policy.shard_parameters:
        return
    ref = weakref.ref(sharded)
    ds_id = 0  # the parameter's position in the engine's order, as DeepSpeed numbers them
    for unit in sharded._units:
        for group in unit.groups:
            for index, param in enumerate(group.params):
                _PLACES[param] = (ref, unit, group, index, ds_id)
                ds_id += 1
                if type(param) is nn.Parameter:
                    param.__class__ = PartitionedParameter
    owners = [
        m for m in sharded.module.modules() if any(type(p) is PartitionedParameter for p in m.parameters(recurse=False))
    ]
    _HOOKS[sharded] = [m.register_state_dict_post_hook(_check_state_dict) for m in owners]


def unregister(sharded) -> None:
    """After the engine is destroyed its parameters are plain nn.Parameters again."""
    for handle in _HOOKS.pop(sharded, []):
        handle.remove()
    for param, entry in list(_PLACES.items()):
        if entry[0]() is sharded or entry[0]() is None:
            del _PLACES[param]
            if type(param) is PartitionedParameter:
                param.__class__ = nn.Parameter  # type: ignore[assignment]  # a plain Parameter again: the point


def _check_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """Post-hook of `state_dict()` on each module owning partitioned parameters: warn when one comes
    back empty (see [Note: DeepSpeed's parameter metadata]). `state_dict(keep_vars=True)` returns the
    parameters themselves, which callers gather as they need (zeroshard's own checkpoint code does)."""
    for name, param in module.named_parameters(recurse=False):
        value = state_dict.get(prefix + name)
        if value is None or isinstance(value, nn.Parameter) or type(param) is not PartitionedParameter:
            continue
        try:
            unit, _, _ = _place(param)
        except AttributeError:
            continue
        if unit.state is not UnitState.UNSHARDED:
            warnings.warn(_EMPTY_IN_STATE_DICT, PartitionedStateDictWarning, stacklevel=4)
            return
