"""What every rank says it runs: the per-step fingerprint of its collectives, and the tags of the
cross-rank collective check (the debug mode). Nothing here communicates.

[Note: collective fingerprint]
Ranks whose code paths diverged (another unit order, a skipped backward) issue different
collectives. Where the sizes differ, gloo and NCCL fail the collective; where they match (two
blocks of one shape gathered in swapped order), the ranks would silently exchange the wrong
tensors. So every communicator folds each collective's kind, size and description into a running
CRC-32, and the optimizer step, which all-reduces the gradient norm anyway, adds two numbers to
that all-reduce: h and h*h of a 16-bit fold of the fingerprint. The ranks agree exactly when
N * sum(h*h) == sum(h)**2 (the sum over pairs of (h_i - h_j)**2 is zero), computed in Python
integers from fp64 sums that are exact for N < 2**21. A step after a divergence therefore fails on
every rank before it changes anything, at no extra collective or host sync; one in 65536
divergences goes unseen. The debug mode below names the first diverging collective on each rank.

[Note: asynchronous collective check]
With `check_collectives`, before each collective every rank all-gathers a small tag (kind, bytes,
a hash of the description and the description's first bytes). The tag exchange is launched
asynchronously just before the collective, on the same process group, so it runs first, and it is
verified when the collective's handle is waited on, before its result is used: waiting for it
before launching would make every collective a synchronisation point of the Python thread and
stop backward from overlapping communication. Ranks that diverged fail, every one of them, with
every rank's description, read from the exchanged tags themselves, so that reporting needs no
further collective, which could pair with the wrong partner once ranks have diverged. It costs one
more small all-gather per collective and, on a GPU, a host sync at each wait: a debug mode.
"""

from __future__ import annotations

import zlib

import torch

TEXT_BYTES = 96  # of the description carried in the tag; enough for "all-gather of unit 'layers.17' ..."
_HEAD = 3  # int64 fields: kind id, bytes, crc32 of the full description
TAG_BYTES = _HEAD * 8 + TEXT_BYTES


def fold(fingerprint: int, kind_id: int, nbytes: int, what: str) -> int:
    """The running fingerprint after one more collective ([Note: collective fingerprint])."""
    return zlib.crc32(f"{kind_id}:{nbytes}:{what}".encode(), fingerprint)


def fingerprint_terms(fingerprint: int) -> tuple[float, float]:
    """(h, h*h) of a 16-bit fold of `fingerprint`, to add to a sum all-reduce."""
    h = (fingerprint ^ (fingerprint >> 16)) & 0xFFFF
    return float(h), float(h * h)


def fingerprints_agree(sum_h: float, sum_h2: float, world_size: int) -> bool:
    """Did every rank add the same (h, h*h)? [Note: collective fingerprint]"""
    return world_size * int(sum_h2) == int(sum_h) ** 2


def encode(kind_id: int, nbytes: int, what: str, device: torch.device) -> torch.Tensor:
    """1-D uint8, numel = TAG_BYTES."""
    head = torch.tensor([kind_id, nbytes, zlib.crc32(what.encode())], dtype=torch.int64).view(torch.uint8)
    text = what.encode()[:TEXT_BYTES].ljust(TEXT_BYTES, b"\0")
    return torch.cat([head, torch.frombuffer(bytearray(text), dtype=torch.uint8)]).to(device)


def all_agree(tags: torch.Tensor) -> bool:
    """`tags`: (world * TAG_BYTES,) uint8, every rank's tag in rank order."""
    rows = tags.view(-1, TAG_BYTES)
    return bool((rows == rows[0]).all())


def describe(tags: torch.Tensor, kinds: tuple[str, ...]) -> list[str]:
    """Each rank's tag as text: '<kind> of <bytes> bytes for <description>'."""
    out = []
    for row in tags.view(-1, TAG_BYTES).cpu():
        kind_id, nbytes, _ = row[: _HEAD * 8].view(torch.int64).tolist()
        text = bytes(row[_HEAD * 8 :].tolist()).rstrip(b"\0").decode(errors="replace")
        kind = kinds[kind_id] if 0 <= kind_id < len(kinds) else f"kind {kind_id}"
        out.append(f"{kind} of {nbytes} bytes for {text}")
    return out
