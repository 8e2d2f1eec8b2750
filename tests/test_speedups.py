"""app/speedups.py: the one switch between the C helpers and their pure-Python twins."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app import speedups
from app.config import SettingsError, load_settings
from tests import c_helpers

REPO = Path(__file__).resolve().parents[1]
MODULES = speedups._MODULES

# Imports every module that picks a helper, then prints what each one uses.
PROBE = """
import sys
from app import speedups
import app.cli
from app.protocol import canonical_json as cj
from app.protocol import wsframes as ws
from app.streamer import downstream, rowrun, subscriber
from app.sources.postgres import copy_load, mapper
print(speedups.summary())
print(cj._scan is cj.scan_py, cj.encode_fast is cj._encode_fast_py,
      ws.ack_ids is ws._ack_ids_py, ws.msg_frames is ws._msg_frames_py,
      rowrun.encode_rows is rowrun.encode_rows_py,
      subscriber.select_live is subscriber._select_live_py,
      downstream.running_totals is downstream._running_totals_py,
      mapper._pgrows is None, not copy_load.active())
"""
# The same, as if app/protocol/_jsscan.c had not been built.
WITHOUT_JSSCAN = """
import sys
class NotBuilt:
    def find_spec(self, name, path=None, target=None):
        if name == "app.protocol._jsscan":
            raise ImportError("not built")
sys.meta_path.insert(0, NotBuilt())
"""


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ZERO_")}
    full_env.pop(speedups.ENV, None)
    full_env.update(env, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("value", "enabled"), [("", True), ("1", True), ("0", False), (" 0", False)]
)
def test_unset_or_1_allows_the_c_helpers_and_0_forbids_them(value: str, enabled: bool) -> None:
    assert speedups.requested({speedups.ENV: value}) is enabled
    assert speedups.requested({}) is True


@pytest.mark.parametrize("value", ["yes", "true", "2", "off"])
def test_any_other_value_is_one_line_naming_the_variable(value: str) -> None:
    with pytest.raises(speedups.SpeedupsSettingError) as e:
        speedups.requested({speedups.ENV: value})
    assert str(e.value) == (
        "invalid setting CHANGESTREAMER_SPEEDUPS: must be 0 (pure Python) or 1 "
        f"(the C helpers) (got {value!r})"
    )


def test_0_makes_every_site_use_its_python_twin() -> None:
    result = run_python(PROBE, CHANGESTREAMER_SPEEDUPS="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "pure Python (CHANGESTREAMER_SPEEDUPS=0)",
        "True True True True True True True True True",
    ]


def test_without_0_every_site_uses_the_c_helper_that_was_built() -> None:
    built = {name: c_helpers.built(module) is not None for name, module in MODULES.items()}
    result = run_python(PROBE)
    assert result.returncode == 0, result.stderr
    summary, uses_python = result.stdout.splitlines()
    sites = [
        *("jsscan", "jsscan", "wsfast", "wsfast", "rowrun", "fanout", "fanout", "pgrows"),
        "copyload",
    ]
    assert uses_python.split() == [str(not built[name]) for name in sites]
    if all(built.values()):
        assert summary == "C (jsscan, wsfast, rowrun, fanout, pgrows, copyload)"
    elif not any(built.values()):
        assert summary == "pure Python (not built)"


def test_a_helper_that_was_not_built_falls_back_alone() -> None:
    result = run_python(WITHOUT_JSSCAN + PROBE)
    assert result.returncode == 0, result.stderr
    summary, uses_python = result.stdout.splitlines()
    assert uses_python.split()[:2] == ["True", "True"]  # canonical JSON: the twins
    others = ("wsfast", "rowrun", "fanout", "pgrows", "copyload")
    if all(speedups.active()[name] for name in others):
        assert summary == (
            "C (wsfast, rowrun, fanout, pgrows, copyload); pure Python: jsscan (not built)"
        )
        assert uses_python.split()[2:] == ["False"] * 7


def test_a_bad_value_stops_the_command_with_one_line() -> None:
    result = run_python(
        "import sys; from app.cli import main; sys.exit(main(['serve']))",
        CHANGESTREAMER_SPEEDUPS="yes",
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "changestreamer: invalid setting CHANGESTREAMER_SPEEDUPS: must be 0 (pure Python) "
        "or 1 (the C helpers) (got 'yes')"
    ]


def test_a_bad_value_fails_any_import_of_the_service() -> None:
    result = run_python("import app.protocol", CHANGESTREAMER_SPEEDUPS="fast")
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "app.speedups.SpeedupsSettingError: invalid setting CHANGESTREAMER_SPEEDUPS: must be "
        "0 (pure Python) or 1 (the C helpers) (got 'fast')"
    )


@pytest.mark.skipif(not speedups.ENABLED, reason="CHANGESTREAMER_SPEEDUPS=0 is set here")
def test_a_dot_env_line_that_could_not_take_effect_stops_start_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("CHANGESTREAMER_SPEEDUPS=1\n")
    assert load_settings().speedups is True  # what this process runs: fine
    (tmp_path / ".env").write_text("CHANGESTREAMER_SPEEDUPS=0\n")
    with pytest.raises(SettingsError) as e:
        load_settings()
    assert str(e.value) == (
        "CHANGESTREAMER_SPEEDUPS is read from the process environment as the program starts, "
        "so a .env line cannot change it: set it in the environment"
    )
    monkeypatch.setenv("CHANGESTREAMER_SPEEDUPS", "1")  # the environment wins over .env
    assert load_settings().speedups is True


def test_a_machine_with_a_c_compiler_runs_every_c_helper() -> None:
    # The development install (scripts/bootstrap) builds them; CI must test the C
    # versions, not silently their twins.
    if not speedups.ENABLED:
        pytest.skip("CHANGESTREAMER_SPEEDUPS=0: this run tests the pure-Python twins")
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler here: the helpers are not built")
    assert speedups.active() == dict.fromkeys(speedups.NAMES, True)
