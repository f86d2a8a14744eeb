"""The first check of a setting a user writes as a dict (speculative_config, kv_transfer_config,
and their nested dicts), shared so that every such setting refuses the same way: not a dict, or a
key it does not know, is a ValueError that names the setting and lists the keys it has."""
from __future__ import annotations

from collections.abc import Collection
from typing import Any


def checked_dict(value: Any, where: str, keys: Collection[str], example: str = "") -> dict:
    """`value` itself when it is a dict whose keys are all in `keys`; otherwise a ValueError that
    names `where` (how the user wrote it, e.g. "kv_transfer_config") and, for a wrong type,
    shows `example`."""
    if not isinstance(value, dict):
        such = f" such as {example}" if example else ""
        # a ValueError for a wrong type too: every bad setting fails the same way (the project's rule)
        raise ValueError(f"{where} must be a dict{such}, got {type(value).__name__}")  # noqa: TRY004
    unknown = sorted(set(value) - set(keys), key=str)
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; the keys are {sorted(keys)}")
    return value
