"""A corpus that is always present and a character-level tokenizer over it.

The text is the source of a fixed list of standard-library modules, read from the running interpreter's
`sysconfig.get_paths()["stdlib"]`, so the demo needs no download. Distributions that strip `.py` files
still ship docstrings, so the fallback is the docstrings of the same modules. The same interpreter always
yields the same corpus and the same vocabulary (sorted characters), so runs are reproducible.
"""

from __future__ import annotations

import importlib
import logging
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Small, plain-prose-heavy modules first; about 470 kB of text in CPython 3.11.
STDLIB_MODULES = (
    "textwrap",
    "string",
    "fnmatch",
    "shlex",
    "glob",
    "heapq",
    "bisect",
    "colorsys",
    "queue",
    "calendar",
    "difflib",
    "functools",
    "dataclasses",
    "argparse",
)


@dataclass(frozen=True)
class Corpus:
    text: str
    sources: tuple[str, ...]  # where the text came from, for the log and the result JSON


def load_corpus(modules: tuple[str, ...] = STDLIB_MODULES) -> Corpus:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, sources = [], []
    for name in modules:
        path = stdlib / f"{name}.py"
        if path.is_file():
            parts.append(path.read_text(encoding="utf-8", errors="replace"))
            sources.append(str(path))
    if not parts:  # no .py sources installed: docstrings are always there
        for name in modules:
            module = importlib.import_module(name)
            docs = [module.__doc__ or ""] + [getattr(v, "__doc__", "") or "" for v in vars(module).values()]
            parts.append("\n".join(d for d in docs if d))
            sources.append(f"docstrings of {name}")
    text = "\n".join(parts)
    log.debug("corpus: %d characters from %d sources", len(text), len(sources))
    return Corpus(text, tuple(sources))


class CharTokenizer:
    """One token per distinct character of the corpus, in sorted order; unknown characters map to '?'."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.unknown = self.index.get("?", 0)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index.get(c, self.unknown) for c in text], dtype=torch.long)  # (len,)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class Batches:
    """Random windows of the token stream; rank r draws from its own seeded generator (data parallelism:
    each rank sees different samples, every run sees the same ones)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch: int, seed: int, rank: int):
        if tokens.numel() <= seq_len + 1:
            raise ValueError(f"corpus of {tokens.numel()} tokens is too short for sequence length {seq_len}")
        self.tokens, self.seq_len, self.batch = tokens, seq_len, batch
        self.generator = torch.Generator().manual_seed(seed * 1000 + rank)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.batch,), generator=self.generator)
        offsets = torch.arange(self.seq_len)  # (T,)
        x = self.tokens[starts[:, None] + offsets]  # (B, T)
        y = self.tokens[starts[:, None] + offsets + 1]  # (B, T): the next character
        return x, y


def split(tokens: torch.Tensor, validation: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation): the last `validation` fraction is held out."""
    cut = int(tokens.numel() * (1 - validation))
    return tokens[:cut], tokens[cut:]
