"""The ways in, as vLLM's entrypoints/: the offline `LLM` (llm.py), the `minivllm` command (cli.py)
and the OpenAI-compatible server (openai/). Each is a thin layer over the frontend (engine/)."""
