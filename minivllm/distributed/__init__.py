"""Chapter 14: tensor parallelism — one model across several processes, on torch.distributed.

    layers.py    the parallel layers (column- and row-parallel linear, vocabulary-parallel embedding
                 and LM head) and the Communicator: every collective the model calls
    shard.py     rank r's shard of a Decoder: read it beside model.py
    messages.py  a step as one message from rank 0 to the others
    group.py     how the ranks find each other (spawned here, or started by torchrun)
    worker.py    ranks 1 .. N-1: receive a step, run it, wait for the next
    executor.py  rank 0: the engine's model runner, which also drives the other ranks

It sits beside the engine: the engine builds a TensorParallelRunner when tensor_parallel_size > 1,
and nothing above the model runner changes.
"""
