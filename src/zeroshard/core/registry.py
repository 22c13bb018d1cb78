"""Which `Sharded` owns a parameter, and who holds the values of a parameter no `Sharded` owns yet.

A module of its own because both sides of the core use it: `Sharded.__init__` registers itself
(sharded.py), and `shard_module` (shard.py, which sharded.py imports) takes the held values of each
unit's parameters while it lays the unit out.

[Note: the parameter registry]
DeepSpeed keeps a parameter's partitioning state in `ds_*` attributes on the parameter; we refuse that
(STYLE.md, habit 3). `zeroshard.initialize(model=...)` and `GatheredParameters(params)` get no handle to
the Init context or to the engine, so this module and compat/zero/partition.py hold the one exception
to "no module globals": weak maps keyed by parameter identity (entries vanish with their parameter;
nothing keeps a model alive):
  * `_SHARDS` (compat/zero/partition.py): parameter -> ParamShard, while zero.Init partitions it (until
    initialize gathers it);
  * `_HOLDERS`: for the same parameters, the function that gives them their full values, so that the
    core gathers a model built under zero.Init unit by unit without knowing zero.Init;
  * `_ENGINES`: parameter -> weak reference to the engine that owns it (for GatheredParameters).
Process groups are not kept here: a Partition's communicator lives only while its Init context is open.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from zeroshard.core.comm import Communicator

# hand_over(params, comm): full values for `params` (all held by it), gathered over `comm`.
HandOver = Callable[[list, Communicator], None]

_HOLDERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # see [Note: the parameter registry]
_ENGINES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def hold(param: nn.Parameter, hand_over: HandOver) -> None:
    """`param`'s values are held outside any engine until `hand_over` gives them back in full."""
    _HOLDERS[param] = hand_over


def take_values(params: list, comm: Communicator) -> None:
    """Full values for the held ones among `params` (one unit), from whoever holds them; from now on
    the engine's flat groups own them."""
    held: dict[int, tuple[HandOver, list]] = {}  # id(hand_over) -> (hand_over, its params in order)
    for param in params:
        hand_over = _HOLDERS.get(param)
        if hand_over is not None:
            held.setdefault(id(hand_over), (hand_over, []))[1].append(param)
    for hand_over, mine in held.values():
        hand_over(mine, comm)
        for param in mine:
            del _HOLDERS[param]


def register_engine(engine) -> None:
    ref = weakref.ref(engine)
    for group in engine._groups:
        for param in group.params:
            _ENGINES[param] = ref


def engine_of(param):
    ref = _ENGINES.get(param) if isinstance(param, nn.Parameter) else None
    engine = ref() if ref is not None else None
    return engine if engine is not None and id(param) in engine._param_groups else None
