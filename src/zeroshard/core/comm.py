"""The communication layer: the only module that calls torch.distributed collectives.

Every collective goes through a `Communicator`, which
  * counts bytes per collective kind, in the ZeRO paper's convention (§7: an all-reduce of Ψ elements
    moves 2Ψ, a reduce-scatter or all-gather Ψ) and as a ring algorithm really sends them
    ((N-1)/N of that), so a run can report its volume against DESIGN.md's table;
  * folds every collective's kind, size and description into a fingerprint that the optimizer
    step compares across ranks ([Note: collective fingerprint] in consistency.py), and in the
    debug mode (`check_collectives`) checks each collective across ranks with a tag exchange
    issued just before it and verified when it is waited on ([Note: asynchronous collective
    check]). Ranks that diverge (different unit order, a skipped backward) would otherwise
    deadlock or, worse, silently exchange the wrong tensors of equal size;
  * runs on its own process group with a bounded timeout, and turns every failure into a
    `CollectiveError` naming the rank, the collective and what it was for;
  * moves every tensor on the backend's device ([Note: staging host tensors] in staging.py);
  * between two gloo ranks runs the reduce-scatter and the all-gather as an exchange of halves, as
    backend.py decides and sizes it ([Note: reduce-scatter on gloo], [Note: all-gather on gloo]).
What it counts, and how, is comm_bytes.py's ([Note: bytes over the slow link]).
"""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.core import backend, consistency, liveness
from zeroshard.core.comm_bytes import KIND_ID, KINDS, ByteCounter
from zeroshard.core.staging import Staging

# torch 2.13 renamed the tensor collectives; older releases (>= 2.4, our floor) have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Reductions by name, so that callers never import torch.distributed for an op.
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class CollectiveError(RuntimeError):
    """A collective failed, timed out, or ranks disagreed about which collective comes next."""


class _Check:
    """The tag exchange of one collective, in flight ([Note: asynchronous collective check])."""

    def __init__(self, comm: Communicator, work, tags: torch.Tensor, what: str, started: float):
        self.comm, self.work, self.tags, self.what, self.started = comm, work, tags, what, started

    def verify(self) -> None:
        """Every rank ran the same collective; otherwise every rank raises, naming each one's."""
        try:
            self.work.wait()
        except Exception as error:
            raise self.comm.error(f"consistency check before {self.what}", self.started, error) from error
        if consistency.all_agree(self.tags):
            return
        lines = "\n".join(f"  rank {r}: {w}" for r, w in enumerate(consistency.describe(self.tags, KINDS)))
        raise CollectiveError(
            f"rank {self.comm.rank}: ranks diverged, they are not running the same collective:\n{lines}\n"
            "every rank must run the same units in the same order and call backward()/step() alike"
        )


def _exchange_pieces(send: int, receive: int, element_size: int, piece_bytes: int | None):
    """(start, sent, received) per message of a two-rank exchange in which this rank sends the peer
    `send` elements and receives `receive`: both ranks cut the longer of the two alike."""
    for start, n in backend.pieces(max(send, receive), element_size, piece_bytes):
        yield start, max(0, min(n, send - start)), max(0, min(n, receive - start))


def _splits(rank: int, n: int) -> list[int]:
    return [0, n] if rank == 0 else [n, 0]  # nothing to or from ourselves, n to or from the peer


class _Works:
    """Several collectives in flight as one: the pieces of a two-rank exchange, or the uneven
    all-gather's broadcasts ([Note: uneven slices] in flat.py; no backend has an all-gather of
    unequal pieces that gloo runs)."""

    def __init__(self, works: list):
        self.works = works

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class _PairwiseReduceScatter(_Works):
    """A reduce-scatter between two ranks as one exchange: send the peer the half it owns, receive
    ours, add. See [Note: reduce-scatter on gloo] in backend.py. The peer's half is received straight
    into `out` where `out` is a tensor of its own (stages 2/3: no temporary, whose fresh pages cost
    25 MB of first touches per 50 MB unit); into a temporary where `out` is our half of `full` (stage 1).
    `counts`: the two halves' sizes ([Note: uneven slices] in flat.py)."""

    def __init__(self, out: torch.Tensor, full: torch.Tensor, rank: int, group, piece_bytes, counts):
        starts = (0, counts[0])
        self.out, self.mine = out, full[starts[rank] : starts[rank] + counts[rank]]
        apart = out.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
        self.theirs = out if apart else torch.empty_like(self.mine)
        send = full[starts[1 - rank] : starts[1 - rank] + counts[1 - rank]]
        self.works = []
        pieces = _exchange_pieces(counts[1 - rank], counts[rank], full.element_size(), piece_bytes)
        for start, sent, received in pieces:
            self.works.append(
                dist.all_to_all_single(
                    self.theirs[start : start + received],
                    send[start : start + sent],
                    output_split_sizes=_splits(rank, received),
                    input_split_sizes=_splits(rank, sent),
                    group=group,
                    async_op=True,
                )
            )

    def wait(self) -> None:
        super().wait()
        # g_mine + g_theirs: at two ranks the same sum, bit for bit, as an all-reduce's (a + b = b + a).
        if self.theirs is self.out:
            self.out.add_(self.mine)
        else:
            torch.add(self.mine, self.theirs, out=self.out)


class _PairwiseAllGather(_Works):
    """An all-gather between two ranks as one exchange: send the peer our shard, receive theirs
    straight into their half of `out`. See [Note: all-gather on gloo] in backend.py."""

    def __init__(self, out: torch.Tensor, shard: torch.Tensor, rank: int, group, piece_bytes, counts):
        shard, out = shard.reshape(-1), out.view(-1)
        starts = (0, counts[0])
        theirs = out[starts[1 - rank] : starts[1 - rank] + counts[1 - rank]]
        self.works = []
        pieces = _exchange_pieces(counts[rank], counts[1 - rank], shard.element_size(), piece_bytes)
        for start, sent, received in pieces:
            self.works.append(
                dist.all_to_all_single(
                    theirs[start : start + received],
                    shard[start : start + sent],
                    output_split_sizes=_splits(rank, received),
                    input_split_sizes=_splits(rank, sent),
                    group=group,
                    async_op=True,
                )
            )
        mine = out[starts[rank] : starts[rank] + counts[rank]]
        if mine.data_ptr() != shard.data_ptr():  # in place (stages 1/2 refresh): already there
            mine.copy_(shard)  # while the exchange runs; the peer only reads `shard`, never `mine`


class Handle:
    """An in-flight collective; `wait()` raises `CollectiveError` with context on failure, first
    verifies the cross-rank check issued with it, and last copies staged outputs back."""

    def __init__(
        self,
        comm: Communicator,
        work,
        what: str,
        started: float,
        check: _Check | None = None,
        staging: Staging | None = None,
    ):
        self._comm, self._work, self.what, self._started, self._check = comm, work, what, started, check
        self._staging = staging

    def done(self) -> bool:
        """Has the collective (and its check) completed, so that `wait()` will not block? Asks, never waits."""
        return self._work is None or (
            self._work.is_completed() and (self._check is None or self._check.work.is_completed())
        )

    def wait(self) -> None:
        if self._work is None:
            return
        work, self._work = self._work, None
        blocked = time.monotonic()
        try:
            if self._check is not None:
                check, self._check = self._check, None
                try:
                    check.verify()
                except CollectiveError:
                    # The ranks diverged, but the collective still runs and writes into its output:
                    # let it end (bounded by the group's timeout) before the caller frees that buffer
                    # (a stage-3 reshard resizes it to nothing; writing there crashed a rank).
                    with contextlib.suppress(Exception):
                        work.wait()
                    raise
            work.wait()
        except Exception as error:  # gloo/NCCL raise RuntimeError subclasses; keep the cause
            raise self._comm.error(self.what, self._started, error) from error
        finally:
            self._comm.counter.wait_s += time.monotonic() - blocked
        if self._staging is not None:
            self._staging.finish()


class Communicator:
    """Collectives over one process group, with byte counting, consistency checks and timeouts."""

    def __init__(self, timeout_s: float = 300.0, check_collectives: bool = False, group=None):
        """Over the whole world by default, on a group of our own so that the timeout is ours, not
        the launcher's default of 30 minutes. `group`: an existing process group to run on instead
        (the data-parallel group of a device mesh); its timeout is the one it was created with."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: launch with `torchrun` (or call "
                "torch.distributed.init_process_group) before zeroshard.initialize"
            )
        self.timeout_s = timeout_s
        self.check_collectives = check_collectives
        self.fingerprint = 0  # of every collective run so far: [Note: collective fingerprint]
        self._owns_group = group is None
        liveness.announce(dist.get_rank(), timeout_s)  # see [Note: naming the missing ranks]
        if group is None:
            started = time.monotonic()
            try:  # [Note: start-up skew] in liveness.py
                liveness.meet_at_start(list(range(dist.get_world_size())), dist.get_rank(), timeout_s)
            except Exception as error:  # a rank gone, or late beyond every bound
                raise self._start_up_error("waiting for every rank at start-up", started, error) from error
            started = time.monotonic()
            try:
                group = dist.new_group(backend=dist.get_backend(), timeout=timedelta(seconds=timeout_s))
            except Exception as error:  # a rank that died before or while the group's connections form
                raise self._start_up_error("creating its process group", started, error) from error
        self.group = group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        # Where small control tensors must live: NCCL only moves CUDA tensors, gloo CPU ones.
        nccl = dist.get_backend(self.group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.counter = ByteCounter(self.world_size)
        # Set after this rank abandoned a forward or backward (Sharded._abort): its peers may still be
        # in theirs, so its next collective's check is verified before the collective is launched:
        # the asynchronous check would otherwise let collectives of different sizes meet, which gloo
        # answers by aborting the process. Cleared by the first check the ranks agree on.
        self.verify_before_launch = False
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        ranks_per_node = int(local) if local.isdigit() and int(local) > 0 else dist.get_world_size()
        if self._owns_group:
            self._agree_on_nodes(ranks_per_node, local)
        self.place_on_nodes(ranks_per_node)
        # [Note: reduce-scatter on gloo], [Note: all-gather on gloo] in backend.py
        self.pairwise = backend.pairwise(dist.get_backend(self.group), self.world_size)

    def _agree_on_nodes(self, ranks_per_node: int, local: str) -> None:
        """Every rank must place the ranks on nodes alike: the pairwise exchange's messages (one or
        pieces) and the node groups follow from it, and ranks that disagreed would meet collectives
        of different sizes, which gloo answers by aborting the process instead of an error."""
        seen = torch.tensor([ranks_per_node, -ranks_per_node], dtype=torch.int64, device=self.device)
        started = time.monotonic()
        try:  # the group's first collective: not counted, as no step's
            dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as error:
            raise self.error("agreeing on the ranks per node", started, error) from error
        if seen[0].item() != -seen[1].item():
            raise ValueError(
                f"rank {self.rank}: LOCAL_WORLD_SIZE={local!r} gives {ranks_per_node} ranks per node, "
                f"but other ranks see between {-seen[1].item()} and {seen[0].item()}: every node must "
                "run the same number of ranks (torchrun's --nproc_per_node)"
            )

    def global_ranks(self) -> list[int]:
        return [dist.get_global_rank(self.group, r) for r in range(self.world_size)]

    def place_on_nodes(self, ranks_per_node: int) -> None:
        """Nodes are runs of `ranks_per_node` global ranks: see [Note: bytes over the slow link]."""
        node = dist.get_rank() // ranks_per_node
        local = sum(1 for g in self.global_ranks() if g // ranks_per_node == node)
        self.ranks_per_node = ranks_per_node
        self.counter.off_node = (self.world_size - local) / self.world_size
        self.piece_bytes = backend.piece_bytes(local, self.world_size)  # of the pairwise exchange

    def split(self, rank_sets: list[list[int]]) -> Communicator:
        """A communicator over the set of `rank_sets` (ranks of this communicator's group, disjoint,
        covering it) that holds this rank. Every rank calls this with the same sets: torch builds
        each process group on every rank, member or not."""
        assert sorted(r for ranks in rank_sets for r in ranks) == list(range(self.world_size)), rank_sets
        members = self.global_ranks()
        mine = None
        for ranks in rank_sets:
            group = dist.new_group(
                [members[r] for r in ranks],
                backend=dist.get_backend(self.group),
                timeout=timedelta(seconds=self.timeout_s),
            )
            if self.rank in ranks:
                mine = group
        sub = Communicator(self.timeout_s, self.check_collectives, group=mine)
        sub._owns_group = True
        sub.place_on_nodes(self.ranks_per_node)
        return sub

    # -- collectives --------------------------------------------------------------------------------
    def all_gather(
        self,
        out: torch.Tensor,
        shard: torch.Tensor,
        what: str,
        async_op: bool = False,
        counts: tuple[int, ...] | None = None,
    ):
        """out (1-D, numel = world * shard.numel) <- every rank's `shard`. `shard` may be this rank's
        slice of `out` itself. `counts`: each rank's shard size where they differ ([Note: uneven
        slices] in flat.py); then `out` holds the shards back to back, sum(counts) elements."""
        counts = self._uneven(counts, out.numel(), shard.numel())
        stage = Staging(self.device, self.counter)
        staged_out, staged_shard = stage(out, read=False, written=True), stage(shard)

        def launch() -> Any:
            if self.pairwise:  # two gloo ranks: [Note: all-gather on gloo] in backend.py
                halves = counts or (shard.numel(), shard.numel())
                return _PairwiseAllGather(staged_out, staged_shard, self.rank, self.group, self.piece_bytes, halves)
            if counts is not None:
                return self._broadcast_pieces(staged_out, staged_shard, counts)
            return _all_gather(staged_out, staged_shard, group=self.group, async_op=True)

        return self._run("all_gather", out, what, async_op, launch, stage)

    def _uneven(self, counts: tuple[int, ...] | None, whole: int, piece: int) -> tuple[int, ...] | None:
        """`counts` where the ranks' pieces differ, None where they are alike (the even collectives);
        checked against the sizes of the whole tensor and of this rank's piece."""
        if counts is not None and len(set(counts)) > 1:
            assert len(counts) == self.world_size and whole == sum(counts), (counts, whole)
            assert piece == counts[self.rank], (counts, piece)
            return tuple(counts)
        assert whole == piece * self.world_size, (whole, piece)
        return None

    def _broadcast_pieces(self, out: torch.Tensor, shard: torch.Tensor, counts: tuple[int, ...]) -> _Works:
        starts = [sum(counts[:r]) for r in range(self.world_size)]
        mine = out[starts[self.rank] : starts[self.rank] + counts[self.rank]]
        if mine.data_ptr() != shard.data_ptr():
            mine.copy_(shard)
        return _Works(
            [
                dist.broadcast(
                    out[starts[r] : starts[r] + counts[r]],
                    src=dist.get_global_rank(self.group, r),
                    group=self.group,
                    async_op=True,
                )
                for r in range(self.world_size)
                if counts[r]
            ]
        )

    def reduce_scatter(
        self,
        out: torch.Tensor,
        full: torch.Tensor,
        what: str,
        async_op: bool = False,
        counts: tuple[int, ...] | None = None,
    ):
        """out (1-D, numel = full.numel() / world) <- this rank's slice of the sum of every rank's `full`.
        `out` may be that slice of `full` itself. `counts`: each rank's slice size where they differ
        ([Note: uneven slices] in flat.py); then the slices lie back to back in `full`."""
        counts = self._uneven(counts, full.numel(), out.numel())
        stage = Staging(self.device, self.counter)
        staged_out, staged_full = stage(out, read=False, written=True), stage(full)

        def launch() -> Any:
            if self.pairwise:  # two gloo ranks: [Note: reduce-scatter on gloo] in backend.py
                halves = counts or (out.numel(), out.numel())
                return _PairwiseReduceScatter(staged_out, staged_full, self.rank, self.group, self.piece_bytes, halves)
            if counts is not None:  # torch runs a list of unequal inputs on gloo and NCCL alike
                inputs = list(torch.split(staged_full, list(counts)))
                return dist.reduce_scatter(staged_out, inputs, group=self.group, async_op=True)
            return _reduce_scatter(staged_out, staged_full, group=self.group, async_op=True)

        return self._run("reduce_scatter", full, what, async_op, launch, stage)

    def all_to_all(self, out: torch.Tensor, full: torch.Tensor, what: str, async_op: bool = False):
        """out (1-D) <- chunk r of every rank's `full`, in rank order (r: this rank); equal chunks."""
        assert out.numel() == full.numel() and full.numel() % self.world_size == 0, (out.numel(), full.numel())
        stage = Staging(self.device, self.counter)
        staged_out, staged_full = stage(out, read=False, written=True), stage(full)
        return self._run(
            "all_to_all",
            full,
            what,
            async_op,
            lambda: dist.all_to_all_single(staged_out, staged_full, group=self.group, async_op=True),
            stage,
        )

    def all_reduce(
        self, tensor: torch.Tensor, what: str, op: str = "sum", async_op: bool = False, kind: str = "all_reduce"
    ):
        """`op`: "sum", "max" or "min"; `kind` "control" counts it apart from the model states' bytes."""
        if op not in _OPS:
            raise ValueError(f"all_reduce op {op!r} is not one of {sorted(_OPS)}")
        reduce_op = _OPS[op]
        stage = Staging(self.device, self.counter)
        staged = stage(tensor, written=True)
        return self._run(
            kind,
            tensor,
            what,
            async_op,
            lambda: dist.all_reduce(staged, op=reduce_op, group=self.group, async_op=True),
            stage,
        )

    def broadcast(self, tensor: torch.Tensor, src: int, what: str):
        """`src`: a rank of this communicator's group (torch wants the global rank)."""
        global_src = dist.get_global_rank(self.group, src)
        stage = Staging(self.device, self.counter)
        staged = stage(tensor, read=self.rank == src, written=self.rank != src)
        return self._run(
            "broadcast",
            tensor,
            what,
            False,
            lambda: dist.broadcast(staged, src=global_src, group=self.group, async_op=True),
            stage,
        )

    def shift(self, send: torch.Tensor, to: int, recv: torch.Tensor, source: int, what: str) -> Handle:
        """Send `send` to rank `to` while `recv` arrives from rank `source` (ranks of this group): one
        step of a ring, such as each rank's snapshot to its buddy on the next machine."""
        return self.exchange([(to, send)], [(source, recv)], what)

    def exchange(
        self,
        sends: list[tuple[int, torch.Tensor]],
        receives: list[tuple[int, torch.Tensor]],
        what: str,
    ) -> Handle:
        """Point to point: each `(to, tensor)` of `sends` goes to rank `to` while each `(source,
        tensor)` of `receives` fills from rank `source` (ranks of this group), all in flight together.
        Every rank calls it, with empty lists where it has nothing to move, so that the collective
        checks see it as one call; counted as an all-to-all, of which it is the sparse case, by the
        bytes this rank sends."""
        stage = Staging(self.device, self.counter)
        ops = [
            dist.P2POp(dist.isend, stage(tensor), dist.get_global_rank(self.group, to), self.group)
            for to, tensor in sends
        ]
        ops += [
            dist.P2POp(
                dist.irecv,
                stage(tensor, read=False, written=True),
                dist.get_global_rank(self.group, source),
                self.group,
            )
            for source, tensor in receives
        ]
        launch = lambda: _Works(dist.batch_isend_irecv(ops) if ops else [])  # noqa: E731
        sent = sum(tensor.numel() * tensor.element_size() for _, tensor in sends)
        return self._run("all_to_all", sent, what, False, launch, stage, sizes_differ=True)

    def all_gather_objects(self, obj, what: str) -> list:
        """Small Python objects (control data: manifests, error reports); counted as control."""
        check = self._start_check("control", 0, what)
        if check is not None:
            check.verify()
        out = [None] * self.world_size
        started = time.monotonic()
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as error:
            raise self.error(what, started, error) from error
        return out

    def barrier(self, what: str) -> None:
        self.all_reduce(torch.zeros(1, device=self.device), what, kind="control")

    # -- internals ------------------------------------------------------------------------------------
    def _run(
        self,
        kind: str,
        tensor: torch.Tensor | int,
        what: str,
        async_op: bool,
        launch,
        staging: Staging | None = None,
        sizes_differ: bool = False,
    ) -> Handle:
        """`tensor`: the tensor whose bytes the call moves, or their number. `sizes_differ`: each rank
        sends its own number of bytes (an exchange), so the ranks' checks compare the kind and
        description only."""
        nbytes = tensor if isinstance(tensor, int) else tensor.numel() * tensor.element_size()
        check = self._start_check(kind, 0 if sizes_differ else nbytes, what)  # queued first, not waited here
        if check is not None and self.verify_before_launch:
            check.verify()  # raises, launching nothing, if the ranks diverged
            check, self.verify_before_launch = None, False
        self.counter.add(kind, nbytes)
        started = time.monotonic()
        try:
            handle = Handle(self, launch(), what, started, check, staging)
        except Exception as error:
            raise self.error(what, started, error) from error
        if not async_op:
            handle.wait()
        return handle

    def _start_check(self, kind: str, nbytes: int, what: str) -> _Check | None:
        """Launch the exchange of every rank's tag for the collective about to run (see
        [Note: asynchronous collective check] in consistency.py)."""
        self.fingerprint = consistency.fold(self.fingerprint, KIND_ID[kind], nbytes, what)
        if not self.check_collectives or self.world_size == 1:
            return None
        tag = consistency.encode(KIND_ID[kind], nbytes, what, self.device)
        tags = torch.empty(self.world_size * tag.numel(), dtype=tag.dtype, device=self.device)
        started = time.monotonic()
        try:
            work = _all_gather(tags, tag, group=self.group, async_op=True)
        except Exception as error:
            raise self.error(f"consistency check before {what}", started, error) from error
        self.counter.add("control", tag.numel() * self.world_size)
        return _Check(self, work, tags, what, started)

    def error(self, what: str, started: float, cause: BaseException) -> CollectiveError:
        waited = time.monotonic() - started
        return CollectiveError(
            f"rank {self.rank}/{self.world_size}: collective '{what}' failed after {waited:.1f}s "
            f"(timeout {self.timeout_s:g}s; another rank may have crashed, skipped a call or run a "
            f"different unit); {self._missing()}: {cause}"
        )

    def _missing(self) -> str:
        """Which ranks of this group are gone: [Note: naming the missing ranks] in liveness.py."""
        try:
            ranks = self.global_ranks()
        except Exception:  # noqa: BLE001 - the group is already destroyed: ask about every rank
            ranks = list(range(dist.get_world_size()))
        return liveness.describe_missing(ranks, dist.get_rank(), self.timeout_s)

    def _start_up_error(self, what: str, started: float, cause: BaseException) -> CollectiveError:
        """A failure before this communicator has a group of its own (so no rank within it yet)."""
        missing = liveness.describe_missing(list(range(dist.get_world_size())), dist.get_rank(), self.timeout_s)
        return CollectiveError(
            f"rank {dist.get_rank()}/{dist.get_world_size()}: {what} failed after "
            f"{time.monotonic() - started:.1f}s (timeout {self.timeout_s:g}s); {missing}: {cause}"
        )

    def destroy(self) -> None:
        if self._owns_group and self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None
