"""Prometheus metrics of one server, named as vLLM names them (prefix
``asyncstep:``, label ``model_name``), in a registry of its own (so that
several apps in one process do not clash):

* gauges read from :meth:`Engine.statistics` when scraped:
  ``num_requests_running``, ``num_requests_waiting``,
  ``kv_cache_usage_perc`` (a fraction, 1 = full, as vLLM's),
  ``prefix_cache_hit_rate``; counters ``num_preemptions_total``,
  ``prefix_cache_queries_total`` and ``prefix_cache_hits_total`` (prompt
  tokens looked up and found, vLLM's; with
  data-parallel replicas these seven carry a ``replica`` label: one sample
  per replica, ``0``, ``1``, ..., and their sum, ``all``; the hit rate's
  from the summed hits and queries); with
  speculative decoding the counters ``spec_decode_num_drafts_total``,
  ``spec_decode_num_draft_tokens_total``,
  ``spec_decode_num_accepted_tokens_total`` and
  ``spec_decode_num_accepted_tokens_per_pos_total`` (label ``position``);
  for a MoE model the counter ``moe_expert_tokens_total`` (label ``expert``:
  token rows routed to that expert, summed over the MoE layers of the
  stage that reports the steps, the last pipeline stage: a hot expert shows);
* the first three gauges also as ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc``: the names
  external routers (llm-d's scorers, KServe) read, so that they route to an
  asyncstep server as to a vLLM one;
* counters: ``prompt_tokens_total`` (each prompt once, when admitted),
  ``generation_tokens_total`` (as tokens arrive, aborted requests' too),
  ``request_success_total`` by ``finished_reason`` (``stop``, ``length``,
  ``abort``: one per choice);
* histograms: ``time_to_first_token_seconds`` (arrival to the first token
  of any choice, one per request), ``inter_token_latency_seconds`` (one
  per token after each choice's first: a chunk of ``k`` tokens ``t``
  seconds after the previous one counts ``k`` times ``t / k``),
  ``e2e_request_latency_seconds`` (arrival to the last choice's end).

Times are the server's (``time.perf_counter``): they include the queue,
detokenization and the HTTP layer's own delay, not the network's.

Several API servers (``--api-server-count``): when ``PROMETHEUS_MULTIPROC_DIR``
names a directory (:func:`multiprocess_dir`; set by the supervisor before the
API servers start, empty, deleted once they all ended), each process's
counters and histograms live in files there (prometheus_client's
multiprocess mode; it is taken even if prometheus_client was imported before
the variable was set) and :meth:`ServerMetrics.render` answers with them
summed over every API server, dead ones included, plus the engine's gauges
and counter of the scraping process alone (the engine core is one: its
numbers are the same in every API server). The families are the same as in
one process, less the ``_created`` samples. No gauge lives in those files:
nothing to clean when an API server ends. One :class:`ServerMetrics` per
process then (two would write the same series).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from asyncstep.engine.front_end.data_parallel import DataParallelEngine
from asyncstep.errors import ConfigError

if TYPE_CHECKING:
    from asyncstep.engine.front_end.data_parallel import ServedEngine
    from asyncstep.engine.front_end.statistics import EngineStatistics

PREFIX = "asyncstep:"
#: The prefix of the gauges external routers read (:data:`ROUTER_GAUGES`).
VLLM_PREFIX = "vllm:"
#: The gauges also given under vLLM's own names.
ROUTER_GAUGES = frozenset({"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"})
#: The variable naming the directory where several API servers' metrics meet.
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: What ``GET /metrics`` answers with.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS: tuple[float, ...] = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def multiprocess_dir() -> str | None:
    """The directory where the API servers' metrics meet (``None``: this
    process's metrics are its own)."""
    return os.environ.get(MULTIPROCESS_DIR_ENV)


def _multiprocess_registry(path: str) -> CollectorRegistry:
    """A registry reading every process's series from ``path``."""
    if not os.path.isdir(path):
        raise ConfigError(f"{MULTIPROCESS_DIR_ENV}={path!r} is not a directory")
    if not values.ValueClass._multiprocess:
        # prometheus_client picks where values go when first imported: the
        # variable came later (set in this process, or before a fork).
        values.ValueClass = values.MultiProcessValue()
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path)
    return registry


class _EngineCollector(Collector):
    """The engine's counters, read when scraped."""

    def __init__(self, engine: ServedEngine, model_name: str) -> None:
        self._engine = engine
        self._labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.statistics()
        per_replica = self._per_replica()
        labels = ["model_name", "replica"] if per_replica else ["model_name"]
        gauges = (
            ("num_requests_running", "Requests in the running batch.", "num_running_reqs"),
            ("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting_reqs"),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use.", "kv_cache_usage"),
            (
                "prefix_cache_hit_rate",
                "Fraction of prompt tokens found in the prefix cache.",
                "prefix_cache_hit_rate",
            ),
        )
        for name, doc, field in gauges:
            prefixes = (PREFIX, VLLM_PREFIX) if name in ROUTER_GAUGES else (PREFIX,)
            for prefix in prefixes:
                gauge = GaugeMetricFamily(prefix + name, doc, labels=labels)
                self._add(gauge, stats, per_replica, field)
                yield gauge
        counters = (
            ("num_preemptions", "Requests preempted.", "num_preemptions"),
            (
                "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                "prefix_cache_queries",
            ),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
        )
        for name, doc, field in counters:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            self._add(counter, stats, per_replica, field)
            yield counter
        if stats.spec_decode_num_accepted_tokens_per_pos:  # speculative decoding is on
            yield from self._spec_decode(stats)
        if stats.moe_expert_tokens:  # a MoE model
            experts = CounterMetricFamily(
                PREFIX + "moe_expert_tokens",
                "Token rows routed to each expert (summed over the MoE layers).",
                labels=["model_name", "expert"],
            )
            for expert, value in enumerate(stats.moe_expert_tokens):
                experts.add_metric([*self._labels, str(expert)], value)
            yield experts

    def _per_replica(self) -> list[EngineStatistics]:
        """Each data-parallel replica's counters (none: one engine)."""
        engine = self._engine
        return engine.replica_statistics() if isinstance(engine, DataParallelEngine) else []

    def _add(
        self,
        family: GaugeMetricFamily | CounterMetricFamily,
        stats: EngineStatistics,
        per_replica: list[EngineStatistics],
        field: str,
    ) -> None:
        """``field``'s sample: one engine's, or each replica's and their sum
        (``replica="all"``)."""
        if not per_replica:
            family.add_metric(self._labels, getattr(stats, field))
            return
        for index, replica in enumerate(per_replica):
            family.add_metric([*self._labels, str(index)], getattr(replica, field))
        family.add_metric([*self._labels, "all"], getattr(stats, field))

    def _spec_decode(self, stats: EngineStatistics) -> Iterator[Metric]:
        """vLLM's speculative decoding counters."""
        counters = (
            ("spec_decode_num_drafts", "Drafts verified.", stats.spec_decode_num_drafts),
            (
                "spec_decode_num_draft_tokens",
                "Draft tokens verified.",
                stats.spec_decode_num_draft_tokens,
            ),
            (
                "spec_decode_num_accepted_tokens",
                "Draft tokens accepted.",
                stats.spec_decode_num_accepted_tokens,
            ),
        )
        for name, doc, value in counters:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric(self._labels, value)
            yield counter
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, per draft position.",
            labels=["model_name", "position"],
        )
        for position, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([*self._labels, str(position)], value)
        yield per_pos


class ServerMetrics:
    """The metrics of one server over one engine."""

    def __init__(self, engine: ServedEngine, model_name: str) -> None:
        path = multiprocess_dir()
        #: What :meth:`render` collects.
        self.registry = CollectorRegistry() if path is None else _multiprocess_registry(path)
        self.model_name = model_name
        labels = ["model_name"]
        # Several processes: the series go to files, read back from there.
        reg = self.registry if path is None else None
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens admitted.", labels, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated.", labels, registry=reg
        ).labels(model_name)
        self._success = Counter(
            PREFIX + "request_success",
            "Choices ended, by finish reason.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to the first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between two tokens of a choice.",
            labels,
            buckets=ITL_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from a request's arrival to its end.",
            labels,
            buckets=E2E_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.registry.register(_EngineCollector(engine, model_name))

    def success(self, finish_reason: str) -> None:
        self._success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, num_choices: int) -> RequestTimer:
        return RequestTimer(self, num_choices)


class RequestTimer:
    """One request's timings: feed it each chunk (by response choice), then
    :meth:`end` it."""

    def __init__(self, metrics: ServerMetrics, num_choices: int) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self._first_token = False
        #: Each choice's last token time (None: no token yet).
        self._last: list[float | None] = [None] * num_choices
        self._ended = [False] * num_choices

    def chunk(self, index: int, num_tokens: int, finish_reason: str | None) -> None:
        metrics = self.metrics
        if num_tokens:
            now = time.perf_counter()
            metrics.generation_tokens.inc(num_tokens)
            last = self._last[index]
            if not self._first_token:
                self._first_token = True
                metrics.ttft.observe(now - self.arrival)
            if last is None:  # this choice's first token: the others came with it
                gaps = [0.0] * (num_tokens - 1)
            else:
                gaps = [(now - last) / num_tokens] * num_tokens
            for gap in gaps:
                metrics.itl.observe(gap)
            self._last[index] = now
        if finish_reason is not None and not self._ended[index]:
            self._ended[index] = True
            metrics.success(finish_reason)

    def end(self) -> None:
        """The request is over: choices that did not finish were aborted."""
        for index, ended in enumerate(self._ended):
            if not ended:
                self._ended[index] = True
                self.metrics.success("abort")
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
