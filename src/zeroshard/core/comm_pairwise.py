"""The two-rank exchanges of the communication layer (core/comm.py): between two gloo ranks a
reduce-scatter and an all-gather are each one all-to-all of halves, sent in pieces.

[Note: reduce-scatter on gloo]
gloo's reduce_scatter_tensor is an all-reduce followed by a copy of this rank's slice: it sends
an all-reduce's bytes (docs/multinode.md: 1.5x DDP's at stages 1-2) and makes its input copy on
the calling thread (docs/performance.md). Between two ranks a reduce-scatter is one exchange:
each sends the other the half it owns and adds the half it receives, (N-1)/N of the buffer as
a ring sends, and the sum a + b is the all-reduce's bit for bit. So a gloo group of two ranks
takes that path (`pairwise`); other sizes and NCCL keep the backend's reduce-scatter. The
exchange is an all-to-all, a collective, not isend/irecv: point-to-point messages take no
place in gloo's sequence of collectives, so ranks that diverged (one failed mid-backward) met
each other's next collectives with buffers of different sizes, which aborts the process from
gloo's transport thread, instead of failing the consistency check (test_failures.py).

[Note: all-gather on gloo]
gloo's all_gather_into_tensor is its list all-gather: it allocates a flat buffer of the whole
output, gathers into it (copying this rank's shard in), then copies the buffer into the output's
chunks, all on its worker thread: per stage-3 gather of a 50 MB unit, 50 MB of fresh pages and
75 MB of copies more than the bytes it receives (benchmarks/profile_phases.py; docs/performance.md,
stage 3: 59 ms of process CPU against 34 ms for the exchange below, on a 2-core machine where
that thread takes its time from the compute). Between two ranks an all-gather is one exchange,
as the reduce-scatter is ([Note: reduce-scatter on gloo]): send the peer our shard, receive
theirs into their half of the output, and copy ours into our half (nothing when it is already
there, as at a stage-1/2 refresh). The same bytes as gloo's ring, no buffer of gloo's own, and
an all-to-all, so a collective in gloo's sequence like every other; sent in the reduce-scatter's
pieces (PAIRWISE_PIECE_BYTES: one large message ran at half a limited link's rate), which at
loopback costs 45-52 ms of process CPU per 50 MB against one message's 33 and gloo's 56.
Other sizes and NCCL keep the backend's all-gather.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# The pairwise exchange goes in pieces of at most this many bytes, all in flight at once: one
# message of a whole unit's half (6-17 MB for the 33.7M GPT) ran at half the link rate or less over
# a tbf-limited veth at 0.1 Gbit/s when both ranks sent at once (16 MB tensor: 1.26-1.40 s against
# 0.70 s for its bytes), and stages 1-3 were 1.5-1.9x DDP there with the same bytes; pieces of
# 512 KiB ran at the link rate (0.72-0.75 s), as gloo's own ring all-reduce, which pipelines
# chunks, does (docs/multinode.md).
PAIRWISE_PIECE_BYTES = 512 * 1024


class PairwiseReduceScatter:
    """A reduce-scatter between two ranks as one exchange: send the peer the half it owns, receive
    ours, add. See [Note: reduce-scatter on gloo]."""

    def __init__(self, out: torch.Tensor, full: torch.Tensor, rank: int, group):
        shard = out.numel()
        self.out, self.mine = out, full[rank * shard:(rank + 1) * shard]
        self.theirs = torch.empty_like(self.mine)
        send = full[(1 - rank) * shard:(2 - rank) * shard]
        piece = max(1, PAIRWISE_PIECE_BYTES // full.element_size())
        self.works = []
        for start in range(0, shard, piece):
            n = min(piece, shard - start)
            splits = [0, n] if rank == 0 else [n, 0]  # nothing to ourselves, the peer's half to it
            self.works.append(dist.all_to_all_single(self.theirs[start:start + n], send[start:start + n],
                                                     output_split_sizes=splits, input_split_sizes=splits,
                                                     group=group, async_op=True))

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        # g_mine + g_theirs: at two ranks the same sum, bit for bit, as an all-reduce's (a + b = b + a).
        torch.add(self.mine, self.theirs, out=self.out)


class PairwiseAllGather:
    """An all-gather between two ranks as one exchange: send the peer our shard, receive theirs
    straight into their half of `out`. See [Note: all-gather on gloo]."""

    def __init__(self, out: torch.Tensor, shard: torch.Tensor, rank: int, group):
        shard, numel = shard.reshape(-1), shard.numel()
        out = out.view(-1)  # 1-D, numel = 2 * shard numel
        theirs = out[(1 - rank) * numel:(2 - rank) * numel]
        piece = max(1, PAIRWISE_PIECE_BYTES // shard.element_size())  # in pieces, as the reduce-scatter
        self.works = []
        for start in range(0, numel, piece):
            n = min(piece, numel - start)
            splits = [0, n] if rank == 0 else [n, 0]  # nothing to ourselves, our shard to the peer
            self.works.append(dist.all_to_all_single(theirs[start:start + n], shard[start:start + n],
                                                     output_split_sizes=splits, input_split_sizes=splits,
                                                     group=group, async_op=True))
        mine = out[rank * numel:(rank + 1) * numel]
        if mine.data_ptr() != shard.data_ptr():  # in place (stages 1/2 refresh): already there
            mine.copy_(shard)  # while the exchange runs; the peer only reads `shard`, never `mine`

    def wait(self) -> None:
        for work in self.works:
            work.wait()
