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

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from minivllm.attention.paged import KVPool
from minivllm.config.kv_transfer import KVTransferConfig
from minivllm.kv_transfer.base import (
    BlockTransfer,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVLayout,
)
from minivllm.request.sequence import SchedulerOutput, Sequence


def prefix_keys(token_ids: list[int], block_size: int) -> list[str]:
    """The chained keys (hex SHA-256) of the full blocks of token_ids, in order; a partly
    filled last block has none."""
    keys: list[str] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.sha256(bytes.fromhex(keys[-1]) if keys else b"")
        digest.update(np.asarray(token_ids[start:start + block_size], dtype="<i8").tobytes())
        keys.append(digest.hexdigest())
    return keys


class SharedStorageConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVLayout):
        super().__init__(config, role, layout)
        self.folder = Path(config.kv_connector_extra_config["shared_storage_path"]) / layout.name
        self.folder.mkdir(parents=True, exist_ok=True)
        # Scheduler side: each running request's prompt keys, the blocks to load into at the next
        # build_connector_meta (request, first block, count), and how many prompt blocks are saved.
        self._keys: dict[Sequence, list[str]] = {}
        self._to_load: list[tuple[Sequence, int, int]] = []
        self._saved: dict[Sequence, int] = {}
        # Worker side: the step's loaded blocks (pool block, k, v) and saves gathered layer by layer.
        self._pool: KVPool | None = None
        self._loaded: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._gathered: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.safetensors"

    def has_block(self, key: str) -> bool:
        return self.path(key).is_file()

    def prompt_keys(self, seq: Sequence) -> list[str]:
        """The keys of seq's full prompt blocks (computed once per request)."""
        if seq not in self._keys:
            self._keys[seq] = prefix_keys(seq.prompt_token_ids, self.layout.block_size)
        return self._keys[seq]

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

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        """seq was admitted with num_external_tokens to load, after its num_computed_tokens
        prefix-cache hits: their blocks are those of its table from there."""
        first = seq.num_computed_tokens - num_external_tokens  # the scheduler counted them as computed
        self._to_load.append((seq, first // self.layout.block_size, num_external_tokens // self.layout.block_size))

    def build_connector_meta(self, schedule: SchedulerOutput) -> KVConnectorMetadata:
        """The step's loads (requests admitted with matched tokens) and, on a producer, its saves:
        every full prompt block whose K/V are in the pool once the step has run, not saved yet,
        and whose file does not exist (a prefix-cache hit's block was saved by whoever computed it)."""
        meta = KVConnectorMetadata()
        for seq, first, count in self._to_load:
            keys = self.prompt_keys(seq)
            meta.loads += [BlockTransfer(seq.block_table[i], keys[i]) for i in range(first, first + count)]
        self._to_load.clear()
        if not self.config.is_producer:
            return meta
        block_size = self.layout.block_size
        for seq, n in zip(schedule.seqs, schedule.num_new_tokens):
            done = min(seq.num_computed_tokens + n, seq.num_prompt_tokens) // block_size  # full prompt blocks after the step
            keys = self.prompt_keys(seq)
            for i in range(self._saved.get(seq, 0), done):
                if not self.has_block(keys[i]):
                    tokens = tuple(seq.prompt_token_ids[i * block_size:(i + 1) * block_size])
                    meta.saves.append(BlockTransfer(seq.block_table[i], keys[i], tokens))
            self._saved[seq] = max(done, self._saved.get(seq, 0))
        return meta

    def request_finished(self, seq: Sequence) -> bool:
        """Forget the request; its saves were written in the steps that computed them."""
        self._keys.pop(seq, None)
        self._saved.pop(seq, None)
        return False

    # ---- worker side ----
    def start_load_kv(self, pool: KVPool) -> None:
        """Read the step's blocks from their files (the transfer; wait_for_layer_load places them)."""
        self._pool, self._loaded = pool, []
        for transfer in self._meta.loads:
            tensors = load_file(self.path(transfer.key))
            self._loaded.append((transfer.block, tensors["k"], tensors["v"]))

    def wait_for_layer_load(self, layer: int) -> None:
        """Copy layer `layer` of every loaded block into its pool block (the host tensors are
        let go after the last layer)."""
        for block, k, v in self._loaded:
            self._pool.k[layer, block].copy_(k[layer])
            self._pool.v[layer, block].copy_(v[layer])
        if layer == self.layout.num_layers - 1:
            self._loaded = []

    def save_kv_layer(self, layer: int, pool: KVPool) -> None:
        """Copy layer `layer` of every block to save off the pool (to the host)."""
        saves = self._meta.saves
        if not saves:
            return
        if layer == 0:
            self._gathered = [([], []) for _ in saves]
        blocks = torch.tensor([t.block for t in saves], device=pool.k.device)
        k, v = pool.k[layer, blocks].cpu(), pool.v[layer, blocks].cpu()  # [saves, block_size, kv_heads, head_dim]
        for (ks, vs), k_block, v_block in zip(self._gathered, k, v):
            ks.append(k_block)
            vs.append(v_block)

    def wait_for_save(self) -> None:
        """Write every gathered block to its file: [layers, block_size, kv_heads, head_dim] each of K and V."""
        for transfer, (ks, vs) in zip(self._meta.saves, self._gathered):
            path = self.path(transfer.key)
            meta = {"token_ids": json.dumps(list(transfer.token_ids))}
            temporary = path.with_suffix(f".{os.getpid()}.tmp")
            save_file({"k": torch.stack(ks).contiguous(), "v": torch.stack(vs).contiguous()}, temporary, metadata=meta)
            os.replace(temporary, path)  # atomic: a reader sees the whole block or none
        self._gathered = []
