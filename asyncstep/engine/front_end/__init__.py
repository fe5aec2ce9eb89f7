"""The front end (vLLM v1's ``AsyncLLM`` and its processors): requests in,
text out, on the caller's event loop. :func:`~.api.open_engine` starts an
:class:`~.engine.Engine` (and its core, here or in a process of its own);
:class:`~.llm.LLM` is the blocking API over one. Each request is checked
and tokenized at the door (:mod:`.input_processor`), and the core's news is
turned into text for its callers (:mod:`.request_state`,
:mod:`.detokenizer`, off the loop on :mod:`.output_thread`).

The engine's top: may import every other part of it.
"""
