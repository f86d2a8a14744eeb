"""The finished engine (chapters 6-8): block manager, scheduler, model runner, sampler, LLM."""
