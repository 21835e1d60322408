"""A small decoder-only transformer built only from nn.Linear, nn.Embedding and norms.

The demo trains it, the tests compile it, and it is what "a model forge must handle"
looks like without downloading anything: every matmul weight is an ``nn.Linear``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True)
class TinyGPTConfig:
    vocab_size: int = 256
    """Byte-level tokens."""
    context: int = 128
    width: int = 128
    depth: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    tied_embeddings: bool = False
    """Share the token embedding with the output layer (GPT-2 style): forge cannot fuse it."""

    def __post_init__(self):
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not a multiple of heads {self.heads}")


class _Block(nn.Module):
    def __init__(self, cfg: TinyGPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.attn_norm = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=False)
        self.mlp_norm = nn.LayerNorm(cfg.width)
        self.up = nn.Linear(cfg.width, cfg.mlp_ratio * cfg.width)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class TinyGPT(nn.Module):
    """Example::

    model = TinyGPT(TinyGPTConfig(width=64, depth=2))
    logits = model(torch.randint(0, 256, (2, 16)))
    """

    def __init__(self, cfg: TinyGPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.width)
        self.positions = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        if cfg.tied_embeddings:
            self.head.weight = self.tokens.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.depth) if name.endswith(("proj.weight", "down.weight")) else 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def language_model_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over a [batch, context + 1] block of tokens."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def language_model_train_step(model: nn.Module, optimizer: torch.optim.Optimizer):
    """The ordinary training step: loss, backward, step, zero_grad; returns the detached loss."""

    def train_step(tokens: torch.Tensor) -> torch.Tensor:
        loss = language_model_loss(model, tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return train_step
