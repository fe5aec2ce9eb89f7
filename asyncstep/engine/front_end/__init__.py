"""The front end (vLLM v1's ``AsyncLLM`` and its processors): requests in,
text out, on the caller's event loop. :func:`~.api.open_engine` starts an
:class:`~.engine.Engine` (and its core, here or in a process of its own);
:class:`~.llm.LLM` is the blocking API over one. Each request is checked
and tokenized at the door (:mod:`.input_processor`, a chat's
:mod:`.chat_request`); the engine's serving (:mod:`.serving`) hands the
core's news to the requests in flight (:mod:`.output_processor`, off the
loop on :mod:`.output_thread`), which turn it into text for their callers
(:mod:`.request_state`, :mod:`.detokenizer`).

The engine's top: may import every other part of it.
"""
