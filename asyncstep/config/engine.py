"""The whole engine configuration: :class:`EngineConfig`, one section per
concern, built from flat options (:func:`engine_options`) or decoded
(:func:`decode_config`). Imports msgspec, :mod:`asyncstep.errors` and
the sections.
"""

from __future__ import annotations

import difflib
import functools
import numbers
import os
from collections.abc import Mapping
from types import MappingProxyType

import msgspec

from asyncstep.config.cache import CacheConfig
from asyncstep.config.compilation import CompilationConfig
from asyncstep.config.model import ModelConfig
from asyncstep.config.options import EngineOption, struct_options
from asyncstep.config.parallel import ParallelConfig
from asyncstep.config.scheduler import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    SchedulerConfig,
    cpu_max_num_batched_tokens,
)
from asyncstep.config.speculative import SpeculativeConfig, SpeculativeSection
from asyncstep.config.structured_outputs import StructuredOutputsConfig
from asyncstep.errors import ConfigError


class EngineConfig(msgspec.Struct, kw_only=True):
    """The whole engine configuration, one section per concern.

    Build it from flat options with :meth:`from_options` (``make_config``),
    or decode it with :func:`decode_config`; either way a bad value ends in
    one :class:`ConfigError`.
    """

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    compilation: CompilationConfig = msgspec.field(default_factory=CompilationConfig)
    structured_outputs: StructuredOutputsConfig = msgspec.field(
        default_factory=StructuredOutputsConfig
    )
    speculative: SpeculativeSection = msgspec.field(default_factory=SpeculativeSection)

    def __post_init__(self) -> None:
        if self.speculative_config is not None and self.parallel.pipeline_parallel_size > 1:
            raise ConfigError(
                "speculative_config does not work with pipeline parallelism yet "
                "(pipeline_parallel_size must be 1)"
            )
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model" and self.parallel.world_size > 1:
            raise ConfigError(
                'speculative_config method "draft_model" runs on one rank only '
                "(tensor_parallel_size must be 1)"
            )

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        """The speculative decoding settings (None: off)."""
        return self.speculative.speculative_config

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        """The config of flat options (:func:`engine_options`' names; the
        rest default). Values are type-checked and validated as on decode (so
        the config encodes and decodes to itself); a path or a numpy scalar
        counts as its builtin value. An unknown name or a bad value raises a
        one-line :class:`ConfigError`."""
        known = engine_options()
        sections: dict[str, dict[str, object]] = {}
        for name, value in options.items():
            option = known.get(name)
            if option is None:
                raise ConfigError(_unknown_option(name, known))
            sections.setdefault(option.section, {})[name] = _builtin(value)
        try:
            return msgspec.convert(sections, cls)
        except msgspec.ValidationError as exc:
            raise config_error(exc) from None

    def resolve_for_device(self, device_type: str) -> None:
        """Fill in, in place, the defaults that depend on the device
        (``"cpu"``, ``"cuda"``): ``max_num_batched_tokens``
        (:func:`cpu_max_num_batched_tokens` on the CPU with chunked prefill,
        else :data:`DEFAULT_MAX_NUM_BATCHED_TOKENS`: without chunked prefill
        the budget bounds the prompt), and on the CPU with one pipeline
        stage ``max_concurrent_batches`` 1 (see :class:`SchedulerConfig`).
        A value given is kept. Expert parallelism on a GPU needs
        ``cudagraph_mode`` NONE (ConfigError)."""
        scheduler, cpu = self.scheduler, device_type == "cpu"
        if scheduler.max_num_batched_tokens is None:
            small = cpu and scheduler.enable_chunked_prefill
            scheduler.max_num_batched_tokens = (
                cpu_max_num_batched_tokens() if small else DEFAULT_MAX_NUM_BATCHED_TOKENS
            )
        one_stage = self.parallel.pipeline_parallel_size == 1
        if scheduler.max_concurrent_batches == 0 and cpu and one_stage:
            scheduler.max_concurrent_batches = 1
        expert_parallel = self.parallel.enable_expert_parallel
        expert_parallel = expert_parallel and self.parallel.tensor_parallel_size > 1
        if expert_parallel and not cpu and self.compilation.cudagraph_mode != "NONE":
            raise ConfigError(
                "enable_expert_parallel runs eagerly (its all-to-all sizes are read on "
                "the host each step): pass cudagraph_mode none"
            )

    @property
    def max_num_batched_tokens(self) -> int:
        """The step's token budget, once resolved (ConfigError before)."""
        budget = self.scheduler.max_num_batched_tokens
        if budget is None:
            raise ConfigError(
                "max_num_batched_tokens must be resolved for the device (resolve_for_device) "
                "before the engine is built"
            )
        return budget

    @property
    def batch_queue_size(self) -> int:
        """Steps the engine keeps in flight: ``max_concurrent_batches`` if
        set, else 1 without overlap or pipeline, ``pp_size`` with a pipeline
        (every stage busy), at least 2 with overlap."""
        if self.scheduler.max_concurrent_batches:
            return self.scheduler.max_concurrent_batches
        pp = self.parallel.pipeline_parallel_size
        return max(2 if self.uses_output_placeholders else 1, pp)

    @property
    def max_num_running_reqs(self) -> int:
        """Requests that may run at once: ``max_num_seqs`` per step, times the
        steps in flight when these hold different requests (a pipeline)."""
        if self.uses_output_placeholders:
            return self.scheduler.max_num_seqs
        return self.scheduler.max_num_seqs * self.batch_queue_size

    @property
    def uses_output_placeholders(self) -> bool:
        """Async scheduling over output placeholders: the runners keep sampled
        ids on the device for the next step. One pipeline stage only: with
        pipeline parallelism the first stage needs every token's id. With
        speculative decoding a request's verify step runs alone in flight
        for it (see :mod:`asyncstep.engine.core.scheduler`)."""
        return self.scheduler.async_scheduling and self.parallel.pipeline_parallel_size == 1

    @property
    def num_input_batches(self) -> int:
        """Persistent batches a runner keeps: one per step in flight whose
        requests differ from the others' (see :attr:`max_num_running_reqs`)."""
        return self.max_num_running_reqs // self.scheduler.max_num_seqs


def _builtin(value: object) -> object:
    """``value`` as msgspec's strict conversion takes it: a path as its str,
    a numpy (or other) integer or real as int or float, sequences item by item."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, bool | str | None):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, list | tuple):
        return [_builtin(v) for v in value]
    return value


def config_error(error: msgspec.DecodeError) -> ConfigError:
    """The one-line :class:`ConfigError` for a config msgspec refused: the
    section's own message when its ``__post_init__`` raised it (msgspec wraps
    a ``ValueError`` raised there in a ``ValidationError``), else msgspec's
    (the type expected and where, or what is malformed)."""
    if isinstance(error.__cause__, ConfigError):
        return ConfigError(str(error.__cause__))
    return ConfigError(f"bad engine config: {error}")


def decode_config(data: bytes) -> EngineConfig:
    """An :class:`EngineConfig` from msgpack; one :class:`ConfigError` if bad."""
    try:
        return msgspec.msgpack.decode(data, type=EngineConfig)
    except msgspec.DecodeError as exc:
        raise config_error(exc) from None


@functools.cache
def engine_options() -> Mapping[str, EngineOption]:
    """Every field of every section, by name (names are unique across
    sections), in the order of the sections and their fields."""
    options: dict[str, EngineOption] = {}
    for section in msgspec.structs.fields(EngineConfig):
        for name, option in struct_options(section.type, section.name).items():
            if name in options:
                raise TypeError(f"engine option {name!r} is in two config sections")
            options[name] = option
    return MappingProxyType(options)


def _unknown_option(name: str, known: Mapping[str, EngineOption]) -> str:
    close = difflib.get_close_matches(name, list(known), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return f"unknown engine option {name!r}{hint}"
