"""Plain attention over explicit keys and values with a boolean mask.

The math every later chapter reorganises: softmax(q k^T / sqrt(d) + mask) v.
"""
from __future__ import annotations

import math

import torch


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """q: [Tq, Hq, D]; k, v: [Tk, Hkv, D]; mask: [Tq, Tk] bool (True = may attend) or None.

    Returns [Tq, Hq, D]. With grouped-query attention (Hq = G * Hkv) each KV head serves G
    consecutive query heads; we view the queries as [Hkv, G * Tq] instead of copying K and V.
    """
    Tq, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    q = q.reshape(Tq, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * Tq, D)  # [Hkv, G*Tq, D]
    scores = q @ k.permute(1, 2, 0) / math.sqrt(D)  # [Hkv, G*Tq, Tk]
    if mask is not None:
        scores = scores.masked_fill(~mask.repeat(G, 1), float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype)  # softmax in fp32, also for bf16
    out = probs @ v.transpose(0, 1)  # [Hkv, G*Tq, D]
    return out.reshape(Hkv, G, Tq, D).permute(2, 0, 1, 3).reshape(Tq, Hq, D)
