"""What `LLM(model, speculative_config={...})` accepts (chapter 12), in vLLM's shape:

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"method": "draft_model", "model": SOURCE, "num_speculative_tokens": k}
    {"model": SOURCE, "num_speculative_tokens": k}          (a model without a method: a draft model)

Either may add "disable_by_batch_size": B (as vLLM's): a step that begins with B or more
requests running proposes no guesses; None: never pause; "auto" (the default): by device.
Speculation trades spare compute for fewer steps, and a large batch has no spare compute. The
defaults (DISABLE_BY_BATCH_SIZE) come from chapter 12's measured curves by one rule: pause from
the smallest batch at which speculation gains less than 1.1x, measured, or predicted as
(tokens a verify step yields) / (its cost in decode steps) (`bench.speculation.pause_threshold`):
- CPU, 16: the n-gram gain on repetitive code (k = 4, the embedded model) was 1.82x at batch 1,
  1.52x at 2, 1.18x at 4, 1.15x at 8, then 1.09x at 16, 1.14x at 32 and 1.03x at 64.
- CUDA, never up to 256 (to be re-derived from the graphed curve the GPU rerun measures). A
  verify step yielded at least 2.0 tokens on the CPU (gain x verify / decode cost, at every
  batch). On an H200 an eager verify step (k = 4) cost 5.97 decode steps at batch 1 but 1.82 at
  256: launches, not work, made it dear at small batches, and replaying it from a graph
  (cuda_graphs.py) removes them (the target: at most 1.3 up to 64, 1.6 at 256: a gain of 1.25x
  or more).

SOURCE is anything load_model accepts (or a loaded minivllm Decoder). Checked here, once, as
strictly as every engine setting: an unknown method or key, a k that is not an integer >= 1,
prompt_lookup_min > prompt_lookup_max, or a disable_by_batch_size that is not an integer >= 2
(at 1 no step would ever speculate) is a ValueError. (Whether a draft's vocabulary matches
the target's can only be checked once it is loaded: the draft proposer does that.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minivllm.config.user_dict import checked_dict

METHODS = ("ngram", "draft_model")
KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", "disable_by_batch_size"}
# minivllm's defaults for prompt lookup when the config leaves them out: match the last 4 tokens
# if they occur earlier, else the last 3, ... down to 1.
PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN = 4, 1
# disable_by_batch_size when the config leaves it out, by the target's device type (see above;
# a device not listed never pauses).
DISABLE_BY_BATCH_SIZE = {"cpu": 16}
AUTO = "auto"


def _count(name: str, value: Any, least: int = 1, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"speculative_config[{name!r}] must be an integer >= {least}{why}, got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" or "draft_model"
    num_speculative_tokens: int  # k: guesses per sequence per step
    prompt_lookup_max: int = PROMPT_LOOKUP_MAX  # ngram: the longest suffix looked up
    prompt_lookup_min: int = PROMPT_LOOKUP_MIN  # ngram: the shortest
    model: Any = None  # draft_model: the draft's source (a folder, hub id, config.json or Decoder)
    disable_by_batch_size: int | str | None = AUTO  # no guesses in a step that begins with this many
    # running; None: never; AUTO: DISABLE_BY_BATCH_SIZE for the device (pause_at)

    def pause_at(self, device: torch.device) -> int | None:
        """The batch size from which steps propose nothing, on this device (None: never)."""
        if self.disable_by_batch_size == AUTO:
            return DISABLE_BY_BATCH_SIZE.get(torch.device(device).type)
        return self.disable_by_batch_size

    @classmethod
    def from_dict(cls, config: Any) -> SpeculativeConfig:
        """The config a user wrote (a dict as above), checked; a SpeculativeConfig passes as it is."""
        if isinstance(config, SpeculativeConfig):
            return config
        checked_dict(config, "speculative_config", KEYS, example="{'method': 'ngram', 'num_speculative_tokens': 3}")
        method = config.get("method", "draft_model" if "model" in config else None)
        if method not in METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {METHODS} (or leave it out and give a "
                             f"'model'), got {method!r}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs 'num_speculative_tokens': how many tokens to guess per step")
        k = _count("num_speculative_tokens", config["num_speculative_tokens"])
        pause = config.get("disable_by_batch_size", AUTO)
        if pause is not None and pause != AUTO:
            _count("disable_by_batch_size", pause, least=2, why=" (at 1 no step would ever speculate)")
        if method == "draft_model":
            extra = sorted({"prompt_lookup_max", "prompt_lookup_min"} & set(config))
            if extra:
                raise ValueError(f"speculative_config: {extra} apply to method 'ngram', not to a draft model")
            if config.get("model") is None:
                raise ValueError("speculative_config for a draft model needs 'model': what load_model should load")
            return cls("draft_model", k, model=config["model"], disable_by_batch_size=pause)
        if "model" in config:
            raise ValueError("speculative_config: method 'ngram' looks up the sequence's own tokens and takes no 'model'")
        high = _count("prompt_lookup_max", config.get("prompt_lookup_max", PROMPT_LOOKUP_MAX))
        low = _count("prompt_lookup_min", config.get("prompt_lookup_min", min(PROMPT_LOOKUP_MIN, high)))
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min ({low}) must not exceed prompt_lookup_max ({high})")
        return cls("ngram", k, prompt_lookup_max=high, prompt_lookup_min=low, disable_by_batch_size=pause)
