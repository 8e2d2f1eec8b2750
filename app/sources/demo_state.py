"""The demo source's small state file: how far its watermarks went and where its schema is.

``{"version": 1, "reservedThrough": "<wm>", "schemaWatermark": "<wm>" | null}``

* ``reservedThrough``: every watermark the demo ever handed out is at or below it. The
  demo reserves watermarks in blocks (one write per block, not per transaction), so
  after a restart it continues above the whole block, leaving a gap, which is allowed.
* ``schemaWatermark``: the commit watermark of the last transaction that created the
  demo schema (null before the first one).

The file is replaced atomically (temporary file, fsync, ``os.replace``): a crash
leaves either the old or the new state, never a torn one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from app.protocol.canonical_json import dumps, loads
from app.protocol.lexi import InvalidWatermarkError, from_lexi, to_lexi

__all__ = ["DemoState", "DemoStateError", "load_demo_state", "save_demo_state"]

_VERSION: Final = 1


class DemoStateError(ValueError):
    """The state file exists but cannot be used."""


@dataclass(slots=True)
class DemoState:
    reserved_through: int = 0
    schema_watermark: int | None = None


def load_demo_state(path: Path) -> DemoState:
    """Reads the state; a missing file is a fresh start."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return DemoState()
    try:
        data = loads(text)
        if not isinstance(data, dict) or data.get("version") != _VERSION:
            raise DemoStateError(f"expected an object with version {_VERSION}")
        reserved = from_lexi(data["reservedThrough"])
        schema = data.get("schemaWatermark")
        return DemoState(reserved, None if schema is None else from_lexi(schema))
    except (ValueError, KeyError, TypeError, InvalidWatermarkError) as e:
        raise DemoStateError(f"demo source state file {path} is unusable: {e}") from e


def save_demo_state(path: Path, state: DemoState) -> None:
    """Writes the state atomically."""
    text = dumps(
        {
            "version": _VERSION,
            "reservedThrough": to_lexi(state.reserved_through),
            "schemaWatermark": (
                None if state.schema_watermark is None else to_lexi(state.schema_watermark)
            ),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
