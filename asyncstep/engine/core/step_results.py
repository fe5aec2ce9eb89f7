"""A step's results per request, the scheduler's ``update_from_output`` less
its queues: :func:`collect_step_results` (settle each request's in-flight
accounting, append its sampled tokens and apply the stop rules; each
request's news an :class:`~asyncstep.engine.messages.core_messages.EngineCoreOutput`)
and the stop rules themselves (:func:`check_stop`, vLLM's ``check_stop``).

The scheduler frees and releases what these functions report; they touch
only the requests. Pure Python; may import only the standard library,
msgspec, ``asyncstep.datatypes``, its sibling ``request``,
``asyncstep.engine.spec_decode.metrics`` and
``asyncstep.engine.messages.core_messages``.
"""

from __future__ import annotations

import msgspec

from asyncstep.datatypes import Logprobs, ModelRunnerOutput, SchedulerOutput
from asyncstep.engine.core.request import FIRST_FINISHED_STATUS, Request, RequestStatus
from asyncstep.engine.messages.core_messages import EngineCoreOutput
from asyncstep.engine.spec_decode.metrics import SpecDecodingStats

#: The sampled tokens of a request the runner's output does not list.
_NO_TOKENS: list[int] = []


def collect_step_results(
    scheduler_output: SchedulerOutput,
    model_runner_output: ModelRunnerOutput,
    requests: dict[str, Request],
    finishing: dict[str, Request],
    max_seq_len: int,
    spec_stats: SpecDecodingStats | None = None,
) -> tuple[dict[str, EngineCoreOutput], list[Request], list[Request]]:
    """The step's sampled tokens appended to its requests (``requests``
    running or waiting, ``finishing`` ended with steps in flight), with the
    stop rules applied. Returns an output for each request that got tokens
    or finished (requests aborted since ``schedule()`` are skipped), the
    requests that stopped (to release), and the ended requests no step holds
    any more (taken out of ``finishing``; to free), each in step order.

    A request that verified draft tokens (``scheduled_spec_decode_tokens``)
    first has its rejected drafts rolled back (``num_computed_tokens``), also
    when it ended meanwhile (its blocks are freed, and their hashes
    registered, from the true count), and is counted in ``spec_stats``."""
    outputs: dict[str, EngineCoreOutput] = {}
    stopped: list[Request] = []
    freed: list[Request] = []
    index_of = model_runner_output.req_id_to_index
    all_sampled = model_runner_output.sampled_token_ids
    all_logprobs = model_runner_output.logprobs
    first_finished = FIRST_FINISHED_STATUS
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    for req_id in scheduler_output.num_scheduled_tokens:
        request = requests.get(req_id) or finishing.get(req_id)
        if request is None:
            continue
        index = index_of.get(req_id)
        sampled = all_sampled[index] if index is not None else _NO_TOKENS
        num_sampled = len(sampled)
        # The step is back: settle its accounting.
        request.num_in_flight_steps -= 1
        placeholders = request.num_output_placeholders
        if placeholders:
            request.num_output_placeholders = (
                placeholders - num_sampled if placeholders > num_sampled else 0
            )
        if spec_tokens and num_sampled:
            drafts = spec_tokens.get(req_id)
            if drafts:
                settle_drafts(request, len(drafts), num_sampled - 1, spec_stats)
        if request.status >= first_finished:
            # Ended (the token of a late stop is dropped); free once no step holds it.
            if request.num_in_flight_steps == 0:
                finishing.pop(req_id, None)
                freed.append(request)
            continue
        if num_sampled == 1:  # a decode: one inline check of every stop rule
            token_id = sampled[0]
            request.append_output_token_id(token_id)
            new_token_ids = [token_id]
            num_tokens = request.num_tokens
            finished = (
                token_id in request.stop_ids
                or num_tokens >= request.max_num_tokens
                or num_tokens >= max_seq_len
            ) and check_stop(request, token_id, max_seq_len)
        elif num_sampled:
            new_token_ids = append_until_stop(request, sampled, max_seq_len)
            finished = request.status >= first_finished
        else:
            continue  # a prompt chunk
        logprobs = None
        if all_logprobs is not None and index is not None:
            logprobs = all_logprobs[index][: len(new_token_ids)]
        if finished:
            stopped.append(request)
            outputs[req_id] = EngineCoreOutput(
                req_id, new_token_ids, request.finish_reason, request.stop_reason, logprobs
            )
        else:
            outputs[req_id] = EngineCoreOutput(
                req_id, new_token_ids, None, request.stop_reason, logprobs
            )
    return outputs, stopped, freed


#: The most decodes a request goes without drafts after verify steps that
#: accepted none (see :func:`settle_drafts`).
MAX_SPEC_BACKOFF = 64


def settle_drafts(
    request: Request,
    num_draft_tokens: int,
    num_accepted: int,
    spec_stats: SpecDecodingStats | None,
) -> None:
    """Roll back a request's rejected drafts: the step computed
    ``1 + num_draft_tokens`` tokens, of which the last token before the
    drafts and the ``num_accepted`` accepted drafts stay computed (the
    rejected drafts' KV slots are written again by the next step). A
    preempted request (its count already 0) is left alone.

    Back-off: after ``m`` verify steps in a row that accepted no draft, the
    request's next ``min(2**m - 1, MAX_SPEC_BACKOFF)`` decodes go without
    drafts (and overlap like any decode); an accepted draft ends it. Drafts
    that never pass then cost one verify step in ``MAX_SPEC_BACKOFF + 1``."""
    if request.status != RequestStatus.PREEMPTED:
        request.num_computed_tokens -= num_draft_tokens - num_accepted
    if num_accepted:
        request.spec_misses = 0
    elif num_draft_tokens:
        request.spec_misses += 1
        request.spec_backoff = min(2**request.spec_misses - 1, MAX_SPEC_BACKOFF)
    if spec_stats is not None:
        spec_stats.observe(num_draft_tokens, num_accepted)


def add_prompt_logprobs(
    outputs: dict[str, EngineCoreOutput],
    prompt_logprobs: dict[str, list[Logprobs]],
    requests: dict[str, Request],
) -> None:
    """The step's prompt log-probs into the outputs: with its tokens, or
    alone (a prompt chunk) for a request still in ``requests``."""
    for req_id, logprobs in prompt_logprobs.items():
        output = outputs.get(req_id)
        if output is not None:
            outputs[req_id] = msgspec.structs.replace(output, new_prompt_logprobs=logprobs)
        elif req_id in requests:
            outputs[req_id] = EngineCoreOutput(req_id, [], new_prompt_logprobs=logprobs)


def append_until_stop(request: Request, sampled: list[int], max_seq_len: int) -> list[int]:
    """Append tokens one by one until a stop rule fires; returns those appended."""
    for count, token_id in enumerate(sampled, start=1):
        request.append_output_token_id(token_id)
        if check_stop(request, token_id, max_seq_len):
            return sampled[:count]
    return list(sampled)


def check_stop(request: Request, token_id: int, max_seq_len: int) -> bool:
    """Apply the stop rules to the request's newest token (its status set
    when one fires). A stop id counts only once ``min_tokens`` tokens are
    out (vLLM's ``check_stop``; the sampler bans them before that, so this
    guards the rule only); ``max_seq_len`` caps the sequence."""
    if token_id in request.stop_ids and request.num_output_tokens >= request.min_tokens:
        request.status = RequestStatus.FINISHED_STOPPED
        if request.sampling_params.ignore_eos or token_id not in request.eos_token_ids:
            request.stop_reason = token_id  # a stop token id, not EOS
    elif request.num_tokens >= request.max_num_tokens or request.num_tokens >= max_seq_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    else:
        return False
    return True
