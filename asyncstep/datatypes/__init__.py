"""Data types shared by every room, one module a concept (vLLM's names):
requests' sampling parameters (:mod:`.sampling_params`), the scheduler's
per-step output (:mod:`.scheduler_output`), the runner's per-step output
(:mod:`.outputs`), the weight bytes a step reads (:mod:`.weight_reads`) and
the activations between pipeline stages (:mod:`.intermediate_tensors`);
every public name is imported from here.

The wire types are msgspec Structs (typed, no pickle), so the same objects go
through an in-process memory channel or over a socket to another rank. This
package imports nothing heavy (no torch at run time), so every package may use it.
"""

from __future__ import annotations

from asyncstep.datatypes.intermediate_tensors import IntermediateTensors
from asyncstep.datatypes.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    FinishReason,
    Logprobs,
    ModelRunnerOutput,
)
from asyncstep.datatypes.sampling_params import (
    GREEDY_EPSILON,
    MAX_COUNT,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PENALTY,
    MAX_SEED,
    TOP_K_OFF,
    SamplingParams,
)
from asyncstep.datatypes.scheduler_output import (
    CachedRequestData,
    GrammarOutput,
    NewRequestData,
    RankInput,
    SchedulerOutput,
)
from asyncstep.datatypes.weight_reads import ExpertReads, PackedReads, WeightReads

__all__ = [
    "EMPTY_MODEL_RUNNER_OUTPUT",
    "GREEDY_EPSILON",
    "MAX_COUNT",
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_PENALTY",
    "MAX_SEED",
    "TOP_K_OFF",
    "CachedRequestData",
    "ExpertReads",
    "FinishReason",
    "GrammarOutput",
    "IntermediateTensors",
    "Logprobs",
    "ModelRunnerOutput",
    "NewRequestData",
    "PackedReads",
    "RankInput",
    "SamplingParams",
    "SchedulerOutput",
    "WeightReads",
]
