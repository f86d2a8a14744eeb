"""What crosses between the frontend and the core process (chapter 15), as msgspec structs in
msgpack over ZMQ sockets.

Why msgspec and not pickle: a step at batch 128 sends 128 small records, every few
milliseconds; msgspec encodes and decodes typed structs several times faster than pickle and
refuses a malformed message instead of running it. Why ZMQ: message framing, queueing while the
other side is busy, and IPC sockets, with nothing to run in between.

Frontend -> core: AddRequest, Abort (whole requests), StopSequences (completions that a stop
string ended in the frontend), Shutdown. Core -> frontend: Ready once (then the resolved engine
facts), then per step a StepOutputs (the step's EngineCoreOutputs and the core's gauges), a
Refused for a request the core could not take (it fails alone), and Failed once if the core
itself breaks (then it exits).
"""
from __future__ import annotations

import msgspec

from minivllm.engine.core import EngineCoreOutput, EngineCoreStats
from minivllm.engine.input_processor import EngineCoreRequest


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request: EngineCoreRequest


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class StopSequences(msgspec.Struct, tag=True, array_like=True):
    sequences: list[tuple[str, int]]  # (request id, completion index)


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Ready(msgspec.Struct, tag=True, array_like=True):
    """Followed by one pickled message, once: (the engine's facts for /server_info, the resolved
    EngineConfig), which hold objects msgspec does not encode and cost nothing once."""

    pid: int


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[EngineCoreOutput]
    stats: EngineCoreStats
    step_start: float = 0.0  # time.perf_counter() around the step (0: no step ran, only the gauges changed)
    step_end: float = 0.0


class Refused(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    message: str
    bad_request: bool  # True: the request itself was at fault (a 400); False: the core failed on it (a 500)


class Failed(msgspec.Struct, tag=True, array_like=True):
    message: str


ToCore = AddRequest | Abort | StopSequences | Shutdown
FromCore = Ready | StepOutputs | Refused | Failed
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)
encoder = msgspec.msgpack.Encoder()
