"""How queries meet keys and values: masks (pictures of who may see whom), dense attention,
and attention over a paged KV cache, in PyTorch (paged.py) and in Triton (triton_paged.py).

The engine picks the paged implementation by name; both take (KVPool, PagedBatch) and are
called as attention(layer, q, k, v), so nothing else changes between chapters 7 and 8.
"""
from __future__ import annotations

import torch

PAGED_BACKENDS = ("torch", "triton")


def paged_attention_class(name: str, device: torch.device, dtype: torch.dtype) -> type:
    """The paged attention implementation called `name`: "torch" or "triton". Refuses (with a
    RuntimeError that says what to do) one that cannot run on `device` with `dtype`."""
    if name == "torch":
        from minivllm.attention.paged import PagedAttention

        return PagedAttention
    if name == "triton":
        from minivllm.attention.triton_paged import TritonPagedAttention, load_kernels

        load_kernels(device, dtype)
        return TritonPagedAttention
    raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(PAGED_BACKENDS)}")
