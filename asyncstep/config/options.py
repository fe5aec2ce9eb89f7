"""The flat options of a config struct: :class:`EngineOption`, one per
field, with its description (``msgspec.Meta``) and choices; the engine's
sections' and the server's (:func:`struct_options`). Imports msgspec only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, get_args, get_origin

import msgspec


@dataclass(frozen=True)
class EngineOption:
    """One flat engine option: a field of a section of :class:`EngineConfig`."""

    #: The field's name: ``make_config``'s keyword (and the CLI's flag).
    name: str
    #: The section holding it: EngineConfig's field name (``"cache"``, ...).
    section: str
    #: The field's type (``int``, ``float | None``, ``list[int] | None``, ...).
    type: Any
    default: Any
    description: str
    #: The values allowed, when they are a fixed few.
    choices: tuple[Any, ...] | None = None

    @property
    def optional(self) -> bool:
        """None is a value of this option."""
        return type(None) in get_args(self.type)

    @property
    def value_type(self) -> Any:
        """The type without ``| None``."""
        args = [a for a in get_args(self.type) if a is not type(None)]
        return args[0] if self.optional and len(args) == 1 else self.type


def struct_options(struct: type[msgspec.Struct], section: str) -> dict[str, EngineOption]:
    """The options of one config struct's fields (described as the engine's
    are, with ``msgspec.Meta(description=...)``), by name; ``section`` names
    the struct (the server's options use it too: ``asyncstep.server.config``)."""
    return {field.name: _option(section, field) for field in msgspec.structs.fields(struct)}


def _option(section: str, field: msgspec.structs.FieldInfo) -> EngineOption:
    kind, meta = field.type, None
    if get_origin(kind) is Annotated:
        kind, *extras = get_args(kind)
        meta = next((m for m in extras if isinstance(m, msgspec.Meta)), None)
    default = field.default
    if default is msgspec.NODEFAULT:
        default = field.default_factory()
    extra = (meta.extra if meta else None) or {}
    return EngineOption(
        name=field.name,
        section=section,
        type=kind,
        default=default,
        description=(meta.description if meta else None) or "",
        choices=extra.get("choices"),
    )
