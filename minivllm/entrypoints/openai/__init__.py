"""Chapters 10 and 15: the engine behind an OpenAI-compatible HTTP server, the way vLLM users run it.

    protocol.py      what comes over the wire: OpenAI's request fields, mapped to SamplingParams
    responses.py     what goes back: answer bodies, logprobs, error bodies
    sse.py           engine outputs -> streamed chunks (server-sent events)
    app.py           the FastAPI routes
    auth.py          --api-key: /v1 wants `Authorization: Bearer KEY`
    threaded.py      a server on a thread of its own, for notebooks, chapter scripts and tests

The engine it drives is the frontend's (minivllm/engine/): an LLMEngine stepped in a thread
(async_engine.py, chapter 10) or AsyncLLM over a core process (async_llm.py, chapter 15).

The server sits above the frontend and uses only its public methods plus read-only counts for
/metrics. It never imports the benchmark kit: the load
generator that measures it is minivllm/course/bench/load.py, a client like any other.
"""
