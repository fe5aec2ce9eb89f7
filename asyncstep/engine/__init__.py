"""The engine, by subsystem, each a sub-package that imports only those
below it (``tests/test_layers.py`` holds it so):

* :mod:`~asyncstep.engine.front_end`: requests in, text out: ``Engine``,
  ``open_engine``, ``LLM``, the door (input processor), detokenization;
* :mod:`~asyncstep.engine.transport`: the front end and the engine core in
  two processes: the client, the core's process, its several front ends;
* :mod:`~asyncstep.engine.executor`: the ranks the core drives, in its
  process or in processes of their own;
* :mod:`~asyncstep.engine.core`: the engine core: the scheduler, the KV block
  bookkeeping, the requests and the step loop;
* :mod:`~asyncstep.engine.structured_output`,
  :mod:`~asyncstep.engine.spec_decode` and :mod:`~asyncstep.engine.chat`:
  grammars, draft tokens, and what a chat reads and writes (templates, tool
  calls, reasoning);
* :mod:`~asyncstep.engine.messages`: what they share: the messages between
  the front end and the core, what a caller gets back, the markers of
  streamed text.

This package imports nothing itself: importing any sub-package runs this
file, so a name handed on here would tie every sub-package to the one it
comes from; ``asyncstep`` hands on the public names. Its sub-packages may
import every lower asyncstep package, anyio, transformers and tokenizers.
"""
