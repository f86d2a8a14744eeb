"""Where Triton kernels can run (chapters 8 and 9), said once for every switch that uses them.

Triton kernels run on a GPU, or on the CPU in Triton's interpreter when TRITON_INTERPRET=1 is set
before Triton is imported. Anywhere else a switch that asks for them (attention="triton",
fused_ops=True) refuses to start with a RuntimeError that says what to do, rather than quietly
running something other than what was asked for; so it does for bfloat16 under the interpreter.

Why "before Triton is imported", not "before the kernels are": Triton reads the variable each time
a function is decorated with @triton.jit, and its own library (tl.sum, tl.max, tl.cdiv, ...) is
decorated when `import triton` runs. Kernels interpreted on top of a library compiled for the GPU
fail inside the interpreter ("Cannot call @triton.jit'd outside of the scope of a kernel"; every
Triton from 3.2 to 3.9 alike). And Triton is imported early, by others: torch's compiler imports it
when a model is loaded through transformers. So the choice is made once per process, first thing:
in the environment, or with use_interpreter() before anything else runs.
"""
from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import torch

# What to tell someone whose process chose too late: what to set, and before what.
_SET_IT_FIRST = (
    "Set TRITON_INTERPRET=1 before anything imports Triton (loading a model does, through torch's compiler): "
    "in the environment before Python starts (`TRITON_INTERPRET=1 python ...`), or at the very top of the "
    "script or of a notebook's first cell (then restart the kernel)."
)


def library_interpreted() -> bool:
    """Whether Triton's own library (tl.sum and the rest) was built for the CPU interpreter, i.e.
    whether TRITON_INTERPRET=1 was set when Triton was imported. Imports Triton if nothing has."""
    import triton
    import triton.language as tl

    return not isinstance(tl.standard.sum, triton.runtime.JITFunction)


def use_interpreter() -> None:
    """Run this process's Triton kernels on the CPU, in Triton's interpreter: set TRITON_INTERPRET=1.
    Call it before anything imports Triton; where something already has without the variable
    (Triton's library then is compiled for the GPU and cannot be interpreted), a RuntimeError
    that says what to set and before what, instead of the interpreter's error later."""
    if "triton" in sys.modules and not library_interpreted():
        raise RuntimeError(f"Triton's CPU interpreter was asked for after Triton was imported without it. {_SET_IT_FIRST}")
    os.environ["TRITON_INTERPRET"] = "1"


def built_for_interpreter(kernel: object) -> bool:
    """Whether `kernel` (a module's @triton.jit function) was built for the CPU interpreter rather
    than for a GPU. A RuntimeError if Triton's own library was built for the other one (the variable
    changed between `import triton` and the kernel's module): such kernels cannot run anywhere."""
    import triton

    interpreted = not isinstance(kernel, triton.runtime.JITFunction)
    if interpreted and not library_interpreted():
        raise RuntimeError("TRITON_INTERPRET=1 was set after Triton was imported: these kernels were built for "
                           f"Triton's CPU interpreter, its own functions (tl.sum, ...) for the GPU. {_SET_IT_FIRST}")
    if not interpreted and library_interpreted():
        raise RuntimeError("TRITON_INTERPRET=1 was unset after Triton was imported under it: these kernels were "
                           "built for the GPU, Triton's own functions (tl.sum, ...) for its CPU interpreter. Choose "
                           "once per process, before anything imports Triton.")
    return interpreted


def import_kernels(module: str, switch: str, off: str, device: torch.device, dtype: torch.dtype) -> ModuleType:
    """The kernel module `module` (its dotted name; it sets INTERPRETED with built_for_interpreter,
    whose RuntimeError passes through), if Triton can run it on `dtype` tensors on `device`.
    Otherwise a RuntimeError naming `switch`, the setting that asked for the kernels (e.g.
    "attention='triton'"), and `off`, the one that does without them (e.g. "attention='torch'")."""
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
