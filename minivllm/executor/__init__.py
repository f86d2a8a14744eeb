"""Chapter 14, the engine's half: one step run by N ranks, each holding a shard of the model.

    tensor_parallel.py  rank 0: the engine's model runner, which also drives the other ranks
    worker.py           ranks 1 .. N-1: receive a step, run it, wait for the next
    step_messages.py    a step as one message from rank 0 to the others
    group.py            how the ranks find each other (spawned here, or started by torchrun)
    main_guard.py       a script without `if __name__ == "__main__":` stopped before it starts processes

The model's half (parallel layers, sharding, direct loading) is distributed/, beside the model.
"""
