"""How much of the model is gathered at stage 3: the count that `GatheringPolicy` (core/policy.py)
bounds, and what a unit kept for reuse saves.

[Note: bounded gathering]
`live` elements are those of resharding units that are GATHERING or UNSHARDED ([Note: unit states]):
the unit being computed, the units enclosing it (the root unit stays gathered while the blocks it
calls run), prefetched units and units kept for reuse. Units that never reshard (stages 0-2, the
persistent unit of small parameters) are model states, not counted. Three bounds, all in elements:

  * `prefetch_numel`: what is gathered *ahead* of the unit
    being computed, in the recorded order. The next unit is always prefetched when this is above 0,
    even if it alone is larger (so that its all-gather overlaps the current unit's compute, as
    DeepSpeed's prefetch issues at least one); further units while the total fits. 0: no prefetch.
  * `max_live_numel`: a prefetch or a reuse is only made while `live`
    stays within it. A unit about to be computed is always gathered, even if that alone takes `live`
    above the bound: computing it needs it (a bound below one unit means "no prefetch").
    None: no bound beyond the prefetch's.
  * `reuse_distance`: a unit whose forward ends is kept gathered for its
    backward when the units used in between (the rest of the forward, then the backward up to it, in
    the recorded orders) hold fewer than this many elements (DeepSpeed's test), and the next unit to
    run still fits within `max_live_numel` beside it. 0 frees every unit after its forward (the
    paper's schedule: each gathered twice a step); 1 keeps only what is reused at once: the root unit,
    whose backward begins where its forward ends (FSDP2 keeps its root unit gathered there too), and
    the unit that ran last in forward (the head unit, or the last block), whose backward comes right
    after the root's: the root encloses it, so is not counted as used in between (`reuse_offsets`).
    Reuse inside one forward or one backward is not looked for.

zeroshard's defaults (`GatheringPolicy()`, core/policy.py): the next unit prefetched, no element bound beyond it, reuse
distance 1; so at most the enclosing units + the current unit + the next one are live, FSDP2's
shape. DeepSpeed's defaults (5e7 prefetch, 1e9 live, 1e9 reuse) apply when a config gives them
(compat/policies.py), and then a small model may be gathered whole.
"""

from __future__ import annotations

from zeroshard.core.wrap import is_inside


class LiveCount:
    """Gathered elements now (`numel`) and the most since `reset_peak` (`peak`); the units update it
    on every transition into or out of SHARDED, so the peak is seen during forward and backward."""

    def __init__(self):
        self.numel = 0
        self.peak = 0

    def add(self, numel: int) -> None:
        self.numel += numel
        if self.numel > self.peak:
            self.peak = self.numel

    def remove(self, numel: int) -> None:
        self.numel -= numel
        assert self.numel >= 0, self.numel

    def reset_peak(self) -> None:
        self.peak = self.numel


def reuse_offsets(forward: list, backward: list) -> dict[int, tuple[int, int | None]]:
    """For `reuse_distance`: id(unit) -> (its last position in the forward order, elements of the
    units before its first use in the backward order, or None if it has none). A unit enclosing it
    (the root, around a head unit that runs last: [Note: the head is a unit] in wrap.py) is not
    counted: it is gathered around the unit's forward anyway, so keeping the unit adds nothing to it."""
    offsets: dict[int, tuple[int, int | None]] = {id(u): (i, None) for i, u in enumerate(forward)}
    for position, unit in enumerate(backward):
        last, seen = offsets.get(id(unit), (-1, None))
        if seen is None:
            before = sum(u.numel for u in backward[:position] if not is_inside(unit.name, u.name))
            offsets[id(unit)] = (last, before)
    return offsets
