"""What one ``Scheduler.schedule()`` call decides, and the
:class:`~asyncstep.datatypes.SchedulerOutput` built from it:
:class:`StepPlan`.

The scheduler fills the plan (its token budget, the running requests'
``CachedRequestData`` columns, the waiting requests it admits);
:meth:`StepPlan.build_output` turns it into the step's output with the
block ids from the KV cache manager.

The output's conventions, which the runner relies on:

* ``scheduled_new_reqs``: requests the runner has never seen, with ALL their
  block ids.
* ``scheduled_cached_reqs``: every other scheduled request. A request resumed
  after a preemption comes here with ``resumed_from_preemption=True`` and
  ``new_block_ids`` = ALL its block ids, which REPLACE the runner's (its
  ``num_computed_tokens`` restarts from its prefix-cache hits, often 0); for
  the others ``new_block_ids`` are the blocks appended this step. With
  several KV cache groups every such list holds the groups' ids interleaved
  (:mod:`asyncstep.kv_cache_interface`).
  ``new_token_ids`` holds, with ``send_new_token_ids`` (pipeline parallelism),
  the output tokens each request produced since the ranks last heard of it
  (stages that do not sample need them as inputs); else empty lists.
* ``num_computed_tokens`` in both is the value before this step's tokens.
* ``scheduled_spec_decode_tokens`` (speculative decoding): a running
  decode's draft tokens; its ``num_scheduled_tokens`` counts them (1 + the
  drafts), and ``num_computed_tokens`` the value before the step as for every
  request (the scheduler rolls back the rejected drafts when the output is
  back, so the next step's value is the true one).
* ``finished_req_ids``: requests that ended (or were aborted) since the previous
  ``schedule()``, reported exactly once, even in a step that schedules no
  tokens: the runner drops their state, then runs no forward when
  ``total_num_scheduled_tokens == 0``.

Pure Python; may import only ``asyncstep.datatypes`` and the engine's
``request`` and ``kv_cache_manager`` modules.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncstep.datatypes import CachedRequestData, NewRequestData, SchedulerOutput
from asyncstep.engine.core.kv_cache_manager import KVCacheManager
from asyncstep.engine.core.request import Request


class StepPlan:
    """What one ``schedule()`` call has decided so far.

    The running requests scheduled are advanced at once (``num_computed_tokens``
    and the in-flight counts); their ``CachedRequestData`` columns are filled
    as they go (``num_computed_tokens`` before the step). Admitted waiting
    requests are advanced once the output is built.
    """

    __slots__ = (
        "admitted_reqs",
        "new_reqs",
        "num_preempted",
        "num_scheduled_tokens",
        "resumed_reqs",
        "running_new_block_ids",
        "running_num_computed",
        "running_req_ids",
        "spec_token_ids",
        "token_budget",
    )

    def __init__(self, token_budget: int) -> None:
        # A plain class, not a dataclass: schedule() builds one every step.
        #: What is left of the step's token budget.
        self.token_budget = token_budget
        self.num_scheduled_tokens: dict[str, int] = {}
        self.new_reqs: list[Request] = []
        self.resumed_reqs: list[Request] = []
        #: Waiting requests admitted, new and resumed, in order.
        self.admitted_reqs: list[Request] = []
        self.running_req_ids: list[str] = []
        self.running_num_computed: list[int] = []
        self.running_new_block_ids: list[list[int]] = []
        self.num_preempted = 0
        #: Running requests given draft tokens this step (speculative decoding).
        self.spec_token_ids: dict[str, list[int]] = {}

    def has_room(self, max_num_seqs: int) -> bool:
        """Token budget left, and fewer than ``max_num_seqs`` requests."""
        return self.token_budget > 0 and len(self.num_scheduled_tokens) < max_num_seqs

    def build_output(
        self,
        step_id: int,
        kv: KVCacheManager,
        finished_req_ids: set[str],
        unsent_output_tokens: Callable[[str], list[int]] | None,
    ) -> SchedulerOutput:
        """The step's output; admitted waiting requests are not advanced yet.
        ``unsent_output_tokens``: a request's output tokens the ranks have not
        heard of (``new_token_ids``), None when they need none."""
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=list(r.prompt_token_ids),
                sampling_params=r.sampling_params,
                block_ids=kv.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
            )
            for r in self.new_reqs
        ]
        req_ids = self.running_req_ids
        num_running = len(req_ids)
        new_block_ids = self.running_new_block_ids
        num_computed = self.running_num_computed
        resumed = [False] * num_running
        for r in self.resumed_reqs:
            req_ids.append(r.request_id)
            resumed.append(True)
            new_block_ids.append(kv.get_block_ids(r.request_id))
            num_computed.append(r.num_computed_tokens)
        if unsent_output_tokens is not None:
            new_token_ids = [unsent_output_tokens(i) for i in req_ids]
        else:
            new_token_ids = [[] for _ in req_ids]
        cached_data = CachedRequestData(
            req_ids=req_ids,
            resumed_from_preemption=resumed,
            new_token_ids=new_token_ids,
            new_block_ids=new_block_ids,
            num_computed_tokens=num_computed,
        )
        return SchedulerOutput(
            step_id=step_id,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_data,
            num_scheduled_tokens=self.num_scheduled_tokens,
            # (not the budget spent: a prompt token that asks for log-probs takes more)
            total_num_scheduled_tokens=sum(self.num_scheduled_tokens.values()),
            finished_req_ids=sorted(finished_req_ids) if finished_req_ids else [],
            scheduled_spec_decode_tokens=self.spec_token_ids,
        )
