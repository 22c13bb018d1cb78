"""[Note: reduce-scatter on gloo], [Note: all-gather on gloo]: between two gloo ranks the reduce-scatter
and the all-gather are one exchange of halves each, bit for bit what gloo's own collectives give, in
place and into a separate buffer; other world sizes keep the backend's collectives. The exchange is
one message within a node and pieces across nodes ([Note: pieces across a link, one message within a
node] in core/backend.py); every rank must place the ranks on nodes alike."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.harness import run_distributed
from zeroshard.core.backend import PAIRWISE_PIECE_BYTES
from zeroshard.core.comm import Communicator


def _worker(rank: int, world: int, numel: int = 1000, nodes: int = 1) -> dict:
    comm = Communicator(timeout_s=30)
    comm.place_on_nodes(world // nodes)  # as LOCAL_WORLD_SIZE = world / nodes would
    generator = torch.Generator().manual_seed(rank)
    full = torch.randn(world * numel, generator=generator) * 1e3  # large values: rounding shows
    expected = torch.empty(numel)
    dist.reduce_scatter_tensor(expected, full.clone())
    separate = torch.empty(numel)
    handles = [comm.reduce_scatter(separate, full, "separate", async_op=True)]
    in_place_full = full.clone()
    own = in_place_full[rank * numel : (rank + 1) * numel]
    handles.append(comm.reduce_scatter(own, in_place_full, "in place", async_op=True))
    messages = [len(h._work.works) for h in handles] if comm.pairwise else []
    for handle in handles:  # two in flight at once: their messages must not cross
        handle.wait()
    assert torch.equal(separate, expected) and torch.equal(own, expected)
    gathered = torch.empty(world * numel)
    handle = comm.all_gather(gathered, separate, "gather", async_op=True)
    messages += [len(handle._work.works)] if comm.pairwise else []
    handle.wait()
    reference = torch.empty(world * numel)
    dist.all_gather_into_tensor(reference, separate)
    assert torch.equal(gathered, reference)
    return {
        "pairwise": comm.pairwise,
        "reduce_scatter_bytes": comm.counter.paper["reduce_scatter"],
        "messages": messages,
    }


def _gather_worker(rank: int, world: int) -> dict:
    comm = Communicator(timeout_s=30)
    generator = torch.Generator().manual_seed(rank)
    cases = {
        "fp32": torch.randn(1000, generator=generator),
        "int8": torch.randint(-128, 128, (1000,), dtype=torch.int8, generator=generator),
        "bf16": torch.randn(999, generator=generator).to(torch.bfloat16),
    }
    checks = []
    for name, shard in cases.items():
        expected = torch.empty(world * shard.numel(), dtype=shard.dtype)
        dist.all_gather_into_tensor(expected, shard)
        separate = torch.full_like(expected, 7)  # stale values must all be overwritten
        in_place = torch.full_like(expected, 7)
        own = in_place[rank * shard.numel() : (rank + 1) * shard.numel()]
        own.copy_(shard)
        handles = [
            comm.all_gather(separate, shard, f"separate {name}", async_op=True),
            comm.all_gather(in_place, own, f"in place {name}", async_op=True),
        ]
        for handle in handles:  # two in flight at once: their messages must not cross
            handle.wait()
        checks.append(torch.equal(separate, expected) and torch.equal(in_place, expected))
    return {"pairwise": comm.pairwise, "equal": checks, "all_gather_bytes": comm.counter.paper["all_gather"]}


def test_pairwise_all_gather_is_the_collective_bit_for_bit():
    reports = run_distributed(_gather_worker, 2)
    assert all(r["pairwise"] and all(r["equal"]) for r in reports), reports
    # Counted in the paper's convention as before: the full tensor's bytes per all-gather.
    assert reports[0]["all_gather_bytes"] == 2 * (2000 * 4 + 2000 * 1 + 1998 * 2)


def test_four_ranks_keep_the_backend_all_gather():
    reports = run_distributed(_gather_worker, 4)
    assert all(not r["pairwise"] and all(r["equal"]) for r in reports), reports


def test_pairwise_reduce_scatter_is_the_collective_bit_for_bit():
    reports = run_distributed(_worker, 2)
    assert all(r["pairwise"] for r in reports)
    assert reports[0]["reduce_scatter_bytes"] == 2 * 2000 * 4  # the paper's convention: counted as before


def test_pairwise_exchange_in_pieces_across_nodes_one_message_within_is_the_collective_bit_for_bit():
    """Across two nodes a half larger than PAIRWISE_PIECE_BYTES goes in several pieces (here 3, the
    last one short); within a node, as one message."""
    numel = 2 * PAIRWISE_PIECE_BYTES // 4 + 1000
    for nodes, messages in ((2, 3), (1, 1)):
        reports = run_distributed(_worker, 2, numel=numel, nodes=nodes)
        assert all(r["pairwise"] and r["messages"] == [messages] * 3 for r in reports), (nodes, reports)
        assert reports[0]["reduce_scatter_bytes"] == 2 * 2 * numel * 4


def _nodes_worker(rank: int, world: int) -> dict:
    import os

    if rank == 1:  # a launch that gave the ranks different node sizes
        os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        Communicator(timeout_s=30)
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def test_ranks_placing_nodes_differently_is_an_error_on_every_rank():
    reports = run_distributed(_nodes_worker, 2)
    for report in reports:
        assert report["error"] and "LOCAL_WORLD_SIZE" in report["error"] and "between 1 and 2" in report["error"], (
            reports
        )


def test_four_ranks_keep_the_backend_reduce_scatter():
    reports = run_distributed(_worker, 4)
    assert not any(r["pairwise"] for r in reports)


def _uneven_worker(rank: int, world: int, counts: tuple, nodes: int = 1) -> dict:
    """[Note: uneven slices] in core/flat.py: both collectives with each rank's own slice size."""
    comm = Communicator(timeout_s=30)
    comm.place_on_nodes(world // nodes)
    counts = tuple(counts)
    starts = [sum(counts[:r]) for r in range(world)]
    mine = slice(starts[rank], starts[rank] + counts[rank])
    generator = torch.Generator().manual_seed(rank)
    full = torch.randn(sum(counts), generator=generator) * 1e3
    expected = full.clone()
    dist.all_reduce(expected)
    out = torch.full((counts[rank],), 7.0)
    comm.reduce_scatter(out, full, "uneven reduce-scatter", counts=counts)
    exact = torch.equal(out, expected[mine])
    close = torch.allclose(out, expected[mine], rtol=1e-6, atol=1e-3)
    placed = torch.zeros(sum(counts))
    placed[mine] = out
    dist.all_reduce(placed)  # each slice from its rank, zeros elsewhere: the gathered buffer exactly
    gathered = torch.full((sum(counts),), 7.0)  # stale values must all be overwritten
    comm.all_gather(gathered, out, "uneven all-gather", counts=counts)
    return {
        "pairwise": comm.pairwise,
        "reduce_exact": exact,
        "reduce_close": close,
        "gather_exact": torch.equal(gathered, placed),
        "bytes": dict(comm.counter.paper),
    }


def test_uneven_collectives_move_each_ranks_slice_and_count_no_padding():
    big = 2 * PAIRWISE_PIECE_BYTES // 4 + 1000  # several pieces across two nodes
    for world, counts, nodes in (
        (2, (700, 300), 1),
        (2, (0, 500), 1),
        (2, (big, 5), 2),
        (4, (5, 0, 700, 31), 1),
    ):
        reports = run_distributed(_uneven_worker, world, counts=counts, nodes=nodes)
        for report in reports:
            assert report["pairwise"] == (world == 2), report
            assert report["gather_exact"] and report["reduce_close"], (counts, report)
            if world == 2:  # a + b, as the all-reduce sums it
                assert report["reduce_exact"], (counts, report)
            numel = sum(counts)
            assert report["bytes"]["reduce_scatter"] == report["bytes"]["all_gather"] == 4 * numel, report
