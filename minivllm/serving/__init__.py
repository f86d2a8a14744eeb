"""Chapter 10: the engine behind an OpenAI-compatible HTTP server, the way vLLM users run it.

    protocol.py      what goes over the wire: OpenAI's request fields, mapped to SamplingParams
    sse.py           engine outputs -> streamed chunks (server-sent events)
    async_engine.py  one thread owns and steps the LLMEngine; asyncio streams per request
    metrics.py       Prometheus metrics: queue, KV cache, tokens, latency histograms
    app.py           the FastAPI routes
    auth.py          --api-key: /v1 wants `Authorization: Bearer KEY`
    threaded.py      a server on a thread of its own, for notebooks, chapter scripts and tests

The server sits above `LLMEngine` and uses only its public methods (add_request, step,
abort_request) plus read-only counts for /metrics. It never imports the benchmark kit: the load
generator that measures it is minivllm/bench/load.py, a client like any other.
"""
