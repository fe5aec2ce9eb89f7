"""asyncstep: a structured-concurrency (Trio) runtime for LLM inference workers.

::

    import asyncstep, trio

    async def main():
        async with asyncstep.open_engine() as engine:  # embedded SmolLM2-135M-Instruct
            out = await engine.generate(
                [{"role": "user", "content": "What is the capital of France?"}],
                asyncstep.SamplingParams(temperature=0, max_tokens=32),
            )
            print(out.text)

    trio.run(main)

Or, from code that never writes ``async`` (scripts, notebooks, WSGI views)::

    with asyncstep.LLM() as llm:
        outs = llm.generate(["The capital of France is"], asyncstep.SamplingParams(max_tokens=32))
"""

from asyncstep.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from asyncstep.datatypes import FinishReason, Logprobs, SamplingParams
from asyncstep.engine.front_end.api import make_config, open_engine
from asyncstep.engine.front_end.data_parallel import DataParallelEngine, open_data_parallel_engine
from asyncstep.engine.front_end.engine import Engine
from asyncstep.engine.front_end.llm import LLM
from asyncstep.engine.front_end.statistics import EngineStatistics
from asyncstep.engine.messages.outputs import (
    ChatChunk,
    ChatCompletion,
    ChatOutput,
    Completion,
    CompletionChunk,
    CompletionOutput,
    DeltaToolCall,
    ToolCall,
)
from asyncstep.errors import (
    AsyncstepError,
    ConfigError,
    EngineDeadError,
    EngineLoopError,
    InvalidRequestError,
    ModelLoadError,
    UnsupportedModelError,
)
from asyncstep.structured_params import StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncstepError",
    "CacheConfig",
    "ChatChunk",
    "ChatCompletion",
    "ChatOutput",
    "CompilationConfig",
    "Completion",
    "CompletionChunk",
    "CompletionOutput",
    "ConfigError",
    "DataParallelEngine",
    "DeltaToolCall",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineLoopError",
    "EngineStatistics",
    "FinishReason",
    "InvalidRequestError",
    "Logprobs",
    "ModelConfig",
    "ModelLoadError",
    "ParallelConfig",
    "SamplingParams",
    "SchedulerConfig",
    "StructuredOutputsParams",
    "ToolCall",
    "UnsupportedModelError",
    "make_config",
    "open_data_parallel_engine",
    "open_engine",
]
