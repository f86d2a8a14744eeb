"""The measuring kit: everything that times, counts or compares, and nothing the engine needs.

    workloads.py   the standard seeded workloads (classroom, nano, shared prefix, chats, ...)
    harness.py     time a stage on a workload, tables, the chapter scripts' command line, JSON results
    timing.py      device timing: synchronised wall clocks, CUDA events, graph replays, copy bandwidth
    latency.py     TTFT, TPOT, ITL and E2E of a timed request, and their percentiles
    online.py      requests arriving over time, continuous against static batching (chapter 7)
    peers.py       transformers' own generate and generate_batch on the same requests
    kv_memory.py   what paging buys, computed from counters (chapter 6)
    kernels.py     chapter 8's decode-kernel benchmark against SDPA and copy bandwidth
    profiling.py   where one engine step's time goes, from torch.profiler (chapter 9)
    roofline.py    the memory floor of a workload (chapter 9)
    load.py        an HTTP load generator for the server (chapter 10)
    tour.py        `minivllm tour`: every stage of the ladder on one workload

It sits above the engine and the server and may import them; nothing below imports it. Machine
facts (device name, versions, synchronize) live in minivllm/machine.py, so that the server can
report them without importing this kit.
"""
