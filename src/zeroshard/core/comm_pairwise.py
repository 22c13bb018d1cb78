"""The exchange of halves between two gloo ranks, as a reduce-scatter and as an all-gather: part of
the communication layer, called only by comm.py's Communicator ([Note: reduce-scatter on gloo],
[Note: all-gather on gloo] there)."""
from __future__ import annotations

import torch
import torch.distributed as dist

# [Note: pieces across a link, one message within a node]
# Between two nodes the pairwise exchange goes in pieces of at most this many bytes, all in flight
# at once: one message of a whole unit's half (6-17 MB for the 33.7M GPT) ran at half the link rate
# or less over a tbf-limited veth at 0.1 Gbit/s when both ranks sent at once (16 MB tensor:
# 1.26-1.40 s against 0.70 s for its bytes), and stages 1-3 were 1.5-1.9x DDP there with the same
# bytes; pieces of 512 KiB ran at the link rate (0.72-0.75 s), as gloo's own ring all-reduce, which
# pipelines chunks, does (docs/multinode.md). Within a node there is no link to pace, and each piece
# is a collective of its own with its dispatch and its wake-ups of gloo's threads: over loopback the
# 33.7M GPT's process CPU fell 45-75 ms a step with one message per unit, and stage 1/2/3 went from
# 1.07/1.11/1.27x to 0.97-0.99/0.99-1.00/1.16-1.19x DDP (docs/performance.md, twelfth session). So
# the two ranks of a pair on one node (`place_on_nodes`, torchrun's LOCAL_WORLD_SIZE) send one
# message, and only a pair across nodes sends pieces.
PAIRWISE_PIECE_BYTES = 512 * 1024


def _pieces(numel: int, element_size: int, piece_bytes: int | None) -> list[tuple[int, int]]:
    """(start, length) of each message of an exchange of `numel` elements: one when piece_bytes is None."""
    piece = numel if piece_bytes is None else max(1, piece_bytes // element_size)
    return [(start, min(piece, numel - start)) for start in range(0, numel, max(piece, 1))]


class PairwiseReduceScatter:
    """A reduce-scatter between two ranks as one exchange: send the peer the half it owns, receive
    ours, add. See [Note: reduce-scatter on gloo]. The peer's half is received straight into `out`
    where `out` is a tensor of its own (stages 2/3: no temporary, whose fresh pages cost 25 MB of
    first touches per 50 MB unit); into a temporary where `out` is our half of `full` (stage 1)."""

    def __init__(self, out: torch.Tensor, full: torch.Tensor, rank: int, group, piece_bytes: int | None):
        shard = out.numel()
        self.out, self.mine = out, full[rank * shard:(rank + 1) * shard]
        apart = out.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
        self.theirs = out if apart else torch.empty_like(self.mine)
        send = full[(1 - rank) * shard:(2 - rank) * shard]
        self.works = []
        for start, n in _pieces(shard, full.element_size(), piece_bytes):
            splits = [0, n] if rank == 0 else [n, 0]  # nothing to ourselves, the peer's half to it
            self.works.append(dist.all_to_all_single(self.theirs[start:start + n], send[start:start + n],
                                                     output_split_sizes=splits, input_split_sizes=splits,
                                                     group=group, async_op=True))

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        # g_mine + g_theirs: at two ranks the same sum, bit for bit, as an all-reduce's (a + b = b + a).
        if self.theirs is self.out:
            self.out.add_(self.mine)
        else:
            torch.add(self.mine, self.theirs, out=self.out)


class PairwiseAllGather:
    """An all-gather between two ranks as one exchange: send the peer our shard, receive theirs
    straight into their half of `out`. See [Note: all-gather on gloo]."""

    def __init__(self, out: torch.Tensor, shard: torch.Tensor, rank: int, group, piece_bytes: int | None):
        shard, numel = shard.reshape(-1), shard.numel()
        out = out.view(-1)  # 1-D, numel = 2 * shard numel
        theirs = out[(1 - rank) * numel:(2 - rank) * numel]
        self.works = []
        for start, n in _pieces(numel, shard.element_size(), piece_bytes):  # as the reduce-scatter
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
