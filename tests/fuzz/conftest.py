"""The fuzz profiles: ``ci`` (the default, ~200 examples a test) and ``long``.

``CHANGESTREAMER_FUZZ_PROFILE=long`` selects the long one (``scripts/fuzz`` sets it),
``CHANGESTREAMER_FUZZ_EXAMPLES`` its examples per test. The profiles are applied by
:func:`fuzz_settings`, test by test, not loaded as hypothesis' global default: the
rest of the suite keeps its own settings whichever directory is collected first.
No example database: nothing is written into the work tree, and a failure prints
the blob that reproduces it (``@reproduce_failure``).
"""

from __future__ import annotations

import copy
import os
from typing import Any, Final

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

PROFILE_ENV: Final = "CHANGESTREAMER_FUZZ_PROFILE"
EXAMPLES_ENV: Final = "CHANGESTREAMER_FUZZ_EXAMPLES"

_BASE: Final = settings(
    deadline=None,  # a noisy 2-core CI machine: no timing here
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("changestreamer-fuzz-ci", _BASE, max_examples=200)
settings.register_profile(
    "changestreamer-fuzz-long", _BASE, max_examples=int(os.environ.get(EXAMPLES_ENV) or 20_000)
)


def _selected() -> str:
    value = os.environ.get(PROFILE_ENV, "").strip() or "ci"
    if value not in ("ci", "long"):
        raise ValueError(f"{PROFILE_ENV} must be ci or long (got {value!r})")
    return f"changestreamer-fuzz-{value}"


def fuzz_settings(scale: float = 1.0) -> settings:
    """The selected profile, with ``scale`` times its examples (slow targets < 1)."""
    profile = settings.get_profile(_selected())
    return settings(profile, max_examples=max(10, int(profile.max_examples * scale)))


_EDITS: Final = ("flip", "set", "insert", "delete", "truncate", "repeat")


@st.composite
def mutated(draw: st.DrawFn, base: bytes, max_edits: int = 3) -> bytes:
    """``base`` with up to ``max_edits`` random edits: near-valid input reaches the
    deep branches of a parser that uniformly random bytes stop at the first check."""
    data = bytearray(base)
    for _ in range(draw(st.integers(0, max_edits))):
        edit = draw(st.sampled_from(_EDITS))
        at = draw(st.integers(0, len(data)))
        if edit == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif edit == "truncate":
            del data[at:]
        elif not data or at == len(data):
            continue
        elif edit == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif edit == "set":
            data[at] = draw(st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xFF, *base[:8]]))
        elif edit == "delete":
            del data[at : at + draw(st.integers(1, 4))]
        else:
            data[at:at] = data[at : at + draw(st.integers(1, 8))]
    return bytes(data)


def _containers(value: Any, out: list[Any]) -> list[Any]:
    if isinstance(value, (dict, list)):
        out.append(value)
        for item in value.values() if isinstance(value, dict) else value:
            _containers(item, out)
    return out


@st.composite
def mutated_json(
    draw: st.DrawFn, template: Any, values: st.SearchStrategy[Any], max_edits: int = 3
) -> Any:
    """A copy of the JSON value ``template`` with up to ``max_edits`` structural edits:
    a value replaced by one of ``values``, a key or element dropped or added."""
    value = copy.deepcopy(template)
    for _ in range(draw(st.integers(0, max_edits))):
        containers = _containers(value, [])
        if not containers:
            break
        target = draw(st.sampled_from(containers))
        edit = draw(st.sampled_from(["replace", "drop", "add"]))
        if isinstance(target, dict):
            keys = list(target)
            if edit == "add" or not keys:
                key = draw(st.sampled_from([*keys, "tag", "x"]) | st.text(max_size=4))
                target[key] = draw(values)
            elif edit == "drop":
                del target[draw(st.sampled_from(keys))]
            else:
                target[draw(st.sampled_from(keys))] = draw(values)
        elif edit == "add" or not target:
            target.insert(draw(st.integers(0, len(target))), draw(values))
        elif edit == "drop":
            del target[draw(st.integers(0, len(target) - 1))]
        else:
            target[draw(st.integers(0, len(target) - 1))] = draw(values)
    return value
