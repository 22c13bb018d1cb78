"""The error every offload store raises, in a module of its own so that the store and its I/O
layer (offload/blockio.py) can both raise it."""

from __future__ import annotations


class StoreError(RuntimeError):
    """The store cannot hold or return a tensor (unwritable path, full disk, damaged swap file)."""
