"""The communication layer's byte bookkeeping: bytes per collective kind, in the ZeRO paper's
convention, as a ring sends them, and across the node boundary. No communication here: comm.py
counts each collective it runs.

[Note: bytes over the slow link]
Nodes (machines) are runs of `ranks_per_node` consecutive global ranks (torchrun's
LOCAL_WORLD_SIZE by default). For a collective over a group of N ranks of which m sit on this
rank's node, at least (N - m)/N of the paper-convention volume must cross this node's boundary
whatever the algorithm (that share of an all-gather's output comes from other nodes; that share of
an all-to-all's or reduce-scatter's input goes to them), so `ByteCounter.inter_node` counts that,
per kind: zero for a group inside one node (hpZ's secondary group, a MiCS shard group that fits a
node), everything for one rank per node.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "control", "all_to_all")
KIND_ID = {k: i for i, k in enumerate(KINDS)}
# Paper convention (ZeRO §7.1): all-reduce = reduce-scatter + all-gather = 2Ψ.
_PAPER_FACTOR = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2, "broadcast": 1, "control": 1, "all_to_all": 1}


@dataclass
class ByteCounter:
    """Bytes per collective kind, as seen by this rank."""

    world_size: int
    paper: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    wire: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    wait_s: float = 0.0  # time the calling thread spent blocked on collectives
    staged: int = 0  # bytes copied to and from the communicator's device ([Note: staging host tensors])
    off_node: float = 0.0  # (N - m)/N of [Note: bytes over the slow link]
    inter_node: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add(self, kind: str, nbytes: int) -> None:
        """`nbytes`: the size of the full (unsharded) tensor the collective is about."""
        self.paper[kind] += _PAPER_FACTOR[kind] * nbytes
        ring = (self.world_size - 1) / self.world_size
        self.wire[kind] += _PAPER_FACTOR[kind] * nbytes * ring
        self.inter_node[kind] += _PAPER_FACTOR[kind] * nbytes * self.off_node
        self.calls[kind] += 1

    def snapshot(self) -> dict[str, Any]:  # per kind, by measure; staged_bytes is one number
        return {
            "paper_bytes": dict(self.paper),
            "wire_bytes": dict(self.wire),
            "inter_node_bytes": dict(self.inter_node),
            "calls": dict(self.calls),
            "staged_bytes": self.staged,
        }

    def data_bytes(self) -> int:
        """Paper-convention bytes of the collectives that move model states (not control)."""
        return sum(v for k, v in self.paper.items() if k != "control")
