"""A minimal GPT-2-style causal language model (after nanoGPT), used by tests, the demo and benchmarks.

The model knows nothing about sharding: zeroshard is applied to it from outside (STYLE.md, habit 6).
Each `Block` is the natural wrap unit for stage 3.

Parameter count is the standard GPT-2 one: token embedding + position embedding + per block
(2 LayerNorm w+b, qkv W+b, attention proj W+b, MLP fc W+b, MLP proj W+b) + final LayerNorm w+b,
plus the head weight only when it is not tied to the token embedding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int  # longest sequence the position embedding covers
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2
    tie_weights: bool = True  # lm_head.weight is the same nn.Parameter as tok_emb.weight

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")


def tiny_gpt_config(**overrides) -> GPTConfig:
    """A model small enough for multi-rank CPU tests (~30k parameters, a step in milliseconds)."""
    fields: dict[str, Any] = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    fields.update(overrides)
    return GPTConfig(**fields)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))  # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # (B, T, C)
        return x + self.mlp(self.ln2(x))  # (B, T, C)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            # One nn.Parameter under two names; named_parameters() yields it once, as tok_emb.weight.
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nanoGPT's init. Walks named_parameters() so a tied weight is drawn once, in a fixed order."""
        # GPT-2 paper §2.3: residual projections scaled by 1/sqrt(N) with N residual layers (2 per block).
        proj_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        norm_weights = {id(m.weight) for m in self.modules() if isinstance(m, nn.LayerNorm)}
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=proj_std)
            elif p.dim() >= 2:  # Linear and Embedding weights
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif id(p) in norm_weights:
                nn.init.ones_(p)
            else:  # Linear and LayerNorm biases
                nn.init.zeros_(p)

    def num_parameters(self) -> int:
        """Unique parameters (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        # -1 marks positions without a target (padding), as in nanoGPT.
        loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Extend idx (B, T) by max_new_tokens tokens; temperature == 0 means greedy (argmax)."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]  # (B, <=block_size)
            logits = self(context)[:, -1, :]  # (B, V)
            if temperature == 0:
                next_idx = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_idx = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)  # (B, 1)
            idx = torch.cat((idx, next_idx), dim=1)  # (B, T + 1)
        return idx
