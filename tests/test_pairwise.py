"""[Note: reduce-scatter on gloo]: between two gloo ranks the reduce-scatter is one exchange of halves,
bit for bit what gloo's own reduce-scatter (an all-reduce) gives, in place and into a separate shard;
other world sizes keep the backend's collective."""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.harness import run_distributed
from zeroshard.core.comm import PAIRWISE_PIECE_BYTES, Communicator


def _worker(rank: int, world: int, numel: int = 1000) -> dict:
    comm = Communicator(timeout_s=30)
    generator = torch.Generator().manual_seed(rank)
    full = torch.randn(world * numel, generator=generator) * 1e3  # large values: rounding shows
    expected = torch.empty(numel)
    dist.reduce_scatter_tensor(expected, full.clone())
    separate = torch.empty(numel)
    handles = [comm.reduce_scatter(separate, full, "separate", async_op=True)]
    in_place_full = full.clone()
    own = in_place_full[rank * numel:(rank + 1) * numel]
    handles.append(comm.reduce_scatter(own, in_place_full, "in place", async_op=True))
    for handle in handles:  # two in flight at once: their messages must not cross
        handle.wait()
    assert torch.equal(separate, expected) and torch.equal(own, expected)
    return {"pairwise": comm.pairwise, "reduce_scatter_bytes": comm.counter.paper["reduce_scatter"]}


def test_pairwise_reduce_scatter_is_the_collective_bit_for_bit():
    reports = run_distributed(_worker, 2)
    assert all(r["pairwise"] for r in reports)
    assert reports[0]["reduce_scatter_bytes"] == 2 * 2000 * 4  # the paper's convention: counted as before


def test_pairwise_exchange_in_pieces_is_the_collective_bit_for_bit():
    """A half larger than PAIRWISE_PIECE_BYTES goes in several pieces (here 3, the last one short)."""
    numel = 2 * PAIRWISE_PIECE_BYTES // 4 + 1000
    reports = run_distributed(_worker, 2, numel=numel)
    assert all(r["pairwise"] for r in reports)
    assert reports[0]["reduce_scatter_bytes"] == 2 * 2 * numel * 4


def test_four_ranks_keep_the_backend_reduce_scatter():
    reports = run_distributed(_worker, 4)
    assert not any(r["pairwise"] for r in reports)
