"""What `LLM(model, kv_transfer_config={...})` accepts (chapter 17), in vLLM's shape:

    {"kv_connector": "SharedStorageConnector",
     "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
     "kv_connector_extra_config": {"shared_storage_path": "/some/folder"}}

The role says which way K/V travel: a producer (the prefill instance) saves the K/V of the
prompts it computes, a consumer (the decode instance) loads what it finds instead of computing
it, and kv_both does both. Checked here, once, as strictly as every engine setting: an unknown
key, connector or role, or a connector's missing or ill-typed extra setting is a ValueError that
names the field.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minivllm.config.user_dict import checked_dict

ROLES = ("kv_producer", "kv_consumer", "kv_both")
# Each connector's extra settings: name -> (type, required). A connector not listed here does not exist.
CONNECTORS: dict[str, dict[str, tuple[type, bool]]] = {
    "SharedStorageConnector": {"shared_storage_path": (str, True)},
    # the producer's address (it binds, the consumer connects); the blocks it keeps in host memory
    "ZmqConnector": {"kv_host": (str, True), "kv_port": (int, True), "kv_buffer_blocks": (int, False)},
}
KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str  # a name in CONNECTORS
    kv_role: str  # a name in ROLES
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)  # the connector's own settings

    @property
    def is_producer(self) -> bool:
        """Whether this instance saves the K/V it computes."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """Whether this instance loads K/V that another one computed."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, config: Any) -> KVTransferConfig:
        """The config a user wrote (a dict as above), checked; a KVTransferConfig passes as it is."""
        if isinstance(config, KVTransferConfig):
            return config
        checked_dict(config, "kv_transfer_config", KEYS,
                     example="{'kv_connector': 'SharedStorageConnector', 'kv_role': 'kv_both', ...}")
        for name in ("kv_connector", "kv_role"):
            if name not in config:
                raise ValueError(f"kv_transfer_config needs {name!r}")
        connector, role = config["kv_connector"], config["kv_role"]
        if not isinstance(connector, str) or connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config['kv_connector'] must be one of {sorted(CONNECTORS)}, got {connector!r}")
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"kv_transfer_config['kv_role'] must be one of {list(ROLES)}, got {role!r}")
        settings = CONNECTORS[connector]
        extra = checked_dict(config.get("kv_connector_extra_config", {}),
                             "kv_transfer_config['kv_connector_extra_config']", settings)
        for name, (kind, required) in settings.items():
            where = f"kv_transfer_config['kv_connector_extra_config'][{name!r}]"
            if name not in extra:
                if required:
                    raise ValueError(f"{where} is required by {connector}")
                continue
            value = extra[name]
            if kind is str and (not isinstance(value, str) or not value):
                raise ValueError(f"{where} must be a non-empty str, got {value!r}")
            most = 65535 if name.endswith("port") else None
            if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < 1
                                or (most is not None and value > most)):
                raise ValueError(f"{where} must be an integer >= 1{f' and <= {most}' if most else ''}, got {value!r}")
        return cls(connector, role, dict(extra))
