"""Chapter 15: the engine core in a process of its own.

    messages.py   what crosses between the frontend and the core: msgspec structs over ZMQ
    loop.py       the core process: a busy loop around EngineCore.step() that reads its inbox
                  between steps and sends each step's news in one message
    client.py     the frontend's side: starts the process, sends requests and aborts, reads
                  the steps' news, and notices when the process dies

It sits above the engine (it runs an EngineCore) and below the server (which runs a client).
"""
