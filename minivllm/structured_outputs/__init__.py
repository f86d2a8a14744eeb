"""Structured outputs (chapter 13): the output is forced to fit a JSON schema, a regex, a list
of choices or a grammar, because the sampler never sees a token that would break it.

    params.py    StructuredOutputsParams: vLLM's json / regex / choice / grammar / json_object
    backend.py   xgrammar: a constraint is parsed when its request is added and compiled once,
                 in a background thread, kept by its text
    matcher.py   one sequence's place in its grammar; advancing (and rolling back) with a step's tokens
    bitmask.py   each step, one bitmask for the rows under a grammar, applied to their logits in place

The hooks elsewhere are small and marked "chapter 13": SamplingParams.structured_outputs; the
engine checks the constraint in add_request and advances each matcher with the sampled token
(a grammar that has ended ends its request); the scheduler admits a request once its grammar
is compiled (and never waits for one); the sampler calls bitmask.constrain_logits first.
"""
from minivllm.structured_outputs.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
