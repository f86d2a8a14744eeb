"""What a request is, in every layer of the engine: data and checks, no engine.

    sampling_params.py  SamplingParams: how one request wants its tokens chosen
    bad_words.py        vLLM's bad_words: words -> token sequences, and what they ban next
    sequence.py         a completion's tokens and the two counters the scheduler runs on;
                        SchedulerOutput, one step's plan, which the model runner reads
    logprobs.py         the top-k logprobs a request may ask for, packed and unpacked
    outputs.py          RequestOutput and CompletionOutput, as vLLM's
    messages.py         the wire between the frontend and the engine core (chapter 15):
                        EngineCoreRequest in, EngineCoreOutput out, msgspec structs

The frontend (engine/), the core (core/) and the model runner (worker/) all speak these types,
so they sit below all three; they import nothing of the engine.
"""
