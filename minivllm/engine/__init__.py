"""The frontend (chapters 7, 10, 14-15): what a user talks to, and the one seam to the engine core.

    input_processor.py   a request checked and tokenized -> EngineCoreRequest (token ids)
    output_processor.py  the core's news -> text, stop strings, n completions, RequestOutputs
    detokenizer.py       tokens -> text, incrementally; stop strings across tokens
    core_client.py       the seam: make_client chooses where the core runs (this thread, a process,
                         N copies) and every frontend talks to whichever it got the same way
    process_client.py    chapter 15: the core process, started, fed and watched over ZMQ
    data_parallel.py     chapter 14: N copies of the core behind one router
    llm_engine.py        LLMEngine, the synchronous frontend: add_request, step, abort_request
    async_llm.py         AsyncLLM, the server's asynchronous frontend over a core process
    async_engine.py      chapter 10: an LLMEngine stepped in a thread, for the one-process server;
                         RequestStream, what a request's handler reads
    metrics.py           the server's Prometheus metrics

Only llm_engine.py and async_llm.py build an OutputProcessor: each frontend is written once.
The ways in (LLM, the CLI, the OpenAI server) are entrypoints/, above this.
"""
