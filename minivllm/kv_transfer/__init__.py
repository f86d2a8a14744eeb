"""Chapter 17: disaggregated prefill. A KV connector moves K/V between engine instances
(base.py: the interface; shared_storage.py: blocks in files; zmq_connector.py: blocks over ZMQ
between processes); `make_connector` builds one half
of the connector an EngineConfig's kv_transfer_config names."""
from __future__ import annotations

from minivllm.config.engine import EngineConfig
from minivllm.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVLayout,
)
from minivllm.kv_transfer.shared_storage import SharedStorageConnector
from minivllm.kv_transfer.zmq_connector import ZmqConnector
from minivllm.model import Decoder

CONNECTORS: dict[str, type[KVConnectorBase]] = {"SharedStorageConnector": SharedStorageConnector,
                                                 "ZmqConnector": ZmqConnector}

__all__ = ["CONNECTORS", "KVConnectorBase", "KVConnectorMetadata", "KVConnectorRole", "KVLayout", "make_connector"]


def make_connector(config: EngineConfig, model: Decoder, role: KVConnectorRole) -> KVConnectorBase | None:
    """The `role` half of the connector config.kv_transfer_config names, for `model`'s KV
    blocks; None without a kv_transfer_config."""
    transfer = config.kv_transfer_config
    if transfer is None:
        return None
    cfg = model.config
    layout = KVLayout(cfg.num_layers, config.block_size, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    return CONNECTORS[transfer.kv_connector](transfer, role, layout)
