"""What one step of the model runner leaves behind: the state
``execute_model`` keeps for ``sample_tokens`` (:class:`ExecuteModelState`),
the step's device events (:class:`StepEvents`) and its host timings
(:class:`StepTimings`), which the rank reads for its step timeline.

Plain dataclasses; may import torch, ``asyncstep.datatypes``,
``asyncstep.device.stream`` and the runner's ``prompt_logprobs`` and
``spec_decode_metadata`` modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncstep.datatypes import SchedulerOutput
from asyncstep.device.stream import StreamEvent
from asyncstep.runner.prompt_logprobs import HostPromptLogprobs
from asyncstep.runner.spec_decode_metadata import SpecDecodeMetadata


@dataclass
class StepEvents:
    """Device events of one step (recorded only while tracing or when asked):
    the forward's start and end, and the end of sampling + the host copy."""

    forward_start: StreamEvent
    forward_end: StreamEvent
    copy_end: StreamEvent | None = None


@dataclass
class ExecuteModelState:
    """What ``execute_model`` leaves for ``sample_tokens``."""

    scheduler_output: SchedulerOutput
    req_ids: list[str]
    #: ``[len(sample_rows), vocab]``; a speculative step: one row per
    #: ``spec_decode_metadata`` logits index (drafts' and bonus positions).
    logits: torch.Tensor
    sample_rows: list[int]
    events: StepEvents | None = None
    #: The step's input ids and each sample row's last token index among
    #: them (the logits processing reads the newest tokens there).
    input_ids: torch.Tensor | None = None
    logits_indices: torch.Tensor | slice | None = None
    #: The step's prompt log-probs on their way to the host (a request asked).
    prompt_logprobs: HostPromptLogprobs | None = None
    #: A step with draft tokens (speculative decoding): where they are.
    spec_decode_metadata: SpecDecodeMetadata | None = None
    #: Set by ``sample_tokens`` from ``logits``: the rows of the draft positions,
    #: and every row (draft and bonus positions, masked by a grammar; log-probs).
    target_logits: torch.Tensor | None = None
    spec_logits: torch.Tensor | None = None
    #: The argmax of each ``logits`` row, computed by the step's FULL graph
    #: (:mod:`~asyncstep.runner.greedy_graph`); None: the graph did not.
    greedy_ids: torch.Tensor | None = None


@dataclass
class StepTimings:
    """Host seconds spent in the phases of the last step."""

    prepare: float = 0.0
    #: The launch: the forward call, the logits and the step's events.
    forward: float = 0.0
    sample: float = 0.0
    #: Of ``forward``, the forward call alone (a graph replay, or the eager forward).
    replay: float = 0.0
    #: Of ``sample``, applying the grammar bitmask.
    grammar: float = 0.0
