"""Where Triton kernels can run (chapters 8 and 9), said once for every switch that uses them.

Triton kernels run on a GPU, or on the CPU in Triton's interpreter when TRITON_INTERPRET=1 is set
before the kernels are imported. Anywhere else a switch that asks for them (attention="triton",
fused_ops=True) refuses to start with a RuntimeError that says what to do, rather than quietly
running something other than what was asked for; so it does for bfloat16 under the interpreter.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch


def import_kernels(module: str, switch: str, off: str, device: torch.device, dtype: torch.dtype) -> ModuleType:
    """The kernel module `module` (its dotted name; it sets INTERPRETED when it was imported
    under TRITON_INTERPRET=1), if Triton can run it on `dtype` tensors on `device`. Otherwise a
    RuntimeError naming `switch`, the setting that asked for the kernels (e.g. "attention='triton'"),
    and `off`, the one that does without them (e.g. "attention='torch'")."""
    try:
        kernels = importlib.import_module(module)
    except ImportError as error:
        raise RuntimeError(
            f"{switch} needs the triton package, which could not be imported ({error}). "
            f"Install it (pip install triton; Linux x86-64) or use {off}."
        ) from error
    if device.type != "cuda" and not kernels.INTERPRETED:
        raise RuntimeError(
            f"{switch} compiles Triton kernels for a GPU, but the model is on {device}. To run them on the CPU "
            "in Triton's interpreter (slow; meant for checking correctness), set TRITON_INTERPRET=1 in the "
            f"environment before Python starts, e.g. `TRITON_INTERPRET=1 python ...`; or use {off}."
        )
    if kernels.INTERPRETED and dtype == torch.bfloat16:
        # The interpreter keeps bf16 as raw uint16 bits and its tl.dot multiplies those bits
        # (triton-lang/triton#11584; bf16 is unsupported there): wrong answers, not slow ones.
        raise RuntimeError(
            "Triton's interpreter (TRITON_INTERPRET=1) computes bfloat16 matmuls wrongly; run the model in "
            "float32 (the CPU default) or float16 on the CPU, or run bfloat16 on a GPU."
        )
    return kernels
