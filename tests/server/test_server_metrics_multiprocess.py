"""``/metrics`` of several API servers (``PROMETHEUS_MULTIPROC_DIR`` set):
three processes serve known amounts, two of them exit (one set the variable
only after importing prometheus_client), the third renders: its counters and
histograms are the three processes' sums, its engine gauges its own, and the
families, names and labels are what one process serving all of it renders
without the variable (less the ``_created`` samples). No model: the engine
is a fake with ``statistics()``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from asyncstep.engine.front_end.statistics import EngineStatistics
from asyncstep.server.metrics import MULTIPROCESS_DIR_ENV, ServerMetrics

MODEL = "m"
TESTS = Path(__file__).parent
#: What each child runs: ``serve`` with its ``k``; the scraper renders once
#: the test says the others are gone.
CHILD = """
import os, sys
sys.path.insert(0, sys.argv[1])
from asyncstep.server.metrics import ServerMetrics
from test_server_metrics_multiprocess import MODEL, FakeEngine, serve, statistics

k, role = int(sys.argv[2]), sys.argv[3]
if role == "late":
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[4]
metrics = ServerMetrics(FakeEngine(statistics(k)), MODEL)
serve(metrics, k)
if role == "scraper":
    sys.stdin.readline()
    sys.stdout.buffer.write(metrics.render())
"""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class FakeEngine:
    def __init__(self, stats: EngineStatistics) -> None:
        self.stats = stats

    def statistics(self) -> EngineStatistics:
        return self.stats


def statistics(k: int) -> EngineStatistics:
    """Numbers of the engine as the ``k``-th process sees it."""
    return EngineStatistics(
        num_running_reqs=k,
        num_waiting_reqs=2 * k,
        num_steps=0,
        num_preemptions=3 * k,
        num_generated_tokens=0,
        num_finished_reqs=0,
        kv_cache_usage=k / 8,
        num_kv_blocks=0,
        prefix_cache_hit_rate=k / 16,
    )


def serve(metrics: ServerMetrics, k: int) -> None:
    """What the ``k``-th API server serves (sums exact in binary)."""
    metrics.prompt_tokens.inc(7 * k)
    metrics.generation_tokens.inc(k)
    for _ in range(k):
        metrics.success("stop")
    if k != 2:
        metrics.success("length")
    metrics.ttft.observe(0.25 * k)
    for _ in range(k):
        metrics.itl.observe(k / 64)
    metrics.e2e.observe(k)


def parse(text: str) -> tuple[set[tuple[str, str, str]], Samples]:
    """Each family (name, type, help) and each sample by name and labels,
    the ``_created`` ones left out; no sample twice."""
    families = set()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue
        families.add((family.name, family.type, family.documentation))
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, key
            assert s.labels["model_name"] == MODEL
            samples[key] = s.value
    return families, samples


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset({"model_name": MODEL, **labels}.items()))]


def test_api_servers_metrics_are_summed_and_the_engine_gauges_are_the_scrapers(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if k != MULTIPROCESS_DIR_ENV}
    shared = env | {MULTIPROCESS_DIR_ENV: str(tmp_path)}

    def child(k: int, role: str) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-c", CHILD, str(TESTS), str(k), role, str(tmp_path)]
        pipe = subprocess.PIPE if role == "scraper" else None
        return subprocess.Popen(
            argv, env=env if role == "late" else shared, stdin=pipe, stdout=pipe
        )

    writers = [child(1, "early"), child(2, "late")]
    scraper = child(3, "scraper")
    for writer in writers:
        assert writer.wait(timeout=60) == 0
    out, _ = scraper.communicate(b"render\n", timeout=60)
    assert scraper.returncode == 0
    families, samples = parse(out.decode())

    assert sample(samples, "asyncstep:prompt_tokens_total") == 7 * 6
    assert sample(samples, "asyncstep:request_success_total", finished_reason="stop") == 6
    assert sample(samples, "asyncstep:request_success_total", finished_reason="length") == 2
    ttft = "asyncstep:time_to_first_token_seconds"
    assert sample(samples, ttft + "_count") == 3
    assert sample(samples, ttft + "_sum") == 1.5
    buckets = [sample(samples, ttft + "_bucket", le=le) for le in ("0.1", "0.25", "0.5", "+Inf")]
    assert buckets == [0, 1, 2, 3]
    itl = "asyncstep:inter_token_latency_seconds"
    assert sample(samples, itl + "_count") == 1 + 2 + 3
    assert sample(samples, itl + "_sum") == (1 + 4 + 9) / 64
    # The scraper's engine, once (not 1 + 2 + 3).
    assert sample(samples, "asyncstep:num_requests_running") == 3
    assert sample(samples, "asyncstep:num_preemptions_total") == 9
    assert sample(samples, "asyncstep:kv_cache_usage_perc") == 3 / 8

    # One process serving all three, without the variable: today's output.
    reference = ServerMetrics(FakeEngine(statistics(3)), MODEL)  # type: ignore[arg-type]
    for k in (1, 2, 3):
        serve(reference, k)
    assert (families, samples) == parse(reference.render().decode())
