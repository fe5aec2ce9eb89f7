"""Engine configuration: model, cache, scheduler, parallel, compilation,
structured-output and speculative decoding settings, one module a section
(vLLM's names: :mod:`.model`, :mod:`.cache`, :mod:`.scheduler`,
:mod:`.parallel`, :mod:`.compilation`, :mod:`.structured_outputs`,
:mod:`.speculative`), the whole in :mod:`.engine` and the flat options of
a struct in :mod:`.options`; every public name is imported from here.

Every section is a keyword-only :class:`msgspec.Struct`: the whole
:class:`EngineConfig` is msgpack-encodable and travels as it is to the engine
core and to every rank. Each section validates itself in ``__post_init__``
(run on construction and on decode alike) with one-line
:class:`~asyncstep.errors.ConfigError` messages. Each user-facing field carries
its one-line description (``msgspec.Meta(description=...)``, choices in
``extra``): :func:`engine_options` reads them, and so ``make_config``'s
keywords and the CLI's flags are derived from the fields, written once.
Imports nothing heavy.
"""

from __future__ import annotations

from asyncstep.config.cache import CacheConfig
from asyncstep.config.compilation import (
    ATTENTION_BACKENDS,
    CUDAGRAPH_MODES,
    GPU_Q4_ACTIVATIONS,
    CompilationConfig,
)
from asyncstep.config.engine import EngineConfig, config_error, decode_config, engine_options
from asyncstep.config.model import DTYPES, LOAD_FORMATS, WEIGHT_PACKINGS, ModelConfig
from asyncstep.config.options import EngineOption, struct_options
from asyncstep.config.parallel import (
    DATA_PARALLEL_ROUTINGS,
    MAX_DATA_PARALLEL_SIZE,
    ParallelConfig,
)
from asyncstep.config.scheduler import (
    CPU_FLOAT32_MAX_NUM_BATCHED_TOKENS,
    CPU_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    SchedulerConfig,
    cpu_max_num_batched_tokens,
)
from asyncstep.config.speculative import (
    DEFAULT_PROMPT_LOOKUP,
    MAX_SPECULATIVE_TOKENS,
    SPECULATIVE_METHODS,
    SpeculativeConfig,
    SpeculativeSection,
)
from asyncstep.config.structured_outputs import REASONING_PARSERS, StructuredOutputsConfig
from asyncstep.config.utils import field_doc

__all__ = [
    "ATTENTION_BACKENDS",
    "CPU_FLOAT32_MAX_NUM_BATCHED_TOKENS",
    "CPU_MAX_NUM_BATCHED_TOKENS",
    "CUDAGRAPH_MODES",
    "DATA_PARALLEL_ROUTINGS",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_PROMPT_LOOKUP",
    "DTYPES",
    "GPU_Q4_ACTIVATIONS",
    "LOAD_FORMATS",
    "MAX_DATA_PARALLEL_SIZE",
    "MAX_SPECULATIVE_TOKENS",
    "REASONING_PARSERS",
    "SPECULATIVE_METHODS",
    "WEIGHT_PACKINGS",
    "CacheConfig",
    "CompilationConfig",
    "EngineConfig",
    "EngineOption",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "SpeculativeSection",
    "StructuredOutputsConfig",
    "config_error",
    "cpu_max_num_batched_tokens",
    "decode_config",
    "engine_options",
    "field_doc",
    "struct_options",
]
