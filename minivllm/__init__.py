"""minivllm: a vLLM-style LLM inference engine, built one idea per chapter.

The names below load on first use (PEP 562), so that `import minivllm.request.messages` in a
process that only decodes messages, or `minivllm --help`, does not load the engine and the model.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_PUBLIC = {  # name -> the module that defines it
    "LLM": "minivllm.entrypoints.llm",
    "LLMEngine": "minivllm.engine.llm_engine",
    "EngineConfig": "minivllm.config.engine",
    "SamplingParams": "minivllm.request.sampling_params",
    "RequestOutput": "minivllm.request.outputs",
    "CompletionOutput": "minivllm.request.outputs",
    "StructuredOutputsParams": "minivllm.structured_outputs.params",
    "Decoder": "minivllm.model",
    "ModelConfig": "minivllm.model",
    "load_model": "minivllm.loader",
    "load_tokenizer": "minivllm.loader",
    "CONFIGS": "minivllm.loader",
    "DEFAULT_MODEL": "minivllm.loader",
    "DRAFT_MODEL": "minivllm.loader",
}
__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # the next lookup is an ordinary one
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)


if TYPE_CHECKING:  # what the names are, for readers and type checkers
    from minivllm.config.engine import EngineConfig  # noqa: F401
    from minivllm.engine.llm_engine import LLMEngine  # noqa: F401
    from minivllm.entrypoints.llm import LLM  # noqa: F401
    from minivllm.loader import (  # noqa: F401
        CONFIGS,
        DEFAULT_MODEL,
        DRAFT_MODEL,
        load_model,
        load_tokenizer,
    )
    from minivllm.model import Decoder, ModelConfig  # noqa: F401
    from minivllm.request.outputs import CompletionOutput, RequestOutput  # noqa: F401
    from minivllm.request.sampling_params import SamplingParams  # noqa: F401
    from minivllm.structured_outputs.params import StructuredOutputsParams  # noqa: F401
