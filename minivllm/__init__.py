"""minivllm: a vLLM-style LLM inference engine, built one idea per chapter."""
from minivllm.config import ModelConfig
from minivllm.engine.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.outputs import CompletionOutput, RequestOutput
from minivllm.engine.sampling_params import SamplingParams
from minivllm.engine.structured_outputs import StructuredOutputsParams
from minivllm.llm import LLM
from minivllm.loader import CONFIGS, DEFAULT_MODEL, DRAFT_MODEL, load_model, load_tokenizer
from minivllm.model import Decoder

__all__ = [
    "CONFIGS", "DEFAULT_MODEL", "DRAFT_MODEL", "CompletionOutput", "Decoder", "EngineConfig", "LLM", "LLMEngine",
    "ModelConfig", "RequestOutput", "SamplingParams", "StructuredOutputsParams", "load_model", "load_tokenizer",
]
__version__ = "0.1.0"
