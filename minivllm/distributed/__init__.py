"""Chapter 14, the model's half: tensor parallelism — one model's weights cut across N ranks.

    layers.py       the parallel layers (column- and row-parallel linear, vocabulary-parallel
                    embedding and LM head) and the Communicator: every collective the model calls
    shard.py        rank r's shard of a Decoder: read it beside model.py
    direct_load.py  each rank reads only its own slices of a checkpoint
    simulate.py     N ranks as N threads of one process, to watch the collectives

The engine's half (rank 0 driving the other ranks each step) is executor/.
"""
