"""Settings (app/config.py): any environment gives a Settings or one clear line.

``load_settings`` is the first thing start-up runs, on whatever the operator's
environment and ``.env`` hold. A bad value must end start-up with a
``SettingsError`` of one line naming the problem: never a traceback, never another
exception type. Values include lone surrogates, which is how Python's ``os.environ``
holds bytes that are not UTF-8.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Final

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from app.config import KNOWN_NAMES, SETTING_NAMES, Settings, SettingsError, load_settings
from app.zero_settings import CATALOG
from tests.fuzz.conftest import fuzz_settings

NAMES: Final = sorted(SETTING_NAMES)
OTHER_NAMES: Final = sorted(KNOWN_NAMES - SETTING_NAMES)

# What a value of each kind of setting looks like, and what it must not.
values = st.one_of(
    st.text(max_size=12),
    st.text(
        st.characters(codec="utf-8") | st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF),
        max_size=6,
    ),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats().map(repr),
    st.sampled_from(
        ["0", "1", "true", "false", "yes", "nan", "inf", "-1", "1e400", "65536", " 1 ", "0x10"]
    ),
    st.sampled_from(["[", '["a","b"]', "[1,2]", '["a",', "a, b,,c", "[" * 3000, "{}"]),
    st.sampled_from(["file:///tmp/b", "s3://b/p", "http://x", "postgres://u:p@h/db", "sqlite:"]),
    st.sampled_from(["debug", "WARN", "info ", "text", "json", "process", "thread"]),
    st.integers(1, 6000).map(lambda n: "9" * n),
)
names = (
    st.sampled_from(NAMES)
    | st.sampled_from(OTHER_NAMES)
    | st.sampled_from(
        [
            "ZERO_UPSTREAM_BD",
            "zero_port",
            "CHANGESTREAMER_X",
            "ZERO_",
            "CHANGESTREAMER_TEST_X",
            "PATH",
        ]
    )
)
environments = st.dictionaries(names, values, max_size=4)


def loaded(**kwargs: object) -> Settings | str:
    """The settings, or the text of the one error ``load_settings`` may raise."""
    try:
        return load_settings(**kwargs)  # type: ignore[arg-type]
    except SettingsError as e:
        return str(e)


@fuzz_settings()
@given(environments)
@example({"ZERO_APP_PUBLICATIONS": "[" * 3000})
@example({"ZERO_SHARD_NUM": "1" * 5000})
@example({"ZERO_APP_ID": "\udcff"})
@example({"ZERO_LITESTREAM_BACKUP_URL": "ftp://u:secret@h/x"})
def test_an_environment_is_settings_or_one_line_naming_the_problem(env: dict[str, str]) -> None:
    result = loaded(environ=env, env_file=None)
    if isinstance(result, str):
        assert result
        assert "\n" not in result
        assert "\r" not in result
        assert "Traceback" not in result
        assert "secret" not in result, "a password in a URL is not repeated"


def test_a_publication_list_nested_too_deeply_is_a_settings_error() -> None:
    # Found by fuzzing: json.loads of it raised RecursionError (a traceback at start-up).
    result = loaded(environ={"ZERO_APP_PUBLICATIONS": "[" * 3000}, env_file=None)
    assert isinstance(result, str)
    assert result.startswith("invalid setting ZERO_APP_PUBLICATIONS")


env_lines = st.builds(
    lambda name, sep, value: f"{name}{sep}{value}",
    names,
    st.sampled_from(["=", " = ", "=", ""]),
    values.map(lambda v: v.encode("utf-8", "replace").decode())
    | st.sampled_from(['"a', "'x'", '"multi\nline"', "${HOME}", "# comment"]),
)


@fuzz_settings(0.5)
@given(st.lists(env_lines | st.text(max_size=10), max_size=5))
def test_a_dotenv_file_is_settings_or_one_line_naming_the_problem(lines: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ".env"
        path.write_text("\n".join(lines), encoding="utf-8")
        result = loaded(environ={}, env_file=path)
    if isinstance(result, str):
        assert result
        assert "\n" not in result


@pytest.mark.parametrize("name", sorted(n for n, s in CATALOG.items() if s.harmless))
def test_a_harmless_value_of_an_unsupported_setting_is_accepted_in_any_case(name: str) -> None:
    for value in CATALOG[name].harmless:
        assert not isinstance(loaded(environ={name: f" {value.upper()} "}, env_file=None), str)
