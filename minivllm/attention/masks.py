"""Attention masks as boolean matrices: mask[i, j] is True when query i may attend to key j.

Each chapter adds the mask of its idea; they are small enough to print, and plots.py draws them.
"""
from __future__ import annotations

import torch


def causal_mask(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[n, n] lower triangle: token i sees tokens 0..i (itself and its past, never the future)."""
    # BEGIN SOLUTION
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()
    # END SOLUTION


def chunk_mask(q_len: int, past: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[q_len, past + q_len]: a chunk of q_len new tokens after `past` cached ones. Query i
    (absolute position past + i) sees every cached token and the chunk up to itself.
    causal_mask(n) == chunk_mask(n, 0)."""
    # BEGIN SOLUTION
    return torch.ones(q_len, past + q_len, dtype=torch.bool, device=device).tril(diagonal=past)
    # END SOLUTION
