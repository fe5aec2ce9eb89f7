"""One step of the model on a rank: the ``ModelRunner`` (vLLM v1's two-phase
``execute_model`` / ``sample_tokens``), its persistent ``InputBatch``, block
table and slot mapping, step inputs, the CUDA-graph dispatcher and runner,
micro-batches, the sampler and async outputs.

May import device, ops, models, config, datatypes, logging.
"""
