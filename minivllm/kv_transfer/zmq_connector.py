"""KV blocks between processes over ZMQ (chapter 17): the shape NIXL has between machines.

The producer keeps the blocks it saves in host memory and serves them on a ZMQ ROUTER socket
(`kv_connector_extra_config`: kv_host, kv_port); the consumer asks it, by the same chained
prefix keys as the shared-storage connector, which blocks it has (its scheduler half, at
admission) and fetches them (its worker half, before the forward). Nothing touches a disk: a
block crosses as raw bytes, [layers, block_size, kv_heads, head_dim] of K, then of V.

    consumer scheduler ──("has", keys)──► producer ──(how many leading keys it holds)──►
    consumer worker    ──("get", keys)──► producer ──(k bytes, v bytes, ... per block)──►

The producer holds at most `kv_buffer_blocks` blocks (1,024 by default), forgetting the least
recently saved or fetched first: a consumer that comes too late computes the prompt itself. A
producer that does not answer within TIMEOUT_MS is a miss for the lookup (the consumer computes,
and asks again only after RETRY_SECONDS), but a failed fetch of blocks the lookup promised is an
error: the step cannot compute them instead.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict

import torch
import zmq

from minivllm.attention.paged import KVPool
from minivllm.config.kv_transfer import KVTransferConfig
from minivllm.kv_transfer.base import KVConnectorRole, KVLayout, PrefixBlockConnector
from minivllm.request.sequence import Sequence

TIMEOUT_MS = 2000  # the longest a consumer waits for the producer's answer
RETRY_SECONDS = 5.0  # after a lookup the producer did not answer, how long lookups count as misses
DEFAULT_BUFFER_BLOCKS = 1024
log = logging.getLogger("minivllm.kv_transfer")


def to_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


class BlockServer:
    """The producer's side of the wire: saved blocks in host memory, least recently used first
    out, served on a ROUTER socket by a daemon thread."""

    def __init__(self, address: str, capacity: int):
        self.blocks: OrderedDict[str, tuple[bytes, bytes]] = OrderedDict()
        self.capacity, self.lock = capacity, threading.Lock()
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        threading.Thread(target=self._serve, name="kv-block-server", daemon=True).start()

    def put(self, key: str, k: bytes, v: bytes) -> None:
        with self.lock:
            self.blocks[key] = (k, v)
            self.blocks.move_to_end(key)
            while len(self.blocks) > self.capacity:
                self.blocks.popitem(last=False)

    def _serve(self) -> None:
        while True:
            peer, _, verb, payload = self.socket.recv_multipart()
            keys = json.loads(payload)
            with self.lock:
                if verb == b"has":
                    held = 0
                    while held < len(keys) and keys[held] in self.blocks:
                        held += 1
                    reply = [json.dumps(held).encode()]
                else:  # b"get": every block asked for, or nothing if one is gone
                    found = [self.blocks.get(key) for key in keys]
                    reply = [b for pair in found for b in pair] if all(found) else [b"missing"]
                    for key in keys if all(found) else []:
                        self.blocks.move_to_end(key)
            self.socket.send_multipart([peer, b"", *reply])


class ZmqConnector(PrefixBlockConnector):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVLayout):
        super().__init__(config, role, layout)
        extra = config.kv_connector_extra_config
        self.address = f"tcp://{extra['kv_host']}:{extra['kv_port']}"
        self.server: BlockServer | None = None
        if config.is_producer and role is KVConnectorRole.WORKER:  # the worker holds what it saved
            self.server = BlockServer(self.address, extra.get("kv_buffer_blocks", DEFAULT_BUFFER_BLOCKS))
        self._socket: zmq.Socket | None = None
        self._down_until = 0.0  # lookups count as misses until then (the producer did not answer)

    def _ask(self, verb: bytes, keys: list[str]) -> list[bytes] | None:
        """One round trip to the producer; None if it did not answer in time (the socket is then
        made afresh: a REQ socket whose answer never came cannot ask again)."""
        if self._socket is None:
            self._socket = zmq.Context.instance().socket(zmq.REQ)
            for option, value in ((zmq.LINGER, 0), (zmq.RCVTIMEO, TIMEOUT_MS), (zmq.SNDTIMEO, TIMEOUT_MS)):
                self._socket.setsockopt(option, value)
            self._socket.connect(self.address)
        try:
            self._socket.send_multipart([verb, json.dumps(keys).encode()])
            return self._socket.recv_multipart()
        except zmq.Again:
            self._socket.close()
            self._socket = None
            return None

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, seq: Sequence, num_computed_tokens: int) -> int:
        """As the shared-storage connector's, asking the producer instead of the disk."""
        if not self.config.is_consumer or seq.params.prompt_logprobs is not None or time.monotonic() < self._down_until:
            return 0
        usable = min(seq.num_prompt_tokens, seq.num_tokens - 1) // self.layout.block_size
        if usable * self.layout.block_size <= num_computed_tokens:
            return 0
        reply = self._ask(b"has", self.prompt_keys(seq)[:usable])
        if reply is None:
            log.warning("the KV producer at %s did not answer: computing prompts here for %.0f s", self.address,
                        RETRY_SECONDS)
            self._down_until = time.monotonic() + RETRY_SECONDS
            return 0
        return max(0, json.loads(reply[0]) * self.layout.block_size - num_computed_tokens)

    # ---- worker side ----
    def start_load_kv(self, pool: KVPool) -> None:
        """Fetch the step's blocks from the producer in one round trip."""
        self._pool, self._loaded = pool, []
        loads = self._meta.loads
        if not loads:
            return
        reply = self._ask(b"get", [t.key for t in loads])
        if reply is None or len(reply) != 2 * len(loads):
            raise RuntimeError(f"the KV producer at {self.address} did not send the {len(loads)} blocks it held "
                               f"a moment ago ({'no answer' if reply is None else 'evicted since'})")
        shape = (self.layout.num_layers, self.layout.block_size, self.layout.num_kv_heads, self.layout.head_dim)
        for i, transfer in enumerate(loads):
            k, v = (torch.frombuffer(bytearray(b), dtype=torch.uint8).view(self.layout.dtype).view(shape)
                    for b in reply[2 * i:2 * i + 2])
            self._loaded.append((transfer.block, k, v))

    def wait_for_save(self) -> None:
        """Hand every gathered block to the block server (a copy in host memory)."""
        for transfer, (ks, vs) in zip(self._meta.saves, self._gathered):
            self.server.put(transfer.key, to_bytes(torch.stack(ks)), to_bytes(torch.stack(vs)))
        self._gathered = []
