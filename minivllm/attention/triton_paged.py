"""Chapter 8 — the engine's paged attention, with the Triton kernels of triton_kernels.py.

Same contract as chapter 6's PagedAttention (paged.py): built once per step from the pool and
the step's PagedBatch, called once per layer as attention(layer, q, k, v). Only the inside
changes: no gathered copies of the context, no padding to the longest sequence, no Python
loop over sequences.

Which kernel runs:
- a pure decode step (every sequence brings one token; the steady state of serving) uses the
  split-K decode kernel, which spreads each long context over many programs; so does a step a
  CUDA graph replays with 1 + k rows per sequence (chapter 12's verify step, batch.query_len):
  the same kernel with 1 + k query rows per sequence, its grid fixed by the batch alone;
- any other step (prefill chunks, possibly mixed with decodes) uses the ragged prefill
  kernel for all of its rows in one launch: a decode token is a chunk of length one. Mixed
  steps are dominated by their prefill chunks' work, so a second launch for the decode rows
  would buy little and cost a split of the flat run.

Triton kernels run on a GPU, or on the CPU in Triton's interpreter when TRITON_INTERPRET=1 is
set before the kernels are imported. Anywhere else this class refuses to start (a clear
RuntimeError, minivllm/triton_support.py) rather than quietly running something other than what
was asked for; so it does for bfloat16 under the interpreter, whose bf16 matmuls are wrong.
"""
from __future__ import annotations

from types import ModuleType

import torch

from minivllm.attention.paged import KVPool, PagedBatch
from minivllm.triton_support import import_kernels


def load_kernels(device: torch.device, dtype: torch.dtype) -> ModuleType:
    """The kernel module, if Triton can run kernels on `dtype` tensors on `device`; otherwise
    a RuntimeError that says what to do (minivllm/triton_support.py)."""
    return import_kernels("minivllm.attention.triton_kernels", "attention='triton'", "attention='torch'", device, dtype)


class TritonPagedAttention:
    """Chapter 8's attention: store into the pool with a kernel, then attend through the
    block tables with the decode kernel (decode steps) or the prefill kernel (the rest)."""

    def __init__(self, pool: KVPool, batch: PagedBatch):
        self.kernels = load_kernels(pool.k.device, pool.k.dtype)
        self.pool, self.batch = pool, batch
        # Grid sizes come from the Python-side lengths, so launching never waits for the GPU.
        self.max_context_len, self.max_query_len = batch.max_context_len, max(batch.query_lens)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache, batch = self.pool.k[layer], self.pool.v[layer], self.batch
        self.kernels.store_kv(k_cache, v_cache, k, v, batch.slot_mapping)
        if batch.is_decode or batch.query_len:
            return self.kernels.paged_decode(q, k_cache, v_cache, batch.block_tables, batch.context_lens_tensor,
                                             self.max_context_len, query_len=batch.query_len or 1)
        return self.kernels.paged_prefill(q, k_cache, v_cache, batch.block_tables, batch.query_start_tensor,
                                          batch.context_lens_tensor, self.max_query_len)
