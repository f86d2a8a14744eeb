"""The KV connector: how K/V computed by one engine instance reach another (chapter 17).

Disaggregated prefill runs the prompt in one instance (the *producer*, kv_producer) and the
decode in another (the *consumer*, kv_consumer). Between them travel the prompt's K and V, one
KV block at a time, so that the consumer starts decoding without computing the prompt again.
A connector is the pipe, in two halves as in vLLM V1 (`KVConnectorBase_V1`), each its own object
made for its role: the scheduler's half decides *what* moves, the worker's half moves it.

One request through a consumer, in the order the engine calls them:

    scheduler side (engine core)                       worker side (model runner)
    ────────────────────────────────────────────       ─────────────────────────────────────
    get_num_new_matched_tokens(seq, computed)  admission: how many more prompt tokens I can supply
      (the scheduler counts them as computed, allocates blocks for them and grants the rest)
    update_state_after_alloc(seq, n)           the blocks exist: remember where n tokens go
    build_connector_meta(schedule)             this step's loads and saves, for the worker
                                                       bind_connector_metadata(meta)
                                                       start_load_kv(pool)      fetch the blocks
                                                       wait_for_layer_load(l)   layer l is in the pool
                                                       ... the forward ...
                                                       save_kv_layer(l, pool)   (a producer) copy layer l out
                                                       wait_for_save()          the step's saves are written
    request_finished(seq) -> bool              done: may its blocks be freed now?

The choice here: **whole-step**. vLLM calls wait_for_layer_load and save_kv_layer from inside
each attention layer, so that layer l+1's transfer overlaps layer l's compute; the model runner
here calls them for every layer before and after the forward (`load_kv`, `save_kv`), which
keeps the model and CUDA graphs untouched and costs the overlap. Saves are written before the
step returns, so request_finished never needs to keep blocks (an asynchronous sender would).

Loaded tokens are the consumer's cache hits: they count in RequestOutput.num_cached_tokens, as
chapter 11's prefix-cache hits do, and are never computed. At least the prompt's last token is
always computed here (its logits give the first output token).
"""
from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from minivllm.attention.paged import KVPool
from minivllm.config.kv_transfer import KVTransferConfig
from minivllm.request.sequence import SchedulerOutput, Sequence


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"  # beside the scheduler, in the engine core
    WORKER = "worker"  # beside the KV pool, in the model runner


@dataclass(frozen=True)
class KVLayout:
    """What one KV block is, as bytes: blocks of different layouts must never meet."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def name(self) -> str:
        """e.g. "28L-b16-8x128-bfloat16": a folder name that tells layouts apart."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.num_layers}L-b{self.block_size}-{self.num_kv_heads}x{self.head_dim}-{dtype}"


@dataclass(frozen=True)
class BlockTransfer:
    """One block to move: the pool block, and the name of its content (the prompt prefix it ends)."""

    block: int
    key: str
    token_ids: tuple[int, ...] = ()  # the block's own tokens (saves only: written beside the K/V)


@dataclass
class KVConnectorMetadata:
    """What the scheduler's half tells the worker's half for one step (vLLM: KVConnectorMetadata)."""

    loads: list[BlockTransfer] = field(default_factory=list)  # into the pool before the forward
    saves: list[BlockTransfer] = field(default_factory=list)  # out of the pool after it


class KVConnectorBase:
    """A connector's two halves. A subclass implements the eight methods of the module doc; the
    engine calls the four helpers below them (lookup, plan_step, load_kv, save_kv)."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVLayout):
        self.config, self.role, self.layout = config, role, layout
        self._matched: dict[Sequence, int] = {}  # scheduler side: this step's lookups, by sequence
        self._meta: KVConnectorMetadata | None = None  # worker side: the step's metadata, once bound

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        raise NotImplementedError

    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        raise NotImplementedError

    def build_connector_meta(self, schedule: SchedulerOutput) -> KVConnectorMetadata:
        raise NotImplementedError

    def request_finished(self, seq: Sequence) -> bool:
        """seq is done (finished or aborted). True: the connector still reads its blocks and the
        scheduler must not free them yet (not supported here: every connector of this package
        finishes its saves inside the step, and returns False)."""
        return False

    # ---- worker side ----
    def bind_connector_metadata(self, meta: KVConnectorMetadata) -> None:
        self._meta = meta

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self, pool: KVPool) -> None:
        raise NotImplementedError

    def wait_for_layer_load(self, layer: int) -> None:
        raise NotImplementedError

    def save_kv_layer(self, layer: int, pool: KVPool) -> None:
        raise NotImplementedError

    def wait_for_save(self) -> None:
        raise NotImplementedError

    # ---- what the engine calls ----
    def lookup(self, seq: Sequence, num_computed_tokens: int) -> int:
        """The scheduler, admitting seq: get_num_new_matched_tokens, remembered until plan_step
        (the head of the queue may be looked up and then not fit: it is looked up again)."""
        matched = self.get_num_new_matched_tokens(seq, num_computed_tokens)
        self._matched[seq] = matched
        return matched

    def plan_step(self, schedule: SchedulerOutput) -> KVConnectorMetadata:
        """The engine core, once the scheduler has planned a step: update_state_after_alloc for
        every request admitted with matched tokens (their blocks are allocated now), which count
        as the request's cached tokens on its first admission, then build_connector_meta."""
        admitted = set(schedule.seqs)
        for seq, matched in self._matched.items():
            if seq in admitted and matched > 0:
                self.update_state_after_alloc(seq, matched)
                if seq.num_preemptions == 0:  # what the request reports: its first admission, as chapter 11
                    seq.num_cached_tokens += matched
        self._matched.clear()
        return self.build_connector_meta(schedule)

    def load_kv(self, meta: KVConnectorMetadata, pool: KVPool) -> None:
        """The model runner, before the forward: every layer of the step's loads into the pool."""
        self.bind_connector_metadata(meta)
        self.start_load_kv(pool)
        for layer in range(self.layout.num_layers):
            self.wait_for_layer_load(layer)

    def save_kv(self, pool: KVPool) -> None:
        """The model runner, after the forward: every layer of the step's saves out of the pool."""
        for layer in range(self.layout.num_layers):
            self.save_kv_layer(layer, pool)
        self.wait_for_save()
        self.clear_connector_metadata()


def prefix_keys(token_ids: list[int], block_size: int) -> list[str]:
    """The chained keys (hex SHA-256) of the full blocks of token_ids, in order, named as chapter
    11 names cached blocks: key_0 = sha256(tokens[0:B]), key_i = sha256(key_{i-1} + tokens[i*B:(i+1)*B])
    (token ids as little-endian int64). A partly filled last block has none. Two prompts share
    key i exactly when they agree up to the end of block i, which is when their K/V agree."""
    keys: list[str] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.sha256(bytes.fromhex(keys[-1]) if keys else b"")
        digest.update(np.asarray(token_ids[start:start + block_size], dtype="<i8").tobytes())
        keys.append(digest.hexdigest())
    return keys


class PrefixBlockConnector(KVConnectorBase):
    """What every connector of this package shares: blocks named by prefix_keys, loads into the
    blocks the scheduler allocated after the prefix cache's, saves of every full prompt block a
    step completes, and the per-layer copies between the pool and host tensors. A connector adds
    where blocks live: get_num_new_matched_tokens, start_load_kv (fill self._loaded with
    (pool block, k, v) host tensors of [layers, block_size, kv_heads, head_dim]), wait_for_save
    (send self._gathered: per save, its K and V layer by layer) and, if it can tell, should_save."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVLayout):
        super().__init__(config, role, layout)
        # Scheduler side: each running request's prompt keys, the blocks to load into at the next
        # build_connector_meta (request, first block, count), and how many prompt blocks are saved.
        self._keys: dict[Sequence, list[str]] = {}
        self._to_load: list[tuple[Sequence, int, int]] = []
        self._saved: dict[Sequence, int] = {}
        # Worker side: the step's loaded blocks (pool block, k, v) and saves gathered layer by layer.
        self._pool: KVPool | None = None
        self._loaded: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._gathered: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def prompt_keys(self, seq: Sequence) -> list[str]:
        """The keys of seq's full prompt blocks (computed once per request)."""
        if seq not in self._keys:
            self._keys[seq] = prefix_keys(seq.prompt_token_ids, self.layout.block_size)
        return self._keys[seq]

    def should_save(self, key: str) -> bool:
        """Whether a block computed here must be saved (False: the other side has it already)."""
        return True

    # ---- scheduler side ----
    def update_state_after_alloc(self, seq: Sequence, num_external_tokens: int) -> None:
        """seq was admitted with num_external_tokens to load, after its prefix-cache hits: their
        blocks are those of its table from there."""
        first = seq.num_computed_tokens - num_external_tokens  # the scheduler counted them as computed
        self._to_load.append((seq, first // self.layout.block_size, num_external_tokens // self.layout.block_size))

    def build_connector_meta(self, schedule: SchedulerOutput) -> KVConnectorMetadata:
        """The step's loads (requests admitted with matched tokens) and, on a producer, its saves:
        every full prompt block whose K/V are in the pool once the step has run, not saved yet
        (a prefix-cache hit's block was saved by whoever computed it, if should_save says so)."""
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
                if self.should_save(keys[i]):
                    tokens = tuple(seq.prompt_token_ids[i * block_size:(i + 1) * block_size])
                    meta.saves.append(BlockTransfer(seq.block_table[i], keys[i], tokens))
            self._saved[seq] = max(done, self._saved.get(seq, 0))
        return meta

    def request_finished(self, seq: Sequence) -> bool:
        """Forget the request; its saves were done in the steps that computed them."""
        self._keys.pop(seq, None)
        self._saved.pop(seq, None)
        return False

    # ---- worker side ----
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
