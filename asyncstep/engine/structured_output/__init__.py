"""Structured outputs (vLLM v1's ``structured_output``): a grammar checked
at the door (:mod:`.grammar`, :mod:`.grammar_budget`), compiled in worker
processes under limits (:mod:`.grammar_pool`, :mod:`.grammar_worker`,
:mod:`.grammar_messages`, :mod:`.fair_queue`), kept (:mod:`.grammar_cache`),
and applied by the engine core to each step's tokens (:mod:`.manager`,
after the thinking: :mod:`.reasoning_gate`).

May import, of the engine, only :mod:`asyncstep.engine.messages`; xgrammar
is imported on first use.
"""
