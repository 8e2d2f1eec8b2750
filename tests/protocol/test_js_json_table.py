"""canonical_json against outputs recorded from Node (fixtures/gen_js_table.js).

Each row is [input JSON text, what zero's codec (BigInt-aware JSON.parse, then
JSON.stringify) writes for it].  The stdlib json module reads the table so that a
bug in the code under test cannot hide itself.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from app.protocol.canonical_json import dumps, loads
from app.protocol.js_number import format_js_number

FIXTURES = Path(__file__).parent / "fixtures"
TABLE = FIXTURES / "js_json_table.json"


@cache
def table() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(TABLE.read_text(encoding="utf-8"))
    return data


def test_table_covers_at_least_a_thousand_cases() -> None:
    assert len(table()["rows"]) >= 1000


# "@" marks where a row's text goes: bare, and inside containers (which take
# canonical_json's orjson fast path rather than the scalar path).
@pytest.mark.parametrize("wrap", ["@", "[@]", '{"k":@,"n":null}', '[["s",@],{"a":[@]}]'])
def test_every_row_matches_node_byte_for_byte(wrap: str) -> None:
    failures = []
    for text, expected in table()["rows"]:
        source, want = wrap.replace("@", text), wrap.replace("@", expected)
        try:
            got = dumps(loads(source))
        except (ValueError, TypeError) as e:
            got = f"<{type(e).__name__}: {e}>"
        if got != want:
            failures.append(f"{source!r}: node {want!r}, python {got!r}")
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:10])


def test_number_rows_match_when_formatting_python_floats_directly() -> None:
    failures = []
    for text, expected in table()["rows"]:
        if not text or text.strip()[0] not in "-0123456789":
            continue
        value = loads(text)
        if isinstance(value, float) and format_js_number(value) != expected:
            failures.append(f"{text!r}: js {expected!r}, python {format_js_number(value)!r}")
    assert not failures, "\n".join(failures[:10])


def test_array_index_keys_keep_insertion_order_where_js_would_hoist_them() -> None:
    # Documented deviation: same object, different key order.
    for text, js_output in table()["deviations"]:
        ours = dumps(loads(text))
        assert ours != js_output
        assert loads(ours) == loads(js_output)
        assert ours == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)


def test_numbers_js_would_turn_into_null_are_refused() -> None:
    rejected = table()["rejected"]
    assert rejected
    for text, js_output in rejected:
        assert "null" in js_output
        with pytest.raises(ValueError, match="outside the range of a double"):
            loads(text)


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_committed_table_is_what_the_generator_produces(tmp_path: Path) -> None:
    out = tmp_path / "table.json"
    subprocess.run(
        ["node", str(FIXTURES / "gen_js_table.js"), str(out)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    fresh = json.loads(out.read_text(encoding="utf-8"))
    for key in ("rows", "deviations", "rejected"):
        assert fresh[key] == table()[key], f"{key} differ: re-run gen_js_table.js"
