"""Whole-parameter optimizers (Muon) over flat groups: which param groups need whole parameters, the
matrices a rank owns as views of its master shard, and their state in the flat form checkpoints use.

A whole-parameter group's flat layout keeps each parameter inside its owner's slice ([Note:
whole-parameter ownership] in core/owners.py), so a rank's master shard holds whole matrices and
padding. The torch optimizer steps one view per owned matrix, shaped like the parameter, with the
matching view of the reduced gradient shard as its `.grad`; parameters owned elsewhere are not in
this rank's optimizer at all, so each update (Muon's Newton-Schulz) runs on exactly one rank.
Its per-parameter state (Muon's momentum) is the parameter's shape; `flat_state` lays it out like
the master, which is the form every checkpoint reader re-slices by parameter name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroshard.core.group import FlatGroup
from zeroshard.core.optim import declared, lowbit
from zeroshard.core.optim.muon import MuonWithAdamW


def whole_param_groups(optimizer: torch.optim.Optimizer | None) -> frozenset[int]:
    """Indices of the param groups whose update needs whole parameters."""
    needs = declared.whole_groups_rule(optimizer) if optimizer is not None else None
    if optimizer is None or needs is None:
        return frozenset()
    return frozenset(i for i, g in enumerate(optimizer.param_groups) if needs(g))


@dataclass(frozen=True)
class Owned:
    """A parameter whose update this rank computes."""

    slot: int  # index into group.layout.slots
    lo: int  # its elements in group.master: [lo, hi)
    hi: int
    view: torch.Tensor  # group.master[lo:hi] shaped like the parameter: what the torch optimizer steps


def owned(group: FlatGroup) -> list[Owned]:
    """The parameters of `group` that lie whole in this rank's master (all of them at stage 0)."""
    start, end = group.opt_range
    out = []
    for index, slot in enumerate(group.layout.slots):
        if start <= slot.offset and slot.offset + slot.numel <= end:
            lo, hi = slot.offset - start, slot.offset + slot.numel - start
            out.append(Owned(index, lo, hi, group.master[lo:hi].view(slot.shape)))
        elif slot.offset < end and start < slot.offset + slot.numel:
            raise AssertionError(f"'{slot.name}' is cut by this rank's shard: its flat group is not owner-aligned")
    return out


def state_keys(optimizer: torch.optim.Optimizer, index: int) -> tuple[tuple[str, ...], dict[str, torch.dtype]]:
    """The per-parameter state a step of param group `index` creates, asked of a twin over a 2 x 2
    matrix with the group's hyper-parameters: (the keys of tensors shaped like the parameter (Muon:
    momentum_buffer; Adam: exp_avg, exp_avg_sq), {scalar key: its dtype} (Adam: step))."""
    hyper = {k: v for k, v in optimizer.param_groups[index].items() if k != "params"}
    probe = torch.zeros(2, 2, requires_grad=True)
    group = [{**hyper, "params": [probe]}]
    if isinstance(optimizer, MuonWithAdamW):
        twin: torch.optim.Optimizer = MuonWithAdamW(group, muon=optimizer.muon_class)
    else:
        twin = type(optimizer)(group)  # type: ignore[call-arg]  # the subclass's constructor
    probe.grad = torch.ones(2, 2)
    twin.step()
    state = twin.state.get(probe, {})
    tensors = tuple(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == probe.shape)
    scalars = {
        k: v.dtype if isinstance(v, torch.Tensor) else torch.float64 for k, v in state.items() if k not in tensors
    }
    return tensors, scalars


def flat_state(
    state: dict,
    matrices: list[Owned],
    master: torch.Tensor,
    keys: tuple[str, ...] = (),
    quantized: list[bool] | None = None,
) -> dict:
    """One flat group's per-element optimizer state shaped like `master`: each owned parameter's
    tensors at its place, zeros elsewhere (also for `keys` no owned parameter has yet: a rank that
    owns nothing in the group, or whose parameters have had no gradient, saves what every other rank
    saves; Muon's momentum starts from zeros anyway); {} when `keys` is empty and nothing has state.
    `quantized`, per slot of the layout: its moments are block-wise, saved as `key.codes` and
    `key.scale` ([Note: block-wise optimizer states] in lowbit.py). Scalar state is not here
    (ZeroOptimizer.group_state adds it)."""
    quantized = quantized or []

    def zeros(dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(master.numel(), dtype=dtype, device=master.device)

    out: dict = {}
    for key in keys:
        if not all(quantized):  # some parameter keeps plain moments (all of them, without quantization)
            out[key] = zeros(master.dtype)
        if any(quantized):
            out[key + lowbit.CODES], out[key + lowbit.SCALE] = zeros(torch.uint8), zeros(torch.float32)
    for matrix in matrices:
        for name, piece in lowbit.entry_pieces(state.get(matrix.view, {})).items():
            if piece.shape not in (matrix.view.shape, (matrix.view.numel(),)):
                raise ValueError(f"optimizer state '{name}' is not shaped like its parameter: cannot be saved flat")
            if name not in out:
                out[name] = zeros(piece.dtype)
            out[name][matrix.lo : matrix.hi].copy_(piece.reshape(-1))
    return out


def load_flat_state(
    state: dict,
    matrices: list[Owned],
    flat: dict,
    optimizer: torch.optim.Optimizer | None = None,
    quantized: list[bool] | None = None,
    statuses: list[dict | None] | None = None,
) -> None:
    """Inverse of `flat_state`: each owned parameter's state from its place in `flat` (copies); a
    block-wise moment rebuilt in the optimizer's own buffer (from its codes and scales, or quantized
    from plain moments that another optimizer saved). `statuses`, per slot: its scalar state, None
    where it never stepped (it gets no state at all then); None for an optimizer without scalar
    state (Muon), whose parameters take what `flat` holds."""
    quantized = quantized or []
    moments = [k for k in flat if not k.endswith((lowbit.CODES, lowbit.SCALE))]
    moments += [
        k.removesuffix(lowbit.CODES)
        for k in flat
        if k.endswith(lowbit.CODES) and k.removesuffix(lowbit.CODES) not in moments
    ]
    for matrix in matrices:
        state.pop(matrix.view, None)
        status = statuses[matrix.slot] if statuses is not None else {}
        if not flat or status is None:
            continue
        mine: dict = {}
        blockwise = matrix.slot < len(quantized) and quantized[matrix.slot]
        for key in moments:
            piece = {
                name: flat[name][matrix.lo : matrix.hi]
                for name in (key, key + lowbit.CODES, key + lowbit.SCALE)
                if name in flat
            }
            if blockwise and key + lowbit.CODES in piece and lowbit.is_bnb(optimizer):
                mine.update(lowbit.rebuild_bnb(optimizer, matrix.view, key, piece))  # type: ignore[arg-type]
            elif blockwise and key + lowbit.CODES in piece:
                mine[key] = lowbit.rebuild(optimizer, matrix.view, key, piece)  # type: ignore[arg-type]
            elif blockwise and key in piece:  # plain moments of another optimizer: quantized now
                mine[key] = lowbit.quantized_from(optimizer, matrix.view, key, piece[key])  # type: ignore[arg-type]
            elif key in piece:
                mine[key] = piece[key].view(matrix.view.shape).clone()
            else:
                raise ValueError(
                    f"optimizer state '{key}' of a parameter with {matrix.view.numel()} elements is saved block-wise "
                    "only; this optimizer keeps it plain (another block_size?)"
                )
        mine.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in status.items()})
        state[matrix.view] = lowbit.own_scalars(optimizer, mine) if optimizer is not None else mine
