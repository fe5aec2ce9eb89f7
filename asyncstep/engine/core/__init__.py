"""The engine core (vLLM v1's ``EngineCore`` over its ``core``): the requests
as the core tracks them (:mod:`.request`), the KV block bookkeeping
(:mod:`.kv_cache_manager`; over KV cache groups
:mod:`.hybrid_kv_cache_manager`), the scheduler (:mod:`.scheduler`, its step
plan, token budget, draft tokens and step results), and the step loop that
drives an executor (:mod:`.engine_core`). It knows no text and no transport.

May import, of the engine, :mod:`asyncstep.engine.messages`,
:mod:`asyncstep.engine.spec_decode` and
:mod:`asyncstep.engine.structured_output`; the scheduler's modules are pure
Python.
"""
