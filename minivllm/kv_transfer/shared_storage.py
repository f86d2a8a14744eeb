"""KV blocks in files, named by the prompt prefix they end (chapter 17; vLLM's SharedStorageConnector).

The teaching connector: a producer writes each full block of every prompt it computes to a
file, a consumer that meets a prompt with the same first tokens reads those files instead of
computing them. Everything is inspectable by hand:

    <shared_storage_path>/<layout>/<key>.safetensors      layout: "2L-b16-2x32-float32" (KVLayout.name)
        k, v: [num_layers, block_size, num_kv_heads, head_dim]   the block's K and V, every layer
        metadata: token_ids, the block's own tokens (what a reader needs to see which prefix it ends)

A block's K/V depend on its tokens *and on every token before them*, so its key is a hash of
the whole prefix it ends, chained block by block exactly as chapter 11 names cached blocks:

    key_0 = sha256(tokens[0:B]),  key_i = sha256(key_{i-1} + tokens[i*B:(i+1)*B])   (int64, little-endian)

Two instances that share a folder share a block exactly when their prompts agree up to its end.
Files are written under a temporary name and renamed, so a reader never sees half a block. The
layout folder keeps models of different shapes (or dtypes, or block sizes) apart; two models of
the same shape but different weights must not share a folder (nothing in a block tells them apart).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from minivllm.attention.paged import KVPool
from minivllm.config.kv_transfer import KVTransferConfig
from minivllm.kv_transfer.base import (
    KVConnectorRole,
    KVLayout,
    PrefixBlockConnector,
    prefix_keys,
)
from minivllm.request.sequence import Sequence

__all__ = ["SharedStorageConnector", "prefix_keys"]


class SharedStorageConnector(PrefixBlockConnector):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVLayout):
        super().__init__(config, role, layout)
        self.folder = Path(config.kv_connector_extra_config["shared_storage_path"]) / layout.name
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.safetensors"

    def has_block(self, key: str) -> bool:
        return self.path(key).is_file()

    def should_save(self, key: str) -> bool:
        return not self.has_block(key)

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        """How many of seq's prompt tokens, from num_computed_tokens on, this connector can load.

        seq: a request being admitted; num_computed_tokens: its tokens already in this
        instance's KV cache (prefix-cache hits: a multiple of block_size, possibly 0). Let B =
        self.layout.block_size, keys = self.prompt_keys(seq) (one per full prompt block) and
        usable = min(seq.num_prompt_tokens, seq.num_tokens - 1) // B: the full prompt blocks
        before the last token, which must be computed here for its logits. The match is the
        leading blocks 0, 1, ... (at most usable of them) whose file exists
        (self.has_block(keys[i])), stopping at the first missing one: a block's K/V are
        useless without every block before it. Returns match * B - num_computed_tokens, or 0
        when that is not positive, when this instance is not a consumer
        (self.config.is_consumer), or when the request asked for prompt logprobs (it needs the
        logits of every prompt token). Reads only: no file or state changes."""
        # BEGIN SOLUTION
        if not self.config.is_consumer or seq.params.prompt_logprobs is not None:
            return 0
        block_size = self.layout.block_size
        usable = min(seq.num_prompt_tokens, seq.num_tokens - 1) // block_size
        keys = self.prompt_keys(seq)
        matched = 0
        while matched < usable and self.has_block(keys[matched]):
            matched += 1
        return max(0, matched * block_size - num_computed_tokens)
        # END SOLUTION

    # ---- worker side ----
    def start_load_kv(self, pool: KVPool) -> None:
        """Read the step's blocks from their files (the transfer; wait_for_layer_load places them)."""
        self._pool, self._loaded = pool, []
        for transfer in self._meta.loads:
            tensors = load_file(self.path(transfer.key))
            self._loaded.append((transfer.block, tensors["k"], tensors["v"]))

    def wait_for_save(self) -> None:
        """Write every gathered block to its file: [layers, block_size, kv_heads, head_dim] each of K and V."""
        for transfer, (ks, vs) in zip(self._meta.saves, self._gathered):
            path = self.path(transfer.key)
            meta = {"token_ids": json.dumps(list(transfer.token_ids))}
            temporary = path.with_suffix(f".{os.getpid()}.tmp")
            save_file({"k": torch.stack(ks).contiguous(), "v": torch.stack(vs).contiguous()}, temporary, metadata=meta)
            os.replace(temporary, path)  # atomic: a reader sees the whole block or none
        self._gathered = []
