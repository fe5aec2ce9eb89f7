"""The executor the engine core drives (vLLM v1's ``executor``): one rank in
the core's process (the rank actor), or ranks in processes of their own
over the control plane (:mod:`.remote`), the model loaded and the KV cache
sized (:mod:`.executor`).

The engine's one way down to the runner and the models. May import, of the
engine, only :mod:`asyncstep.engine.core` (the ``Executor`` protocol it
serves) and below.
"""
