"""The scheduler section: :class:`SchedulerConfig`, and a step's token
budget when none is given (per device). Imports msgspec,
:mod:`asyncstep.errors` and :mod:`asyncstep.cpu_features` only.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from asyncstep.config.utils import field_doc
from asyncstep.cpu_features import cpu_has_bf16
from asyncstep.errors import ConfigError

#: A step's token budget (``max_num_batched_tokens``) when none is given, on CUDA.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
#: ... and on the CPU, where a step's time grows with its tokens (about a
#: millisecond each where the CPU multiplies bfloat16, 4 to 5 in float32 on
#: AVX2): small enough that a step of the embedded model stays under a
#: second, so no stream's next token (nor an abort, which waits for the step
#: in flight) waits long behind a long prompt's prefill (chunked over
#: steps). The study that picked it: ``benchmarks/studies/cpu_step_budget/README.md``
#: (its question, command, figures and decision); run it again when the CPU
#: forward changes. Where the CPU multiplies bfloat16 (AVX512-BF16, AMX):
CPU_MAX_NUM_BATCHED_TOKENS = 256
#: ... elsewhere (the model runs float32).
CPU_FLOAT32_MAX_NUM_BATCHED_TOKENS = 128


def cpu_max_num_batched_tokens() -> int:
    """The CPU's step budget when none is given: by whether it multiplies bfloat16."""
    return CPU_MAX_NUM_BATCHED_TOKENS if cpu_has_bf16() else CPU_FLOAT32_MAX_NUM_BATCHED_TOKENS


class SchedulerConfig(msgspec.Struct, kw_only=True):
    """Continuous batching limits.

    ``max_num_seqs``: with pipeline parallelism each of the ``pp_size`` steps
    in flight holds different requests, so up to ``pp_size * max_num_seqs``
    run at once (vLLM v0's virtual engines).

    ``max_concurrent_batches``: the engine's batch queue; 0 chooses (see
    :attr:`EngineConfig.batch_queue_size`). With overlap, 3 also hides the
    engine's update and schedule of a step behind the device (a stop is then
    found two steps late: the extra tokens are dropped). On the CPU with one
    pipeline stage, 0 is one step at a time: a step queued behind the one
    computing is a whole forward there, and an abort (taken between steps)
    would wait for it too; what overlap would hide, the engine's update and
    schedule of a step, is small beside a CPU forward.

    ``gil_switch_interval_s``: the launch thread and the event loop share the
    GIL; a short interval keeps their hand-offs from stalling the device.

    ``max_num_batched_tokens`` None is resolved for the device when the
    engine starts (:meth:`EngineConfig.resolve_for_device`): the config it
    hands on carries the number.
    """

    max_num_batched_tokens: Annotated[
        int | None,
        field_doc(
            "token budget of one step (prompt chunks + decodes); none: "
            f"{DEFAULT_MAX_NUM_BATCHED_TOKENS} on CUDA, {CPU_MAX_NUM_BATCHED_TOKENS} on a CPU "
            f"that multiplies bfloat16, else {CPU_FLOAT32_MAX_NUM_BATCHED_TOKENS}"
        ),
    ] = None
    max_num_seqs: Annotated[int, field_doc("most requests in one step")] = 64
    enable_chunked_prefill: Annotated[
        bool, field_doc("split long prompts over several steps (chunked prefill)")
    ] = True
    async_scheduling: Annotated[
        bool,
        field_doc(
            "overlap: launch step N+1 while step N is sampled and delivered "
            "(off: one step at a time, for ablation and debugging)"
        ),
    ] = True
    max_concurrent_batches: Annotated[
        int,
        field_doc(
            "steps in flight; 0: 1 without overlap or on the CPU, 2 with overlap on CUDA, "
            "the pipeline depth with PP"
        ),
    ] = 0
    gil_switch_interval_s: Annotated[
        float | None,
        field_doc("sys.setswitchinterval while a rank serves; none: Python's 5 ms"),
    ] = 0.0005

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ConfigError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_concurrent_batches < 0:
            raise ConfigError(
                "max_concurrent_batches must be 0 (automatic) or positive, "
                f"got {self.max_concurrent_batches}"
            )
        if self.gil_switch_interval_s is not None and not self.gil_switch_interval_s > 0:
            raise ConfigError(
                "gil_switch_interval_s must be positive (or None), "
                f"got {self.gil_switch_interval_s}"
            )
