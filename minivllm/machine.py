"""Machine facts: what a number was measured on, and how to wait for the device.

At the bottom of the package, beside loading, so that anything may say where it runs (the
benchmark kit, the server's /server_info) without importing the benchmark harness.
"""
from __future__ import annotations

import platform
from dataclasses import asdict
from typing import Any

import torch

from minivllm.model import Decoder


def synchronize(device: torch.device) -> None:
    """Wait until the device has finished everything queued on it (a no-op on the CPU, which
    runs each operation before returning). Every wall-clock time of GPU work needs it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def environment(model: Decoder | None = None) -> dict[str, Any]:
    """Where a number was measured: device, software versions, model shape."""
    import transformers

    info: dict[str, Any] = dict(
        python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
        machine=platform.machine(), cpu_threads=torch.get_num_threads(),
    )
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if model is not None:
        info["device"] = device_name(model.device)
        info["dtype"] = str(model.dtype).removeprefix("torch.")
        info["model"] = asdict(model.config) | {"parameters": model.config.num_parameters()}
    return info


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"

