"""The finished engine (chapters 7-16): requests in, tokens out, one scheduled step at a time.

    config.py           EngineConfig: every setting, validated once, decided for the model
    sampling_params.py  SamplingParams: how one request wants its tokens chosen
    sequence.py         a request's tokens and the two counters the scheduler runs on
    block_manager.py    the paged KV cache's blocks (chapter 6); prefix_cache.py shares them (chapter 11)
    scheduler.py        which tokens of which requests run this step, under a token budget
    prepare.py          a step's inputs as flat arrays, in one copy to the device (chapter 9)
    input_batch.py      chapter 16: block tables in rows kept across steps, written by difference
    model_runner.py     a schedule -> one forward pass -> logits; cuda_graphs.py replays decode steps
    sampler.py          logits -> tokens (penalties.py, logprobs.py: what requests may ask for)
    structured_outputs/ chapter 13: outputs that fit a JSON schema, a regex, choices or a grammar
                        (xgrammar's bitmask, applied first thing in the sampler)
    detokenizer.py      tokens -> text, and stop strings
    outputs.py          RequestOutput and CompletionOutput, as vLLM's
    trace.py            a record of every step, for the chapters' pictures
    input_processor.py  chapter 15: a request checked and tokenized -> EngineCoreRequest (token ids)
    core.py             EngineCore: schedule -> run -> sample -> append; each step's new tokens out
    async_scheduling.py chapter 16: the core's step N+1 scheduled and launched while step N runs
    output_processor.py chapter 15: the core's news -> text, stop strings, RequestOutputs
    llm_engine.py       the online engine (the three above in one thread): add_request, step, abort_request
                        (the offline LLM, a loop around it, is ../llm.py: a way in, beside the server)
    spec_decode/        chapter 12: guesses (prompt lookup or a draft model), verified in one forward pass

It imports the model and attention below it, never the server, the stages or the benchmark kit.
"""
