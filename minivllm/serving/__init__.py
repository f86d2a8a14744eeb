"""Chapters 10 and 15: the engine behind an OpenAI-compatible HTTP server, the way vLLM users run it.

    protocol.py      what comes over the wire: OpenAI's request fields, mapped to SamplingParams
    responses.py     what goes back: answer bodies, logprobs, error bodies
    sse.py           engine outputs -> streamed chunks (server-sent events)
    async_engine.py  one thread owns and steps the LLMEngine; asyncio streams per request (chapter 10)
    async_llm.py     the frontend over an engine core in its own process (chapter 15)
    metrics.py       Prometheus metrics: queue, KV cache, tokens, latency histograms
    app.py           the FastAPI routes
    auth.py          --api-key: /v1 wants `Authorization: Bearer KEY`
    threaded.py      a server on a thread of its own, for notebooks, chapter scripts and tests

The server sits above `LLMEngine` (and core_process/) and uses only their public methods plus
read-only counts for /metrics. It never imports the benchmark kit: the load
generator that measures it is minivllm/bench/load.py, a client like any other.
"""
