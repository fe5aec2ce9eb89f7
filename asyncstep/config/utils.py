"""What the sections of the engine configuration share: a field's one-line
description. Imports msgspec only.
"""

from __future__ import annotations

import msgspec


def field_doc(description: str, **extra: object) -> msgspec.Meta:
    """A field's one-line description (the CLI help); ``extra``: e.g. ``choices``."""
    return msgspec.Meta(description=description, extra=extra or None)
