"""What a chat reads and writes, for ``Engine.chat`` and the HTTP server
alike: chat messages and templates (:mod:`.chat_messages`), tools and the
calls a grammar forces (:mod:`.tools`), the tool-call parsers of ``auto``
(:mod:`.tool_parsers`), the reasoning parsers (:mod:`.reasoning`), and a
reply read apart into thinking, answer and calls (:mod:`.chat_replies`).

May import, of the engine, only :mod:`asyncstep.engine.messages`.
"""
