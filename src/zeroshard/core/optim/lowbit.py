"""Block-wise quantized optimizer states: torchao's AdamW8bit, AdamW4bit, AdamWFp8 and their Adam
twins, and bitsandbytes' 8-bit optimizers (AdamW8bit, Adam8bit, ...), in the flat form checkpoints
hold.

[Note: block-wise optimizer states]
These optimizers keep each moment of a parameter quantized in blocks of `block_size` consecutive
elements of the flattened parameter: one code per element (8 bits; 4 bits, two to a byte; or fp8)
and one fp32 scale per block. A parameter with fewer than 4096 elements, or whose size is not a
multiple of the block, keeps plain fp32 moments. Stepping a flat shard, such an optimizer would see
one tensor per shard: other blocks, other scales, other choices of what to quantize than the same
optimizer stepping the model's parameters. So they are whole-parameter optimizers ([Note: declaring
a whole-parameter optimizer] in declared.py): each parameter lies whole in its owner's slice, the
owner steps it as a tensor of the parameter's shape, and every block, scale and choice is the
one-process optimizer's; the update equals it bit for bit.

A checkpoint re-slices optimizer state by parameter name, element by element ([Note: resharding by
element ranges] in checkpoint/reader.py), so a quantized moment `key` is saved as two elementwise
tensors: `key.codes` (uint8, one code per element, an fp8 code as its bit pattern) and `key.scale`
(fp32, each element its block's scale). That costs 5 bytes per element on disk against the 1.03 (or
0.53) in memory, and it is exact: dequantizing and quantizing again is not (the signed map has +1 and
no -1, so a block whose largest magnitude is negative would come back with another scale).
Loading builds the optimizer's own zero buffer for the parameter and fills its codes and scales.

[Note: bitsandbytes' 8-bit states]
bitsandbytes' 8-bit optimizers keep the same kind of state in plain tensors: `state1` (and `state2`,
for Adam the second moment) as uint8 codes shaped like the parameter, `absmax1` (`absmax2`) one fp32
scale per block of 256 elements (the last block may be short), `qmap1` (`qmap2`) the 256-value code
map every parameter shares, and `step` a Python int; a parameter under `min_8bit_size` elements keeps
fp32 `state1`/`state2`. They save as torchao's do: `state1.codes` and `state1.scale` per element; the
code maps are the optimizer's own and are not saved. bitsandbytes' per-parameter overrides
(`GlobalOptimManager.override_config`) are keyed by the original parameters, which zeroshard's
optimizer no longer steps: they do not apply.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# The torchao classes (and their subclasses) whose states are block-wise; matched by name, so that
# zeroshard never imports torchao: an optimizer of theirs exists only where the user imported it.
TORCHAO_MODULE = "torchao.optim"
TORCHAO_CLASSES = frozenset({"Adam8bit", "AdamW8bit", "Adam4bit", "AdamW4bit", "AdamFp8", "AdamWFp8"})
SIGNED_KEYS = frozenset({"exp_avg"})  # the first moment; the second (and AMSGrad's max) are >= 0
TORCHAO_KEYS = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"})
CODES, SCALE = ".codes", ".scale"
# bitsandbytes: every 8-bit optimizer derives from this class; (codes, scales, code map) per moment.
BNB_MODULE, BNB_BASE = "bitsandbytes.optim", "Optimizer8bit"
BNB_BLOCK = 256
BNB_MOMENTS = (("state1", "absmax1", "qmap1"), ("state2", "absmax2", "qmap2"))


def is_torchao_class(cls: type) -> bool:
    return any(c.__module__.startswith(TORCHAO_MODULE) and c.__name__ in TORCHAO_CLASSES for c in cls.__mro__)


def is_bnb_class(cls: type) -> bool:
    return any(c.__module__.startswith(BNB_MODULE) and c.__name__ == BNB_BASE for c in cls.__mro__)


def is_bnb(optimizer: object) -> bool:
    return is_bnb_class(type(optimizer))


def is_blockwise(value: object) -> bool:
    """A quantized state tensor (torchao's OptimState8bit, OptimState4bit, OptimStateFp8)."""
    return isinstance(value, torch.Tensor) and type(value) is not torch.Tensor and hasattr(value, "block_size")


def state_nbytes(value: Any) -> int:
    """Bytes a state tensor holds: a quantized one's codes and scales, not its fp32 appearance."""
    if is_blockwise(value):
        names, _ = value.__tensor_flatten__()
        return sum(getattr(value, name).numel() * getattr(value, name).element_size() for name in names)
    return value.numel() * value.element_size()


def inner(value: Any) -> dict[str, torch.Tensor]:
    """A quantized state's tensors by name: its codes, its block scales and its code map."""
    return {name: getattr(value, name) for name in value.__tensor_flatten__()[0]}


def over(value: Any, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A quantized state of `value`'s class and attributes over `tensors` (as `inner` names them)."""
    return type(value).__tensor_unflatten__(tensors, value.__tensor_flatten__()[1], None, None)


def clone(value: Any) -> torch.Tensor:
    """A copy of a quantized state (torchao's subclasses implement no aten.clone): its inner tensors
    cloned, its attributes kept."""
    return over(value, {name: tensor.clone() for name, tensor in inner(value).items()})


def copy_into(destination: Any, source: Any) -> None:
    """`destination`'s codes and scales (and code map) become `source`'s, in place."""
    for name in destination.__tensor_flatten__()[0]:
        getattr(destination, name).copy_(getattr(source, name))


def quantizes(optimizer: torch.optim.Optimizer, shape: torch.Size) -> bool:
    """Does `optimizer` keep a parameter of `shape` in block-wise states? Its own rule, asked of a
    buffer on the meta device (nothing allocated)."""
    if is_bnb(optimizer):
        args = optimizer.args  # type: ignore[attr-defined]  # a bitsandbytes class
        return args.optim_bits == 8 and math.prod(shape) >= args.min_8bit_size
    new_buffer = getattr(optimizer, "_new_buffer", None)
    if new_buffer is None or not is_torchao_class(type(optimizer)):
        return False
    return is_blockwise(new_buffer(torch.empty(shape, device="meta"), True))


def flat_pieces(key: str, value: Any) -> dict[str, torch.Tensor]:
    """A quantized state of one parameter as elementwise 1-D tensors of its numel ([Note: block-wise
    optimizer states])."""
    numel = value.numel()
    codes = value.codes.reshape(-1)
    if codes.dtype != torch.uint8:
        codes = codes.view(torch.uint8)  # fp8: the bit pattern
    if codes.numel() * 2 == numel:  # 4-bit: element 2i in the high nibble, 2i+1 in the low one
        codes = torch.stack([codes >> 4, codes & 0b1111], dim=-1).reshape(-1)
    if codes.numel() != numel:
        raise ValueError(f"optimizer state '{key}': {codes.numel()} codes for {numel} elements")
    return {key + CODES: codes, key + SCALE: value.scale.repeat_interleave(value.block_size)}


def new_buffer(optimizer: torch.optim.Optimizer, view: torch.Tensor, key: str) -> Any:
    """The zero buffer a torchao optimizer makes for `view`'s state `key` (quantized or plain, by its rule)."""
    return getattr(optimizer, "_new_buffer")(view, key in SIGNED_KEYS)  # noqa: B009 - a torchao class


def quantized_from(optimizer: torch.optim.Optimizer, view: torch.Tensor, key: str, values: torch.Tensor) -> Any:
    """`values` (plain moments, another optimizer's) in the optimizer's own buffer for `view`'s `key`."""
    if is_bnb(optimizer):
        raise ValueError(
            f"optimizer state '{key}' was saved in fp32 and {type(optimizer).__name__} (bitsandbytes) keeps it in "
            "8 bits here: load it with the min_8bit_size it was saved with"
        )
    buffer = new_buffer(optimizer, view, key)
    buffer.copy_(values.view(view.shape))
    return buffer


def rebuild(optimizer: torch.optim.Optimizer, view: torch.Tensor, key: str, pieces: dict) -> torch.Tensor:
    """The optimizer's own quantized buffer for `view`'s state `key`, filled from `flat_pieces`'s
    form (`pieces`: its two tensors, each of view.numel() elements)."""
    if key not in TORCHAO_KEYS:
        raise ValueError(
            f"optimizer state '{key}' was saved by another optimizer: {type(optimizer).__name__} (torchao) keeps "
            f"{', '.join(sorted(TORCHAO_KEYS))}"
        )
    buffer = new_buffer(optimizer, view, key)
    # A checkpoint reader may hand the codes over in the master's dtype: their values, 0-255, are exact.
    codes, scale = pieces[key + CODES].to(torch.uint8), pieces[key + SCALE].to(torch.float32)
    blocks = scale.view(-1, buffer.block_size)
    if not torch.equal(blocks, blocks[:, :1].expand_as(blocks)):  # a smaller block_size keeps every value
        raise ValueError(
            f"optimizer state '{key}{SCALE}' is not one scale per block of {buffer.block_size} elements: saved "
            "with a smaller block_size than this optimizer's"
        )
    if buffer.codes.numel() * 2 == codes.numel():
        codes = (codes[0::2] << 4) | codes[1::2]
    buffer.codes.copy_(codes.view(buffer.codes.dtype).view(buffer.codes.shape))
    buffer.scale.copy_(blocks[:, 0])
    return buffer


def entry_pieces(entry: dict) -> dict[str, torch.Tensor]:
    """One parameter's state tensors as elementwise 1-D tensors, the flat form ([Note: block-wise
    optimizer states]); scalars left out."""
    out: dict[str, torch.Tensor] = {}
    quantized = {codes for codes, _, _ in BNB_MOMENTS if _is_bnb_codes(entry.get(codes))}
    skipped = {k for codes, absmax, qmap in BNB_MOMENTS if codes in quantized for k in (absmax, qmap)}
    for key, value in entry.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or key in skipped:
            continue
        if key in quantized:  # [Note: bitsandbytes' 8-bit states]
            absmax = entry[dict((c, a) for c, a, _ in BNB_MOMENTS)[key]]
            out[key + CODES] = value.reshape(-1)
            out[key + SCALE] = absmax.repeat_interleave(BNB_BLOCK)[: value.numel()]
        elif is_blockwise(value):
            out.update(flat_pieces(key, value))
        else:
            out[key] = value
    return out


def _is_bnb_codes(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() > 0


def rebuild_bnb(optimizer: torch.optim.Optimizer, view: torch.Tensor, key: str, pieces: dict) -> dict:
    """A bitsandbytes moment `key` ("state1", "state2") of `view` from its flat form: its codes,
    block scales and the optimizer's code map ([Note: bitsandbytes' 8-bit states])."""
    known = {c: (a, q) for c, a, q in BNB_MOMENTS}
    if key not in known:
        raise ValueError(
            f"optimizer state '{key}' was saved by another optimizer: {type(optimizer).__name__} (bitsandbytes) keeps "
            f"{', '.join(known)}"
        )
    absmax_key, qmap_key = known[key]
    codes, scale = pieces[key + CODES].to(torch.uint8), pieces[key + SCALE].to(torch.float32)
    starts = scale[::BNB_BLOCK]
    if not torch.equal(scale, starts.repeat_interleave(BNB_BLOCK)[: scale.numel()]):
        raise ValueError(f"optimizer state '{key}{SCALE}' is not one scale per block of {BNB_BLOCK} elements")
    maps = optimizer.name2qmap  # type: ignore[attr-defined]  # a bitsandbytes class
    if "dynamic" not in maps:
        optimizer.fill_qmap()  # type: ignore[attr-defined]
    qmap = maps["dynamic" if key == "state1" else "udynamic"].to(view.device)
    return {key: codes.view(view.shape).clone(), absmax_key: starts.clone(), qmap_key: qmap}


def own_scalars(optimizer: torch.optim.Optimizer, entry: dict) -> dict:
    """`entry`'s scalars in the types the optimizer keeps (bitsandbytes counts `step` in an int)."""
    if is_bnb(optimizer) and isinstance(entry.get("step"), torch.Tensor):
        entry["step"] = int(entry["step"].item())
    return entry
