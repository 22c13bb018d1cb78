"""Block-wise symmetric int8 quantization for ZeRO++'s quantized collectives (Wang et al., arXiv
2306.10209, §3.1 qwZ and §3.3 qgZ): the kernels, pure arithmetic, and the quantized all-gather and
reduce-scatter, which compose a Communicator's own collectives (so they are counted and checked as
any other) and call no torch.distributed function.

[Note: block quantization]
A 1-D tensor is cut into blocks of `block` consecutive elements (the last one zero padded). Each
block b gets one fp32 scale s_b = max|x| over the block / 127, and each element is stored as
q = round(x / s_b), an int8 in [-127, 127]. Dequantized, x' = q * s_b, so |x - x'| <= s_b / 2 for
every element (round to nearest), and an all-zero block (s_b = 0) comes back exactly zero. Blocks,
rather than one scale per tensor, are what keeps the error local: one large weight only coarsens its
own block (the paper's block-based quantization, which it shows is needed for accuracy). The wire
format per block is `block` bytes of int8 plus 4 bytes of scale: at block = 256 that is 1.016 bytes
per element, 3.94x less than fp32 and 1.97x less than bf16.
"""

from __future__ import annotations

import torch

DEFAULT_BLOCK = 256
_QMAX = 127.0


def blocks_for(numel: int, block: int) -> int:
    """How many blocks `numel` elements take."""
    return -(-numel // block)


def quantize_into(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """x (1-D, any float dtype, numel n) -> q (int8, 1-D, numel blocks_for(n) * block) and scales
    (fp32, 1-D, numel blocks_for(n)); see [Note: block quantization]."""
    n, nblocks = x.numel(), scales.numel()
    assert nblocks == blocks_for(n, block) and q.numel() == nblocks * block, (n, nblocks, q.numel())
    padded = torch.zeros(nblocks * block, dtype=torch.float32, device=x.device)  # 1-D, n rounded up
    padded[:n].copy_(x)
    blocks = padded.view(nblocks, block)  # (nblocks, block)
    torch.amax(blocks.abs(), dim=1, out=scales).div_(_QMAX)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block stays zero
    q.view(nblocks, block).copy_(blocks.div_(safe[:, None]).round_().clamp_(-_QMAX, _QMAX))


def quantize(x: torch.Tensor, block: int = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) of a 1-D tensor; see `quantize_into`."""
    nblocks = blocks_for(x.numel(), block)
    q = torch.empty(nblocks * block, dtype=torch.int8, device=x.device)
    scales = torch.empty(nblocks, dtype=torch.float32, device=x.device)
    quantize_into(x, q, scales, block)
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, numel: int, block: int) -> torch.Tensor:
    """fp32, 1-D, `numel` elements: the values `quantize` encoded (padding dropped)."""
    nblocks = scales.numel()
    out = q.view(nblocks, block).to(torch.float32).mul_(scales[:, None])  # (nblocks, block)
    return out.view(-1)[:numel]


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, rows: int, numel: int, block: int) -> torch.Tensor:
    """`rows` quantized tensors laid end to end (what an all-gather or all-to-all of per-rank
    `quantize` outputs produces) -> fp32 of shape (rows, numel)."""
    nblocks = blocks_for(numel, block)
    out = q.view(rows, nblocks, block).to(torch.float32).mul_(scales.view(rows, nblocks, 1))
    return out.view(rows, nblocks * block)[:, :numel]


# -- quantized collectives: compositions of the Communicator's own collectives, which count and
# check them; this module calls no torch.distributed function ----------------------------------------
class Composite:
    """Several collectives that make one (int8 values and their scales), then a local `finish`
    (dequantization) once all have completed; waited like a `comm.Handle`."""

    def __init__(self, handles: list, finish):
        self._handles, self._finish = handles, finish

    def done(self) -> bool:
        return all(handle.done() for handle in self._handles)

    def wait(self) -> None:
        for handle in self._handles:
            handle.wait()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


def _started(handles: list, finish, async_op: bool) -> Composite:
    handle = Composite(handles, finish)
    if not async_op:
        handle.wait()
    return handle


def all_gather(
    comm,
    out: torch.Tensor,
    shard: torch.Tensor,
    what: str,
    block: int = DEFAULT_BLOCK,
    async_op: bool = False,
    keep=None,
) -> Composite:
    """qwZ: `comm.all_gather(out, shard)` with each rank's shard sent as int8 blocks and their fp32
    scales; `out` (any float dtype) receives the dequantized values when the handle is waited on,
    and `keep(q_all, scales_all)`, if given, what was received (hpZ's secondary copy)."""
    assert out.numel() == shard.numel() * comm.world_size, (out.numel(), shard.numel())
    q, scales = quantize(shard, block)
    return all_gather_encoded(comm, out, q, scales, what, comm.world_size, block, async_op, keep)


def all_gather_encoded(
    comm,
    out: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    what: str,
    rows: int,
    block: int = DEFAULT_BLOCK,
    async_op: bool = False,
    keep=None,
) -> Composite:
    """All-gather int8 blocks and scales already encoded (this rank's `rows / comm.world_size`
    quantized rows), then dequantize the `rows` rows into `out` (1-D, rows x numel)."""
    numel, world = out.numel() // rows, comm.world_size
    q_all = torch.empty(world * q.numel(), dtype=q.dtype, device=q.device)  # 1-D, rank-major
    scales_all = torch.empty(world * scales.numel(), dtype=scales.dtype, device=q.device)
    handles = [
        comm.all_gather(q_all, q, f"{what}, int8 blocks", async_op=True),
        comm.all_gather(scales_all, scales, f"{what}, block scales", async_op=True),
    ]

    def finish() -> None:
        out.view(rows, numel).copy_(dequantize_rows(q_all, scales_all, rows, numel, block))
        if keep is not None:
            keep(q_all, scales_all)

    return _started(handles, finish, async_op)


def reduce_scatter(
    comm, out: torch.Tensor, full: torch.Tensor, what: str, block: int = DEFAULT_BLOCK, async_op: bool = False
) -> Composite:
    """qgZ: `comm.reduce_scatter(out, full)` as one all-to-all of int8 blocks: each rank quantizes the
    N chunks of its `full`, sends chunk r to rank r, and sums the N dequantized chunks it receives in
    fp32, in rank order (deterministic). One quantization per gradient element, where the paper's
    hierarchical scheme (§3.3: intra-node all-to-all, reduce, requantize, inter-node all-to-all)
    quantizes twice so that the inter-node hop carries 1/(ranks per node) of the data; at one rank
    per node the two are the same."""
    assert full.numel() == out.numel() * comm.world_size, (full.numel(), out.numel())
    numel, world = out.numel(), comm.world_size
    nblocks = blocks_for(numel, block)
    q = torch.empty(world * nblocks * block, dtype=torch.int8, device=full.device)  # 1-D, chunk-major
    scales = torch.empty(world * nblocks, dtype=torch.float32, device=full.device)
    for r, chunk in enumerate(full.view(world, numel)):
        quantize_into(
            chunk, q[r * nblocks * block : (r + 1) * nblocks * block], scales[r * nblocks : (r + 1) * nblocks], block
        )
    q_in, scales_in = torch.empty_like(q), torch.empty_like(scales)
    handles = [
        comm.all_to_all(q_in, q, f"{what}, int8 blocks", async_op=True),
        comm.all_to_all(scales_in, scales, f"{what}, block scales", async_op=True),
    ]

    def finish() -> None:
        rows = dequantize_rows(q_in, scales_in, world, numel, block)  # (world, numel) fp32
        total = rows[0].clone()
        for row in rows[1:]:
            total.add_(row)
        out.copy_(total)

    return _started(handles, finish, async_op)
