"""minivllm: a vLLM-style LLM inference engine, built one idea per chapter."""
from minivllm.config import ModelConfig
from minivllm.loader import CONFIGS, DEFAULT_MODEL, load_model, load_tokenizer
from minivllm.model import Decoder

__all__ = ["CONFIGS", "DEFAULT_MODEL", "Decoder", "ModelConfig", "load_model", "load_tokenizer"]
__version__ = "0.1.0"
