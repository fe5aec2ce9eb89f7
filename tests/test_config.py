"""The engine config: one msgspec struct, written once, travelling whole.
Its flat options (``make_config``'s keywords) are its fields; it survives
msgpack unchanged; a bad value (given, or decoded) is one ConfigError line."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import numpy as np
import pytest

import asyncstep
from asyncstep.channels.control import ControlMessage, ControlStream, RankSetup
from asyncstep.config import (
    CPU_FLOAT32_MAX_NUM_BATCHED_TOKENS,
    CPU_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    config_error,
    cpu_max_num_batched_tokens,
    decode_config,
    engine_options,
)
from asyncstep.errors import ConfigError

SECTIONS = (
    "model",
    "cache",
    "scheduler",
    "parallel",
    "compilation",
    "structured_outputs",
    "speculative",
)


def non_default() -> EngineConfig:
    return asyncstep.make_config(
        "tiny-llama",
        load_format="dummy",
        max_model_len=256,
        block_size=32,
        num_blocks=100,
        enable_prefix_caching=False,
        max_concurrent_batches=3,
        gil_switch_interval_s=None,
        tensor_parallel_size=2,
        listen="0.0.0.0:5555",
        rank_log_json="/tmp/log",
        engine_process=False,
        cudagraph_mode="full",
        cudagraph_capture_sizes=(1, 2, 8),
    )


def test_every_field_is_one_flat_option_with_a_description() -> None:
    options = engine_options()
    fields = [
        (section, f.name)
        for section in SECTIONS
        for f in msgspec.structs.fields(getattr(EngineConfig(), section))
    ]
    assert sorted((o.section, o.name) for o in options.values()) == sorted(fields)
    assert len(options) == len(fields)  # unique names across sections
    for option in options.values():
        assert option.description and "\n" not in option.description, option.name
        if option.optional:  # says what None means
            assert "none" in option.description.lower(), option.name
    assert options["block_size"].section == "cache"
    assert options["engine_process"].default is True


def test_make_config_sets_each_option_in_its_section() -> None:
    config = non_default()
    assert config.model.model == "tiny-llama" and config.model.max_model_len == 256
    assert config.cache.block_size == 32 and config.cache.enable_prefix_caching is False
    assert config.scheduler.gil_switch_interval_s is None
    assert config.parallel.tensor_parallel_size == 2 and config.parallel.engine_process is False
    assert config.compilation.cudagraph_mode == "FULL"
    assert config.compilation.cudagraph_capture_sizes == [1, 2, 8]
    assert asyncstep.make_config() == EngineConfig()


def test_paths_and_numpy_scalars_count_as_builtins() -> None:
    assert asyncstep.make_config(Path("/models/x")).model.model == "/models/x"
    assert ModelConfig(model=Path("/models/x")).model == "/models/x"  # type: ignore[arg-type]
    config = asyncstep.make_config(num_blocks=np.int64(5), gpu_memory_utilization=np.float32(0.5))
    assert (config.cache.num_blocks, config.cache.gpu_memory_utilization) == (5, 0.5)
    assert type(config.cache.num_blocks) is int


def test_msgpack_round_trip_equals_itself() -> None:
    config = non_default()
    config.model.max_model_len = 128  # resolved by the engine: travels too
    data = msgspec.msgpack.encode(config)
    assert decode_config(data) == config
    assert msgspec.msgpack.decode(data, type=EngineConfig) == config
    setup = msgspec.msgpack.encode(RankSetup(config, "env://"))
    assert msgspec.msgpack.decode(setup, type=ControlMessage) == RankSetup(config, "env://")


def test_derived_properties() -> None:
    config = asyncstep.make_config(max_num_seqs=8, async_scheduling=False, pipeline_parallel_size=2)
    assert (config.batch_queue_size, config.max_num_running_reqs) == (2, 16)
    assert (config.num_input_batches, config.uses_output_placeholders) == (2, False)
    assert config.parallel.world_size == 2
    assert config.parallel.listen_address == ("127.0.0.1", 0)


@pytest.mark.parametrize(
    "device,options,budget",
    [
        ("cpu", {}, cpu_max_num_batched_tokens()),
        ("cuda", {}, DEFAULT_MAX_NUM_BATCHED_TOKENS),
        # Without chunked prefill the budget bounds the prompt: not the small one.
        ("cpu", {"enable_chunked_prefill": False}, DEFAULT_MAX_NUM_BATCHED_TOKENS),
        ("cpu", {"max_num_batched_tokens": 512}, 512),  # given: kept
    ],
)
def test_the_step_budget_is_resolved_for_the_device(
    device: str, options: dict[str, object], budget: int
) -> None:
    config = asyncstep.make_config(**options)
    if "max_num_batched_tokens" not in options:
        assert config.scheduler.max_num_batched_tokens is None
        with pytest.raises(ConfigError, match="max_num_batched_tokens must be resolved"):
            _ = config.max_num_batched_tokens
    config.resolve_for_device(device)
    assert config.max_num_batched_tokens == config.scheduler.max_num_batched_tokens == budget
    assert CPU_MAX_NUM_BATCHED_TOKENS < DEFAULT_MAX_NUM_BATCHED_TOKENS
    # On the CPU one step at a time (with overlap too); a pipeline keeps every stage busy.
    assert config.batch_queue_size == (1 if device == "cpu" else 2)


@pytest.mark.parametrize("native", [True, False])
def test_the_cpu_step_budget_follows_the_cpus_bfloat16(
    monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """Where the CPU multiplies bfloat16 a step's tokens cost far less than in
    float32 (``benchmarks/studies/cpu_step_budget/README.md``): a larger budget."""
    from asyncstep.config import scheduler

    monkeypatch.setattr(scheduler, "cpu_has_bf16", lambda: native)
    want = CPU_MAX_NUM_BATCHED_TOKENS if native else CPU_FLOAT32_MAX_NUM_BATCHED_TOKENS
    assert cpu_max_num_batched_tokens() == want
    config = asyncstep.make_config()
    config.resolve_for_device("cpu")
    assert config.max_num_batched_tokens == want
    assert CPU_FLOAT32_MAX_NUM_BATCHED_TOKENS < CPU_MAX_NUM_BATCHED_TOKENS


@pytest.mark.parametrize(
    "device,options,depth",
    [
        ("cpu", {"max_concurrent_batches": 2}, 2),
        ("cpu", {"pipeline_parallel_size": 2}, 2),
        ("cuda", {"async_scheduling": False}, 1),
    ],
)
def test_the_batch_queue_is_resolved_for_the_device(
    device: str, options: dict[str, object], depth: int
) -> None:
    config = asyncstep.make_config(**options)
    config.resolve_for_device(device)
    assert config.batch_queue_size == depth


@pytest.mark.trio
async def test_an_engine_runs_with_its_device_s_budget() -> None:
    async with asyncstep.open_engine(
        "tiny-llama", load_format="dummy", device="cpu", engine_process=False, num_blocks=16
    ) as engine:
        assert engine.config.scheduler.max_num_batched_tokens == cpu_max_num_batched_tokens()


@pytest.mark.parametrize(
    "options,message",
    [
        ({"blok_size": 16}, "unknown engine option 'blok_size' (did you mean block_size?)"),
        ({"nonsense": 1}, "unknown engine option 'nonsense'"),
        ({"block_size": 3}, "block_size must be a power of two, got 3"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in (0, 1], got 1.5"),
        ({"listen": "nowhere"}, "listen must be HOST:PORT, got 'nowhere'"),
        ({"cpu_threads": 0}, "cpu_threads must be >= 1 (or none), got 0"),
        (
            {"weight_packing": "int3"},
            "weight_packing must be one of ('auto', 'none', 'q4'), got 'int3'",
        ),
        ({"packed_max_tokens": -1}, "packed_max_tokens must be >= 0, got -1"),
        (
            {"batch_invariant": True, "packed_max_tokens": 16},
            "batch_invariant needs one kernel for every step's size: leave packed_max_tokens "
            "unset (got 16)",
        ),
        (
            {"gpu_q4_activations": "fp8"},
            "gpu_q4_activations must be one of ('float', 'int8'), got 'fp8'",
        ),
        (
            {"block_size": "16"},
            "bad engine config: Expected `int`, got `str` - at `$.cache.block_size`",
        ),
        (
            {"max_model_len": 512.0},  # would not decode on a rank
            "bad engine config: Expected `int | null`, got `float` - at `$.model.max_model_len`",
        ),
        (
            {"enable_prefix_caching": 1},
            "bad engine config: Expected `bool`, got `int` - at `$.cache.enable_prefix_caching`",
        ),
    ],
)
def test_make_config_refuses_in_one_line(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        asyncstep.make_config(**options)
    assert str(error.value) == message


def test_decoding_a_bad_config_is_one_config_error() -> None:
    bad = msgspec.msgpack.encode({"cache": {"block_size": 3}})
    # msgspec wraps the ValueError raised in __post_init__ (a ConfigError) in
    # a ValidationError naming where it was; the ConfigError is its cause.
    with pytest.raises(msgspec.ValidationError) as raw:
        msgspec.msgpack.decode(bad, type=EngineConfig)
    assert str(raw.value) == "block_size must be a power of two, got 3 - at `$.cache`"
    assert isinstance(raw.value.__cause__, ConfigError)
    assert str(config_error(raw.value)) == "block_size must be a power of two, got 3"
    # decode_config gives the section's own message.
    with pytest.raises(ConfigError, match=r"^block_size must be a power of two, got 3$"):
        decode_config(bad)
    with pytest.raises(ConfigError, match=r"^bad engine config: Expected `str`, got `int`"):
        decode_config(msgspec.msgpack.encode({"model": {"device": 0}}))
    with pytest.raises(ConfigError, match=r"^bad engine config: "):
        decode_config(b"\xc1")  # not msgpack at all


def test_sections_validate_on_construction() -> None:
    with pytest.raises(ConfigError, match=r"^num_blocks must be positive, got 0$"):
        CacheConfig(num_blocks=0)
    with pytest.raises(TypeError):
        CacheConfig(16)  # type: ignore[misc]  # keyword-only


@pytest.mark.trio
async def test_a_rank_receiving_a_bad_config_gets_the_config_error() -> None:
    """The engine's config is checked when built; one changed afterwards is
    checked again where a rank decodes it (a ConfigError, not a protocol one)."""
    config = EngineConfig()
    config.cache.block_size = 3  # assignment is not validated: decoding is
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)  # type: ignore[attr-defined]
    async with listener:
        rank_side = ControlStream(await anyio.connect_tcp("127.0.0.1", port), ControlMessage)
        engine_side = ControlStream(
            await listener.listeners[0].accept(),  # type: ignore[attr-defined]
            ControlMessage,
        )
        await engine_side.send(RankSetup(config, None))
        with pytest.raises(ConfigError, match=r"^block_size must be a power of two, got 3$"):
            await rank_side.receive()
        await rank_side.aclose()
        await engine_side.aclose()


@pytest.mark.parametrize(
    "cores,options,threads",
    [
        (2, {}, 2),  # a small machine: both cores for the forward
        (16, {}, 15),  # one core left to the front end
        (16, {"tensor_parallel_size": 2}, 7),  # shared by the local ranks
        (16, {"tensor_parallel_size": 2, "launch_ranks": False}, 15),  # ranks started elsewhere
        (2, {"cpu_threads": 1}, 1),
    ],
)
def test_cpu_threads_by_default_share_the_cores(
    monkeypatch: pytest.MonkeyPatch, cores: int, options: dict[str, object], threads: int
) -> None:
    from asyncstep.models import model_loader

    monkeypatch.setattr(model_loader.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert model_loader.cpu_threads(asyncstep.make_config(**options).parallel) == threads


@pytest.mark.trio
async def test_setup_work_runs_in_a_thread_that_has_ended() -> None:
    """A CPU rank loads in a thread that ends, so its OpenMP threads end too
    (asyncstep.runner.cpu_threads)."""
    import threading

    from asyncstep.runner.cpu_threads import run_in_ending_thread

    thread = await run_in_ending_thread(threading.current_thread)
    assert thread is not threading.current_thread()
    assert not thread.is_alive()
    with pytest.raises(ValueError, match="invalid literal"):
        await run_in_ending_thread(lambda: int("x"))


def test_cpu_steps_take_fewer_threads_while_other_processes_use_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asyncstep.runner import cpu_threads as ct

    clock, busy, own = [0.0], [0], [0.0]
    monkeypatch.setattr(ct.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(ct, "_busy_ticks", lambda cpus: busy[0])
    monkeypatch.setattr(ct.os, "times", lambda: (own[0], 0.0, 0.0, 0.0, 0.0))
    monkeypatch.setattr(ct, "_TICKS", 100)
    calls: list[int] = []
    monkeypatch.setattr(ct.torch, "set_num_threads", calls.append)
    threads = ct.CpuThreads(2)
    threads._cpus = frozenset({0, 1})

    def window(others: float, ours: float = 1.0, seconds: float = 0.25) -> list[int]:
        clock[0] += seconds
        own[0] += ours * seconds
        busy[0] += round((ours + others) * seconds * 100)
        threads.apply()
        return calls

    threads.apply()
    assert calls == [2]
    assert window(others=0.1) == [2]  # quiet
    assert window(others=1.0) == [2, 1]  # a busy caller holds a core
    assert window(others=0.4) == [2, 1]  # not yet free enough to come back
    assert window(others=0.1) == [2, 1, 2]
    assert window(others=1.0, seconds=0.05) == [2, 1, 2]  # within a window: not looked at


def test_the_first_cpu_step_knows_the_load_since_the_threads_were_set_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asyncstep.runner import cpu_threads as ct

    clock, busy = [0.0], [0]
    monkeypatch.setattr(ct.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(ct, "_busy_ticks", lambda cpus: busy[0])
    monkeypatch.setattr(ct.os, "times", lambda: (0.0, 0.0, 0.0, 0.0, 0.0))
    monkeypatch.setattr(ct, "_TICKS", 100)
    calls: list[int] = []
    monkeypatch.setattr(ct.torch, "set_num_threads", calls.append)
    threads = ct.CpuThreads(2)
    threads._cpus = frozenset({0, 1})
    clock[0], busy[0] = 1.0, 100  # another process kept a core busy since
    threads.apply()
    assert calls == [1]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("fit", [True, False])
def test_auto_dtype_on_the_cpu(monkeypatch: pytest.MonkeyPatch, native: bool, fit: bool) -> None:
    """bfloat16 where the CPU multiplies it and the weights are dense; float32
    where they stay in the library's 4-bit blocks (exact weights: the
    activations keep float32's precision) and on CPUs without bfloat16."""
    import torch

    from asyncstep.models import model_loader

    monkeypatch.setattr(model_loader, "cpu_has_bf16", lambda: native)
    expected = torch.bfloat16 if native and not fit else torch.float32
    cpu = torch.device("cpu")
    assert model_loader.resolve_dtype("auto", cpu, cpu_blocks_fit=fit) == expected
    assert model_loader.resolve_dtype("float32", cpu, cpu_blocks_fit=fit) == torch.float32
    assert model_loader.resolve_dtype("bfloat16", cpu, cpu_blocks_fit=fit) == torch.bfloat16


def test_the_embedded_model_fits_the_cpu_blocks_where_they_run() -> None:
    """Its decoder is Q4_1: kept in the library's blocks wherever they run."""
    import torch

    from asyncstep.config import ModelConfig
    from asyncstep.models.loader import open_checkpoint
    from asyncstep.models.model_loader import cpu_blocks, cpu_blocks_fit

    cpu, checkpoint = torch.device("cpu"), open_checkpoint(None)
    assert cpu_blocks_fit(ModelConfig(), checkpoint, cpu) == cpu_blocks()
    assert not cpu_blocks_fit(ModelConfig(weight_packing="none"), checkpoint, cpu)
    assert not cpu_blocks_fit(ModelConfig(load_format="dummy"), None, cpu)
