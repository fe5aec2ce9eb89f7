"""What the engine's subsystems share, at the bottom: the messages between
the front end and the engine core (:mod:`.core_messages`, msgpack on the
wire), what a caller gets back (:mod:`.outputs`, OpenAI's shapes), and the
markers of streamed text that the chat's parsers and the core's reasoning
gate both read (:mod:`.markers`).

May import no other part of the engine: only msgspec and the request types
(:mod:`asyncstep.datatypes`, :mod:`asyncstep.config`).
"""
