"""What the CPU backend does differently: gloo's collectives between two ranks, and flat groups sized
for glibc's allocator.

On a CPU run (gloo, host memory) zeroshard departs from the backend's defaults in two places:
  * a gloo group of two ranks exchanges halves instead of running gloo's reduce-scatter and all-gather
    ([Note: reduce-scatter on gloo], [Note: all-gather on gloo]), in one message within a node and in
    pieces across nodes ([Note: pieces across a link, one message within a node]);
  * the flat groups of a unit whose buffers are freed between uses are cut under glibc's mmap threshold
    ([Note: gathered buffers under glibc's mmap ceiling]).
The Communicator (comm.py) and shard_module (shard.py) ask the functions below; for NCCL and CUDA each
answers with the backend's own way (no exchange of halves, no cap on a flat group), so a GPU run follows
none of this. The module is named for the backend rather than for gloo because the second decision is
about host memory, not about gloo's collectives.

It decides and sizes only. The exchanges are collectives, so the Communicator launches, checks and
counts them (`_PairwiseReduceScatter`, `_PairwiseAllGather` in comm.py), the one module that calls
torch.distributed.
"""

from __future__ import annotations

import torch


# [Note: reduce-scatter on gloo]
# gloo's reduce_scatter_tensor is an all-reduce followed by a copy of this rank's slice: it sends
# an all-reduce's bytes (docs/multinode.md, "Bytes across the link") and makes its input copy on
# the calling thread (docs/performance.md). Between two ranks a reduce-scatter is one exchange:
# each sends the other the half it owns and adds the half it receives, (N-1)/N of the buffer as
# a ring sends, and the sum a + b is the all-reduce's bit for bit. So a gloo group of two ranks
# takes that path (`pairwise`); other sizes and NCCL keep the backend's reduce-scatter. The
# exchange is an all-to-all, a collective, not isend/irecv: point-to-point messages take no
# place in gloo's sequence of collectives, so ranks that diverged (one failed mid-backward) would
# meet each other's next collectives with buffers of different sizes, which aborts the process from
# gloo's transport thread, instead of failing the consistency check (test_failures.py).
#
# [Note: all-gather on gloo]
# gloo's all_gather_into_tensor is its list all-gather: it allocates a flat buffer of the whole
# output, gathers into it (copying this rank's shard in), then copies the buffer into the output's
# chunks, all on its worker thread: fresh pages for a whole output and copies beyond the bytes it
# receives, at every stage-3 gather, on a thread that takes its time from the compute where cores
# are few (measured: docs/performance.md, "Stage 3, and the exchanges between two gloo ranks";
# docs/bench/stage3_202m.txt). Between two ranks an all-gather is one exchange, as the
# reduce-scatter is ([Note: reduce-scatter on gloo]): send the peer our shard, receive theirs into
# their half of the output, and copy ours into our half (nothing when it is already there, as at a
# stage-1/2 refresh). The same bytes as gloo's ring, no buffer of gloo's own, and an all-to-all, so
# a collective in gloo's sequence like every other; sent as the reduce-scatter's exchange is, in
# pieces across nodes and as one message within a node ([Note: pieces across a link, one message
# within a node]). Other sizes and NCCL keep the backend's all-gather.
def pairwise(backend: str, world_size: int) -> bool:
    """Does a process group of `backend` with `world_size` ranks exchange halves instead of running the
    backend's reduce-scatter and all-gather ([Note: reduce-scatter on gloo], [Note: all-gather on gloo])?"""
    return backend == "gloo" and world_size == 2


# [Note: pieces across a link, one message within a node]
# Between two nodes the pairwise exchange goes in pieces of at most this many bytes, all in flight
# at once. Over a rate-limited link, one message of a whole unit's half runs at half the link rate or
# less when both ranks send at once, while pieces of 512 KiB run at the link rate, as gloo's own ring
# all-reduce, which pipelines chunks, does (measured: docs/multinode.md, "Bytes across the link").
# Within a node there is no link to pace, and each piece is a collective of its own with its
# dispatch and its wake-ups of gloo's threads: CPU the compute needs (measured: docs/performance.md,
# docs/bench/pieces_loopback.txt). So the two ranks of a pair on one node (`place_on_nodes`,
# torchrun's LOCAL_WORLD_SIZE) send one message, and only a pair across nodes sends pieces.
PAIRWISE_PIECE_BYTES = 512 * 1024


def piece_bytes(ranks_on_node: int, world_size: int) -> int | None:
    """The largest message of a pairwise exchange whose group has `ranks_on_node` of its `world_size`
    ranks on this node: pieces across nodes, one message (None) within one ([Note: pieces across a
    link, one message within a node])."""
    return PAIRWISE_PIECE_BYTES if ranks_on_node < world_size else None


def pieces(numel: int, element_size: int, piece_bytes: int | None) -> list[tuple[int, int]]:
    """(start, length) of each message of an exchange of `numel` elements: one when piece_bytes is None."""
    piece = max(1, numel if piece_bytes is None else piece_bytes // element_size)
    return [(start, min(piece, numel - start)) for start in range(0, numel, piece)]


# [Note: gathered buffers under glibc's mmap ceiling]
# A stage-3 unit's flat groups are gathered into a full buffer before each use and freed after it
# (their storage resized to nothing, [Note: parameter storage] in group.py), and at stages 2/3 a
# unit's full gradient lives from its first gradient to its reduction. On CPU that memory is
# glibc's: blocks above its largest mmap threshold (32 MiB on 64-bit) are mapped for each request
# and unmapped on free, so each such buffer touches fresh pages, zero-filled by the kernel one 4 KiB
# fault at a time, every step (measured: docs/performance.md, "Buffers under glibc's mmap ceiling").
# Blocks at or below the ceiling are served from the heap, and glibc raises its threshold to the
# largest one freed, so freed buffers are reused. Hence on CPU, at stages 2/3, a unit's parameters
# go into flat groups of at most GATHER_GROUP_BYTES each (gathered buffer or full gradient,
# whichever dtype is wider), split at parameter boundaries (a larger parameter has a group of its
# own). Stages 0/1 keep their full gradient for good, and stage 3's persistent unit is never
# gathered. CUDA's caching allocator reuses blocks of any size, so there a unit keeps one group per
# optimizer param group.
GATHER_GROUP_BYTES = 30 << 20  # under 32 MiB with room for the allocator's header and alignment


def flat_group_numel(device: torch.device, itemsize: int) -> int | None:
    """The most elements of `itemsize` bytes a flat group whose buffers are freed between uses holds on
    `device`: under glibc's mmap ceiling in host memory, no cap (None) elsewhere ([Note: gathered buffers
    under glibc's mmap ceiling])."""
    return GATHER_GROUP_BYTES // itemsize if device.type == "cpu" else None
