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
from dataclasses import dataclass, field

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
