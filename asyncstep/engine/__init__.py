"""The engine: scheduler, KV block manager, requests, detokenizer, and the
public ``open_engine`` / :class:`Engine` API.

May import every other asyncstep package, anyio, transformers and tokenizers.
The scheduler and KV cache manager themselves stay pure Python.
"""
