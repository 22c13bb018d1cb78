"""A store that keeps ZeRO-Inference's weights packed: 8- or 4-bit codes with a scale and minimum
per group, in the CPU or NVMe store underneath (DeepSpeed's `weight_quantization.quantized_initialization`).

[Note: quantized weight store]
The fp32 shard of a flat group (`master`) keeps its shape and dtype, so every consumer
(the gather in place at one rank, the all-gather at N, the loaders) works as with any store; only
its storage comes and goes. Between uses the store holds one uint8 tensor per shard in the inner
store (`blob`): each whole parameter of two or more dimensions quantized group-wise ([Note:
group-wise weight quantization] in inference/quantization.py: codes, then the fp32 scales, then the
minimums), everything else (vectors: norms and biases; padding) as raw fp32 bytes, each piece 16-byte
aligned. `prefetch`/`stage` start reading the blob (from NVMe: fewer bytes by the compression
ratio) and, on this store's own thread, grow the master's storage and dequantize into it, so the
dequantization of the next unit overlaps the current unit's compute; `ready` waits for it; `release`
quantizes a written (unfrozen) master back into the blob, releases the blob and frees the master's
storage (resized to zero bytes, as a gathered buffer is). Quantizing needs whole rows of whole
parameters: `shard()` lays these groups out with whole-parameter ownership ([Note: whole-parameter
ownership] in core/owners.py), and a piece of a parameter cut by the layout is stored raw. A fresh
blob is all zeros, which is a valid packed form of zeros (codes, scales and minimums 0), so
creating a store tensor touches nothing.
With `kernel` (`shard(packed_matmul=True)`), each 4-bit matrix torch's int4 CPU kernel can take is
laid out in the kernel's form instead (codes interleaved by blocks of rows, bf16 scales and zeros:
[Note: the int4 kernel's layout] in inference/int4.py); the model marks the ones its layers
multiply by as `direct`, and a forward's open (`prefetch_for_compute`) leaves those out of the
dequantization ([Note: packed matmuls] in inference/packed.py).

[Note: reused master buffers]
A master's fp32 storage grown for each use is fresh pages, and the first write to each page faults:
dequantizing one token's matrices of a 2.1 GB model took 0.59-0.66 s into fresh buffers and
0.18-0.23 s into buffers already mapped (docs/bench/dequantize.txt). So a released master's buffer
is kept for the next master of the same size (two a size, `KEEP_BYTES` in all, which a memory cap
counts): the tensors' contents are exchanged (`torch.utils.swap_tensors`, so each master stays the
same object), never copied. A buffer still viewed elsewhere cannot be exchanged; it is freed as
before. The nibbles of 4-bit codes go through one kept scratch buffer for the same reason.
"""

from __future__ import annotations

import enum
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from zeroshard.inference import int4
from zeroshard.inference.quantization import Quantized, QuantSpec, dequantize, quantize, unpack_codes

ALIGN = 16  # bytes: every piece of a blob starts on this, so fp32 views of it are aligned
KEEP_BYTES = 64 * 2**20  # freed master buffers kept for reuse: [Note: reused master buffers]
CHUNK = 2**20  # elements of a matrix quantized at once (`pack`)


@dataclass(frozen=True)
class _Piece:
    """One stretch of a master shard: elements [offset, offset + numel), quantized as `shape` or raw."""

    offset: int
    numel: int
    shape: tuple[int, ...] | None  # None: stored raw (fp32)
    at: int  # byte offset in the blob
    code_bytes: int = 0
    groups: tuple[int, int] = (0, 0)  # (rows, groups per row) of its scales
    minimums: bool = True  # asymmetric: a minimum per group after the scales
    kernel: bool = False  # in the int4 kernel's layout ([Note: the int4 kernel's layout])

    @property
    def nbytes(self) -> int:
        if self.shape is None:
            return self.numel * 4
        if self.kernel:
            return _aligned(self.code_bytes) + _aligned(self.groups[0] * self.groups[1] * 4)
        return _aligned(self.code_bytes) + (1 + self.minimums) * _aligned(self.groups[0] * self.groups[1] * 4)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan(numel: int, pieces, spec: QuantSpec, block: int | None = None) -> tuple[list[_Piece], int]:
    """How a master shard of `numel` elements, holding the whole parameters `pieces` ((offset, shape)
    pairs), is laid out in its blob: the pieces and the blob's size in bytes. `block`: the int4
    kernel's block size, to lay the matrices it can take out in its form (None: never)."""
    quantized = sorted((off, tuple(shape)) for off, shape in pieces if 2 <= len(shape) > spec.group_dim)
    out: list[_Piece] = []
    at = 0

    def raw(lo: int, hi: int) -> None:
        nonlocal at
        if hi > lo:
            out.append(_Piece(lo, hi - lo, None, at))
            at += _aligned((hi - lo) * 4)

    cursor = 0
    for offset, shape in quantized:
        raw(cursor, offset)
        count = math.prod(shape)
        length = shape[spec.group_dim]
        rows = count // length
        groups = (rows, -(-length // spec.group_size))
        kernel = int4.eligible(shape, spec, block)
        piece = _Piece(offset, count, shape, at, -(-count * spec.num_bits // 8), groups, not spec.symmetric, kernel)
        out.append(piece)
        at += piece.nbytes
        cursor = offset + count
    raw(cursor, numel)
    return out, max(at, 1)


class _State(enum.Enum):
    PACKED = "packed"  # only the blob holds the values; the master has no storage
    OPENING = "opening"  # the blob is being read and dequantized into the master
    OPEN = "open"  # the master holds the values (and may be written unless frozen)


@dataclass
class _Item:
    master: torch.Tensor
    blob: torch.Tensor
    pieces: list[_Piece]
    state: _State = _State.PACKED
    blank: bool = True  # the blob was never written: its values are zeros
    frozen: bool = False
    opening: Future | None = None
    direct: frozenset[int] = frozenset()  # offsets of pieces the int4 kernel reads from the blob
    skipped: bool = False  # open, with the `direct` pieces not dequantized into the master


class _Buffers:
    """Released masters' fp32 buffers by size: at most `PER_SIZE` of each and `limit` bytes in all
    ([Note: reused master buffers]). Each buffer is exchanged with a holder: a tensor of the same
    size whose storage is empty, kept for the next exchange, so none is allocated per use."""

    PER_SIZE = 2

    def __init__(self, limit: int):
        self.limit = limit
        self.bytes = 0
        self._free: dict[int, list[torch.Tensor]] = {}
        self._holders: dict[int, list[torch.Tensor]] = {}

    def grow(self, master: torch.Tensor) -> None:
        """Storage for `master` (whose storage is empty): a kept buffer if one fits, else fresh."""
        kept = self._free.get(master.numel())
        if kept:
            buffer = kept.pop()
            self.bytes -= buffer.numel() * 4
            torch.utils.swap_tensors(master, buffer)  # `buffer` is now an empty holder
            self._holders.setdefault(master.numel(), []).append(buffer)
            return
        master.untyped_storage().resize_(master.numel() * 4)

    def shrink(self, master: torch.Tensor) -> None:
        """Take `master`'s storage away, keeping the buffer when there is room and nothing views it."""
        numel, size = master.numel(), master.numel() * 4
        holders = self._holders.get(numel)
        if holders and len(self._free.get(numel, ())) < self.PER_SIZE and self.bytes + size <= self.limit:
            holder = holders.pop()
            try:
                torch.utils.swap_tensors(master, holder)
            except RuntimeError:  # a view of it is alive somewhere: free it instead
                holders.append(holder)
            else:
                self._free.setdefault(numel, []).append(holder)
                self.bytes += size
                return
        master.untyped_storage().resize_(0)
        if not holders and self.bytes + size <= self.limit:  # a holder, so the next one of this size is kept
            holder = torch.empty(numel, dtype=torch.float32)  # allocated where master's bytes were just freed
            holder.untyped_storage().resize_(0)
            self._holders.setdefault(numel, []).append(holder)

    def clear(self) -> None:
        self._free.clear()
        self._holders.clear()
        self.bytes = 0


class Scratch:
    """A reused uint8 buffer for the nibbles of 4-bit codes: a temporary per call is fresh pages
    whenever glibc maps large blocks afresh ([Note: reused master buffers])."""

    def __init__(self):
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def take(self, nbytes: int) -> torch.Tensor:
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes]


class QuantizedStore:
    """A `zeroshard.core.placement.Store` over `inner` (a CPU or NVMe store) whose fp32 tensors are
    kept packed ([Note: quantized weight store])."""

    def __init__(self, inner, spec: QuantSpec, keep_bytes: int = KEEP_BYTES, kernel: bool = False):
        """`kernel`: lay the matrices torch's int4 kernel can multiply by out in its form
        ([Note: the int4 kernel's layout]; only where this CPU's layout is known: `self.block`)."""
        self.inner = inner
        self.spec = spec
        self.block = int4.kernel_block() if kernel else None
        self._buffers = _Buffers(keep_bytes)
        self._scratch = Scratch()  # the dequantizing thread's own
        self.kind = f"{inner.kind}, int{spec.num_bits}"
        self.in_memory = inner.in_memory
        self._items: dict[int, _Item] = {}
        # One thread: units are dequantized in the order they are asked for (the gather order).
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="zeroshard-dequantize")
        self.packed_bytes = 0  # the blobs' bytes

    # -- what it holds ----------------------------------------------------------------------------
    @property
    def counters(self):
        return self.inner.counters

    @property
    def bytes_held(self) -> int:
        return self.inner.bytes_held

    @property
    def offloaded_bytes(self) -> int:
        return self.inner.offloaded_bytes

    def tensor(self, key: str, numel: int, dtype: torch.dtype, pieces=()) -> torch.Tensor:
        if dtype != torch.float32:
            raise ValueError(f"the quantized store holds fp32 weights, asked for {dtype} ({key})")
        layout, nbytes = plan(numel, pieces, self.spec, self.block)
        blob = self.inner.tensor(f"{key}.int{self.spec.num_bits}", nbytes, torch.uint8)
        master = torch.empty(numel, dtype=torch.float32)
        master.untyped_storage().resize_(0)
        self._items[id(master)] = _Item(master, blob, layout)
        self.packed_bytes += nbytes
        return master

    def holds(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._items

    def addressable_from(self, device: torch.device) -> bool:
        return self.inner.addressable_from(device)

    def resident(self, tensor: torch.Tensor) -> bool:
        return id(tensor) not in self._items  # a master's values live in its blob

    def held_bytes(self, tensor: torch.Tensor) -> int:
        item = self._items.get(id(tensor))
        if item is None:
            return tensor.numel() * tensor.element_size()
        return self.inner.held_bytes(item.blob)  # the packed form, when the inner store keeps it in memory

    def direct(self, master: torch.Tensor, offset: int) -> PackedWeight | None:
        """The piece of `master` at `offset`, to be multiplied by in its packed form from now on: a
        frozen master's use (`prefetch`/`stage`) no longer dequantizes it ([Note: packed matmuls]).
        None when the piece is not in the kernel's layout."""
        item = self._items[id(master)]
        piece = next((p for p in item.pieces if p.offset == offset and p.kernel), None)
        if piece is None:
            return None
        item.direct = item.direct | {offset}
        return PackedWeight(self, item, piece)

    def _mine(self, tensors) -> list[_Item]:
        return [self._items[id(t)] for t in tensors if id(t) in self._items]

    # -- uses ---------------------------------------------------------------------------------------
    def prefetch(self, tensors) -> None:
        self._open(tensors, self.inner.prefetch)

    def prefetch_for_compute(self, tensors) -> None:
        """`prefetch` for a forward that multiplies by the `direct` pieces packed: a frozen master's
        are left out of its dequantization ([Note: packed matmuls])."""
        self._open(tensors, self.inner.prefetch, packed=True)

    def stage(self, tensors) -> None:
        self._open(tensors, self.inner.stage)

    def _open(self, tensors, read, packed: bool = False) -> None:
        for item in self._mine(tensors):
            if item.state is not _State.PACKED:
                if item.skipped and not packed:  # open for compute, now wanted whole
                    self._complete(item)
                continue
            item.skipped = packed and item.frozen and bool(item.direct) and not item.blank
            if not (item.skipped and self._all_direct(item)):  # else no fp32 values at all: no storage
                self._buffers.grow(item.master)
            if item.blank:
                item.master.zero_()
                item.state = _State.OPEN
                continue
            read([item.blob])
            item.state = _State.OPENING
            item.opening = self._worker.submit(self._dequantize, item, item.direct if item.skipped else frozenset())

    def _dequantize(self, item: _Item, skip: frozenset[int]) -> None:
        self.inner.ready([item.blob])
        unpack(item.blob, item.pieces, self.spec, item.master, self._scratch, self.block, skip)

    @staticmethod
    def _all_direct(item: _Item) -> bool:
        return all(p.offset in item.direct for p in item.pieces)

    def _complete(self, item: _Item) -> None:
        """Dequantize the pieces an open for compute left out ([Note: packed matmuls])."""
        self.ready([item.master])
        if item.state is _State.OPEN:
            if not item.master.untyped_storage().nbytes():
                self._buffers.grow(item.master)
            kept = [p for p in item.pieces if p.offset in item.direct]
            unpack(item.blob, kept, self.spec, item.master, None, self.block)  # the worker owns _scratch
        item.skipped = False

    def ready(self, tensors) -> None:
        for item in self._mine(tensors):
            opening, item.opening = item.opening, None
            if opening is not None:
                try:
                    opening.result()
                except BaseException:
                    item.state = _State.PACKED
                    if item.master.untyped_storage().nbytes():
                        self._buffers.shrink(item.master)
                    raise
                item.state = _State.OPEN

    def release(self, tensors) -> None:
        mine = self._mine(tensors)
        self.ready([item.master for item in mine])
        for item in mine:
            if item.state is not _State.OPEN:
                continue
            if not item.frozen:
                pack(item.master, item.pieces, self.spec, item.blob, self.block)
                item.blank = False
            if item.master.untyped_storage().nbytes():
                self._buffers.shrink(item.master)
            item.state = _State.PACKED
            item.skipped = False
            self.inner.release([item.blob])

    def freeze(self, tensors, frozen: bool = True) -> None:
        mine = self._mine(tensors)
        if not frozen:  # about to be written: dequantize what the kernel read packed
            for item in mine:
                if item.skipped:
                    self._complete(item)
        for item in mine:
            item.frozen = frozen
        self.inner.freeze([item.blob for item in mine], frozen)

    def check(self, tensors) -> None:
        self.inner.check([item.blob for item in self._mine(tensors)])

    def wait(self) -> None:
        self.inner.wait()

    def destroy(self) -> None:
        self._worker.shutdown(wait=True)
        self._items.clear()
        self._buffers.clear()
        self.inner.destroy()


class PackedWeight:
    """A Linear weight that the int4 kernel reads from its store's blob ([Note: packed matmuls])."""

    def __init__(self, store: QuantizedStore, item: _Item, piece: _Piece):
        assert piece.shape is not None  # a matrix, not a raw stretch
        self._item, self._piece = item, piece
        self.shape = piece.shape
        self.group_size = store.spec.group_size
        self.block = store.block

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed codes (N, K/2), bf16 scales and zeros (K/g, N, 2)): valid while its master is in
        use (between the unit's gather and its release)."""
        if self._item.state is not _State.OPEN:
            raise RuntimeError(f"a packed weight of shape {list(self.shape)} was read while its unit is not gathered")
        return _views(self._item.blob, self._piece)[:2]


# -- the arithmetic between a master shard and its blob ---------------------------------------------
def _views(blob: torch.Tensor, piece: _Piece):
    """(codes, scale, minimum or None) views of `piece` in `blob`; for a piece in the int4 kernel's
    layout (codes (N, K/2), bf16 scales and zeros (K/g, N, 2), None)."""
    rows, groups = piece.groups
    codes = blob[piece.at : piece.at + piece.code_bytes]
    at = piece.at + _aligned(piece.code_bytes)
    if piece.kernel:
        scales = blob[at : at + rows * groups * 4].view(torch.bfloat16).view(groups, rows, 2)
        return codes.view(rows, -1), scales, None
    n = rows * groups * 4
    scale = blob[at : at + n].view(torch.float32).view(rows, groups)
    if not piece.minimums:
        return codes, scale, None
    minimum = blob[at + _aligned(n) : at + _aligned(n) + n].view(torch.float32).view(rows, groups)
    return codes, scale, minimum


def pack(
    master: torch.Tensor, pieces: list[_Piece], spec: QuantSpec, blob: torch.Tensor, block: int | None = None
) -> None:
    """Quantize `master`'s pieces into `blob` (`block`: the int4 kernel's, for pieces in its layout).
    A matrix whose groups run along its last dimension is quantized `CHUNK` elements of whole rows
    at a time: `quantize`'s temporaries are several times the values it takes, which for a 131 MB
    embedding outgrew a memory cap the packed model fits in. Groups never span rows, so the result
    is the whole matrix's, bit for bit."""
    for piece in pieces:
        values = master[piece.offset : piece.offset + piece.numel]
        if piece.shape is None:
            blob[piece.at : piece.at + piece.numel * 4].view(torch.float32).copy_(values)
            continue
        codes, scale, minimum = _views(blob, piece)
        rows = piece.groups[0]
        length = piece.numel // rows
        if spec.group_dim != len(piece.shape) - 1:
            _pack_rows(values.view(piece.shape), spec, codes, scale, minimum, piece.kernel, block)
            continue
        step = 2  # whole bytes of 4-bit codes
        if piece.kernel:
            assert block is not None
            step = block  # whole blocks of the kernel's rows
        step = max(step, CHUNK // length // step * step)
        per_row = length * spec.num_bits / 8
        for lo in range(0, rows, step):
            hi = min(lo + step, rows)
            chunk_codes = codes[lo:hi] if piece.kernel else codes[int(lo * per_row) : math.ceil(hi * per_row)]
            chunk_scale = scale[:, lo:hi] if piece.kernel else scale[lo:hi]
            chunk_min = None if minimum is None else minimum[lo:hi]
            part = values[lo * length : hi * length].view(hi - lo, length)
            _pack_rows(part, spec, chunk_codes, chunk_scale, chunk_min, piece.kernel, block)


def _pack_rows(values, spec: QuantSpec, codes, scale, minimum, kernel: bool, block: int | None) -> None:
    q = quantize(values, spec)
    if kernel:
        assert block is not None
        int4.to_kernel(q, block, codes, scale)
        return
    codes.copy_(q.packed)
    scale.copy_(q.scale.view(scale.shape))
    if minimum is not None:
        assert q.minimum is not None  # the same spec: asymmetric
        minimum.copy_(q.minimum.view(minimum.shape))


def unpack(
    blob: torch.Tensor,
    pieces: list[_Piece],
    spec: QuantSpec,
    master: torch.Tensor,
    scratch: Scratch | None = None,
    block: int | None = None,
    skip: frozenset[int] = frozenset(),
) -> None:
    """Dequantize `blob` into `master` (the inverse of `pack`, up to the quantization error), except
    the pieces at the offsets in `skip`."""
    scratch = scratch if scratch is not None else Scratch()
    for piece in pieces:
        if piece.offset in skip:
            continue
        out = master[piece.offset : piece.offset + piece.numel]
        if piece.shape is None:
            out.copy_(blob[piece.at : piece.at + piece.numel * 4].view(torch.float32))
            continue
        codes, scale, minimum = _views(blob, piece)
        if piece.kernel:
            assert block is not None
            int4.dequantize_kernel(codes, scale, spec.group_size, block, out.view(piece.shape))
            continue
        length = piece.shape[spec.group_dim]
        if spec.group_dim == len(piece.shape) - 1 and length % spec.group_size == 0:
            _dequantize_rows(codes, scale, minimum, spec, out, scratch)  # the common case
        else:
            q = Quantized(codes, scale, minimum, torch.Size(piece.shape), spec)
            out.copy_(dequantize(q).reshape(-1))


def _dequantize_rows(codes, scale, minimum, spec: QuantSpec, out: torch.Tensor, scratch: Scratch) -> None:
    """Groups are consecutive runs of `group_size` elements of `out`: broadcast each group's scale
    (and minimum) over its run."""
    rows, groups = scale.shape
    grouped = out.view(rows, groups, spec.group_size)
    if spec.num_bits == 8:
        grouped.copy_(codes.view(rows, groups, spec.group_size))
    elif spec.group_size % 2 == 0:  # each group's codes are whole bytes: low nibbles first
        pairs = grouped.view(rows, groups, spec.group_size // 2, 2)
        nibbles = scratch.take(codes.numel()).view(rows, groups, spec.group_size // 2)
        packed = codes.view(rows, groups, spec.group_size // 2)
        pairs[..., 0].copy_(torch.bitwise_and(packed, 0x0F, out=nibbles))
        pairs[..., 1].copy_(torch.bitwise_right_shift(packed, 4, out=nibbles))
    else:
        out.copy_(unpack_codes(codes, 4, out.numel()))
    if spec.symmetric:
        grouped.sub_(spec.levels + 1)
    grouped.mul_(scale[:, :, None])
    if minimum is not None:
        grouped.add_(minimum[:, :, None])
