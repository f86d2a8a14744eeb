"""The engine core (chapters 6-7, 11-13, 15-16): requests in as token ids, each step's new tokens out.

    engine_core.py      EngineCore: schedule -> launch (run, sample) -> finish (append, retire)
    scheduler.py        which tokens of which requests run this step, under a token budget
    block_manager.py    the paged KV cache's blocks (chapter 6); prefix_cache.py shares them (chapter 11)
    async_scheduling.py chapter 16: step N+1 scheduled and launched before step N is finished
    spec_decode/        chapter 12: guesses (prompt lookup or a draft model), verified in one pass
    trace.py            a record of every step, for the chapters' pictures
    process.py          chapter 15: the core in a process of its own, a busy loop around step()

It drives the model runner (worker/, or executor/ across ranks) and is driven by the frontend
(engine/), through the messages of request/messages.py.
"""
