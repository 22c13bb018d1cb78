"""The tags of the cross-rank collective check: what every rank says it is about to run.

[Note: asynchronous collective check]
Before each collective, every rank all-gathers a small tag (kind, bytes, a hash of the description
and the description's first bytes). Waiting for that exchange before launching the collective made
every collective a synchronisation point of the Python thread: the tag of unit k+1's reduction
queued behind unit k's reduction, so backward stopped overlapping communication (10% of a step at
stage 1, issue 12). Now the tag exchange is launched asynchronously just before the collective, on
the same process group, so it runs first, and it is verified when the collective's handle is
waited on, before its result is used. Ranks that diverged therefore still fail, every one of
them, with every rank's description — read from the exchanged tags themselves, so that reporting
needs no further collective, which could pair with the wrong partner once ranks have diverged.
Nothing here communicates.
"""
from __future__ import annotations

import zlib

import torch

TEXT_BYTES = 96  # of the description carried in the tag; enough for "all-gather of unit 'layers.17' ..."
_HEAD = 3  # int64 fields: kind id, bytes, crc32 of the full description
TAG_BYTES = _HEAD * 8 + TEXT_BYTES


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
        text = bytes(row[_HEAD * 8:].tolist()).rstrip(b"\0").decode(errors="replace")
        kind = kinds[kind_id] if 0 <= kind_id < len(kinds) else f"kind {kind_id}"
        out.append(f"{kind} of {nbytes} bytes for {text}")
    return out
