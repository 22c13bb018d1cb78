"""Small models that exercise what trips ZeRO stage 3 up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH = 64, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 2 * WIDTH)
        self.proj = nn.Linear(2 * WIDTH, WIDTH)
        self.register_buffer("scale", torch.full((WIDTH,), 0.5))  # a buffer used in compute

    def forward(self, x):  # (B, T, C) -> (B, T, C)
        return x + self.proj(F.gelu(self.fc(self.ln(x)))) * self.scale


class LM(nn.Module):
    """Embedding, blocks, LM head tied to the embedding; `variant` adds one hard case."""

    def __init__(self, variant: str = "plain") -> None:
        super().__init__()
        self.variant = variant
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied embedding / LM head
        if variant == "shared_across_units":
            self.blocks[2].fc = self.blocks[0].fc  # one Linear in two units: owned by the root
        if variant == "unused":
            self.blocks[1].spare = nn.Linear(WIDTH, WIDTH)  # never called
        if variant == "frozen":
            self.blocks[0].requires_grad_(False)
            self.ln_f.weight.requires_grad_(False)

    def forward(self, idx, targets):
        h = self.emb(idx)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if self.variant == "called_twice" and i == 0:
                h = block(h)  # the same unit twice in one forward
        logits = self.head(self.ln_f(h))  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


VARIANTS = ["plain", "shared_across_units", "unused", "frozen", "called_twice"]
