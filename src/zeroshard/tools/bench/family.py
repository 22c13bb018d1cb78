"""The GPT family the side-by-side bench and `bench --sweep` scale along.

Member k has k layers of width 64k and k heads of 64 (k = 12 is GPT-2 small's shape), with the bench's
vocabulary and sequence length: 3.2M, 25M, 85M, 201M parameters for k = 4, 8, 12, 16 with the demo's
character vocabulary. The largest model that fits a memory cap is not modelled from this family: it is
tried, along the layers of a fixed width, by `bench --max-model` (maxmodel.py).
"""

from __future__ import annotations

from zeroshard.tools import estimator as est

HEAD_DIM = 64


def gpt_shape(size: int, vocab: int, seq_len: int) -> dict:
    """GPTConfig fields of family member `size`."""
    if size < 1:
        raise ValueError(f"model size must be >= 1, got {size}")
    return dict(vocab_size=vocab, block_size=seq_len, n_layer=size, n_head=size, n_embd=HEAD_DIM * size)


def num_params(size: int, vocab: int, seq_len: int) -> int:
    shape = gpt_shape(size, vocab, seq_len)
    return est.GPTSpec(
        vocab=vocab, n_layer=shape["n_layer"], n_embd=shape["n_embd"], n_head=shape["n_head"], block_size=seq_len
    ).num_params()
