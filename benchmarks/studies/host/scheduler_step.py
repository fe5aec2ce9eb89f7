"""Host cost of the scheduler's two per-step calls while requests decode.

Builds a :class:`Scheduler` (prefix caching on, ``block_size`` 16,
``max_model_len`` 2048) with 1, 32 and 256 running requests (``ignore_eos``,
``max_tokens`` large enough that none finishes), prefills them outside the
timed region, then times ``schedule()`` and ``update_from_output()`` per step
as the engine calls them: with async scheduling one step ahead (schedule N+1,
then update N), without it one step at a time. Every request decodes one
token per step, so it crosses a block boundary (allocation, prefix-cache
hashing) every 16 steps. The ``ModelRunnerOutput`` is built outside the timed
region. Reports the best of ``--repeats`` runs, in microseconds per step.

python3 benchmarks/studies/host/scheduler_step.py                # the table
# plus cProfile, 256 requests, async:
python3 benchmarks/studies/host/scheduler_step.py --profile 256
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import time
from collections import deque

from asyncstep.config import CacheConfig, SchedulerConfig
from asyncstep.datatypes import ModelRunnerOutput, SamplingParams, SchedulerOutput
from asyncstep.engine.core.request import Request
from asyncstep.engine.core.scheduler import Scheduler

BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
PROMPT_LEN = 128
EOS = 2


def build(num_reqs: int, async_scheduling: bool) -> Scheduler:
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=max(num_reqs, 1)),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        num_blocks=num_reqs * MAX_MODEL_LEN // BLOCK_SIZE + 16,
        async_scheduling=async_scheduling,
        max_model_len=MAX_MODEL_LEN,
    )
    params = SamplingParams(max_tokens=MAX_MODEL_LEN, ignore_eos=True, temperature=0.0)
    for i in range(num_reqs):
        prompt = [(i * 7919 + j * 31) % 30000 + 10 for j in range(PROMPT_LEN)]
        sched.add_request(Request(f"req-{i}", prompt, params, (EOS,)))
    return sched


def runner_output(out: SchedulerOutput, step: int) -> ModelRunnerOutput:
    """One sampled token per request (none for a prompt chunk that is not its last)."""
    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[(step * 131 + i) % 30000 + 10] for i in range(len(req_ids))],
    )


class Driver:
    """The engine's loop: schedule, run (here: make the output), update."""

    def __init__(self, num_reqs: int, async_scheduling: bool) -> None:
        self.sched = build(num_reqs, async_scheduling)
        self.depth = 2 if async_scheduling else 1
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.step = 0

    def run(self, num_steps: int) -> tuple[float, float]:
        """Run ``num_steps`` schedule/update pairs; seconds spent in each.

        The steps' outputs are kept until the end, so that freeing them (the
        engine does it elsewhere) is not counted in either call."""
        sched, in_flight = self.sched, self.in_flight
        perf = time.perf_counter
        t_schedule = t_update = 0.0
        keep: list[object] = []
        for _ in range(num_steps):
            t0 = perf()
            out = sched.schedule()
            t_schedule += perf() - t0
            in_flight.append((out, runner_output(out, self.step)))
            self.step += 1
            if len(in_flight) < self.depth:
                continue
            out, mro = in_flight.popleft()
            t0 = perf()
            news = sched.update_from_output(out, mro)
            t_update += perf() - t0
            keep.append((out, mro, news))
        del keep
        return t_schedule, t_update

    def warm_up(self) -> None:
        """Prefill every prompt and decode a few tokens: all requests decoding."""
        self.run(40)
        assert len(self.sched.running) == len(self.sched.requests)
        assert all(r.num_output_tokens > 0 for r in self.sched.running)


def measure(num_reqs: int, async_scheduling: bool, steps: int, repeats: int) -> tuple[float, float]:
    """Best of ``repeats`` (fresh scheduler each): us per step for schedule, update."""
    best_s = best_u = float("inf")
    for _ in range(repeats):
        driver = Driver(num_reqs, async_scheduling)
        driver.warm_up()
        gc.collect()
        gc.disable()
        try:
            t_s, t_u = driver.run(steps)
        finally:
            gc.enable()
        best_s = min(best_s, t_s / steps * 1e6)
        best_u = min(best_u, t_u / steps * 1e6)
    return best_s, best_u


def profile(num_reqs: int, steps: int, top: int) -> str:
    driver = Driver(num_reqs, async_scheduling=True)
    driver.warm_up()
    prof = cProfile.Profile()
    prof.enable()
    driver.run(steps)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reqs", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--steps", type=int, default=320, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", type=int, metavar="N", help="cProfile N requests, async")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    print(f"scheduler step, best of {args.repeats} x {args.steps} steps (us per step)")
    print(f"{'reqs':>5} {'async':>6} {'schedule':>10} {'update':>10} {'total':>10} {'us/req':>8}")
    for num_reqs in args.reqs:
        for async_scheduling in (True, False):
            s, u = measure(num_reqs, async_scheduling, args.steps, args.repeats)
            per_req = (s + u) / num_reqs
            print(
                f"{num_reqs:>5} {'on' if async_scheduling else 'off':>6} "
                f"{s:>10.1f} {u:>10.1f} {s + u:>10.1f} {per_req:>8.2f}"
            )
    if args.profile:
        print(profile(args.profile, args.steps, args.top))


if __name__ == "__main__":
    main()
