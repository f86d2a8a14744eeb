"""Attention masks as boolean matrices: mask[i, j] is True when query i may attend to key j.

Each chapter adds the mask of its idea; they are small enough to print, and minivllm/course/plots/masks.py draws them.
"""
from __future__ import annotations

import torch


def causal_mask(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[n, n] torch.bool lower triangle on `device`: mask[i, j] is True when token i may attend
    to token j, that is when j <= i (itself and its past, never the future)."""
    # BEGIN SOLUTION
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()
    # END SOLUTION


def chunk_mask(q_len: int, past: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[q_len, past + q_len] torch.bool on `device`: a chunk of q_len new tokens after `past`
    cached ones. Query i (absolute position past + i) sees every cached token (columns
    0..past-1) and the chunk up to itself (columns past..past+i). causal_mask(n) == chunk_mask(n, 0)."""
    # BEGIN SOLUTION
    return torch.ones(q_len, past + q_len, dtype=torch.bool, device=device).tril(diagonal=past)
    # END SOLUTION


def padded_causal_mask(lengths: list[int], device: torch.device | str | None = None) -> torch.Tensor:
    """[B, L, L] torch.bool on `device`, for B sequences left-padded to L = max(lengths):
    row b starts with L - lengths[b] padding slots, then its real tokens. mask[b, i, j] is True
    when query i of row b may attend to key j. Real queries are causal among the real tokens
    and never see padding. A padding query sees only itself (mask[b, i, i] is True for every i).

    Why padding sees itself: a query row whose every key is hidden has softmax(all -inf) =
    NaN. That NaN flows through the MLP into the next layer's K and V of the padding slot, and
    there `probs @ v` multiplies it by the real rows' 0 probability: 0 * NaN = NaN, so every
    real token would turn NaN. Seeing itself keeps each row finite; nothing reads it."""
    # BEGIN SOLUTION
    L = max(lengths)
    pads = torch.tensor([L - n for n in lengths], device=device)
    is_real_key = torch.arange(L, device=device)[None, :] >= pads[:, None]  # [B, L]
    mask = causal_mask(L, device)[None] & is_real_key[:, None, :]  # [B, L, L]
    return mask | torch.eye(L, dtype=torch.bool, device=device)  # padding sees itself
    # END SOLUTION


def block_diagonal_mask(lengths: list[int], device: torch.device | str | None = None) -> torch.Tensor:
    """[T, T] torch.bool on `device`, T = sum(lengths): sequences laid end to end in one flat
    run (sequence s owns rows and columns cu[s]..cu[s+1]-1, cu = cu_seqlens(lengths)), each
    causal within itself and blind to every other: a causal block per sequence on the
    diagonal, False everywhere else."""
    # BEGIN SOLUTION
    T = sum(lengths)
    seq_id = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                     torch.tensor(lengths, device=device))  # [T]: whose token is it
    same_sequence = seq_id[:, None] == seq_id[None, :]  # [T, T]
    # Segments are contiguous, so "causal in the flat run" is "causal within the segment".
    return same_sequence & causal_mask(T, device)
    # END SOLUTION

