"""The engine's settings: `EngineConfig` (engine.py, every setting checked once and resolved for a
model) and `SpeculativeConfig` (speculative.py, chapter 12's speculative_config). A model's own
shape is `ModelConfig`, beside the decoder in model.py."""
from minivllm.config.engine import EngineConfig
from minivllm.config.speculative import SpeculativeConfig

__all__ = ["EngineConfig", "SpeculativeConfig"]
