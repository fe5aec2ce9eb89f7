"""Speculative decoding's parts that the scheduler holds (vLLM v1's
``spec_decode``): the n-gram proposer (:mod:`.ngram_proposer`), the draft
model's proposals kept between steps (:mod:`.draft_model_drafts`), and the
counters of drafts proposed and accepted (:mod:`.metrics`). The draft model
itself runs in the model runner.

Pure Python and numpy; may import no other part of the engine, only
:mod:`asyncstep.config`.
"""
