"""The changestreamer command: settings errors, migrate, and serve's health endpoints."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from app import speedups
from app.config import SettingsError, load_settings
from app.runtime.gc_tuning import YOUNG_THRESHOLD
from tests.waiting import eventually_blocking

CLI = [sys.executable, "-m", "app.cli"]
REPO = Path(__file__).resolve().parents[1]


def run_cli(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ZERO_")}
    full_env.update(env)
    full_env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [*CLI, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=60
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_settings_use_zero_names_and_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("ZERO_"):
            monkeypatch.delenv(name)
    settings = load_settings()
    assert (settings.app_id, settings.shard_num, settings.listen_port) == ("zero", 0, 4849)
    assert settings.change_db_url == "zero_0-cdc.db"
    monkeypatch.setenv("ZERO_APP_ID", "zoro")
    monkeypatch.setenv("ZERO_SHARD_NUM", "3")
    monkeypatch.setenv("ZERO_PORT", "5000")
    monkeypatch.setenv("ZERO_REPLICA_FILE", "/var/lib/zero/replica.db")
    monkeypatch.setenv("ZERO_APP_PUBLICATIONS", "pub_b, pub_a")
    settings = load_settings()
    assert settings.shard.cdc_schema == "zoro_3/cdc"
    assert settings.listen_port == 5001
    assert settings.change_db_url == "/var/lib/zero/zoro_3-cdc.db"
    assert settings.app_publications == ["pub_b", "pub_a"]
    monkeypatch.setenv("ZERO_APP_PUBLICATIONS", '["x","y"]')
    monkeypatch.setenv("ZERO_CHANGE_STREAMER_PORT", "7000")
    settings = load_settings()
    assert (settings.app_publications, settings.listen_port) == (["x", "y"], 7000)
    assert settings.sqlite_writer == "process"
    monkeypatch.setenv("CHANGESTREAMER_SQLITE_WRITER", "thread")
    assert load_settings().sqlite_writer == "thread"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("ZERO_SHARD_NUM", "two", "invalid setting ZERO_SHARD_NUM"),
        ("ZERO_SHARD_NUM", "-1", "invalid setting ZERO_SHARD_NUM"),
        ("ZERO_PORT", "70000", "invalid setting ZERO_PORT"),
        ("ZERO_APP_ID", "My-App", "app ID 'My-App' is invalid"),
        ("ZERO_LOG_LEVEL", "loud", "invalid setting ZERO_LOG_LEVEL"),
        ("CHANGESTREAMER_SQLITE_WRITER", "fork", "invalid setting CHANGESTREAMER_SQLITE_WRITER"),
    ],
)
def test_a_bad_setting_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, value: str, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=message) as e:
        load_settings()
    assert "\n" not in str(e.value)


def test_migrate_creates_the_default_sqlite_change_db(tmp_path: Path) -> None:
    result = run_cli(["migrate"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "zero_0-cdc.db").exists()
    assert "schema revision 0001" in result.stderr


def test_bad_settings_stop_the_command_with_exit_code_2(tmp_path: Path) -> None:
    result = run_cli(["serve"], tmp_path, ZERO_SHARD_NUM="x")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "changestreamer: invalid setting ZERO_SHARD_NUM: Input should be a valid integer, "
        "unable to parse string as an integer (got 'x')"
    ]


@pytest.mark.parametrize("command", [["tail"], ["status"], ["replicate", "--replica", "copy.db"]])
def test_a_bad_app_id_for_discover_is_one_line_and_exit_code_2(
    tmp_path: Path, command: list[str]
) -> None:
    result = run_cli([*command, "--discover", "cdc.db", "--app-id", "Bad-App"], tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"changestreamer {command[0]}: app ID 'Bad-App' is invalid: use only lower-case "
        "letters, digits and '_'"
    ]


def test_an_unusable_change_db_stops_the_command_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "junk.db").write_bytes(b"\x00garbage" * 1000)
    result = run_cli(["serve"], tmp_path, ZERO_CHANGE_DB="junk.db", NODE_ENV="development")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("changestreamer: SQLite file junk.db is not a SQLite database")


def test_serve_answers_health_probes(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZERO_")}
    env["PYTHONPATH"] = str(REPO)
    env["NODE_ENV"] = "development"
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [*CLI, "serve", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:

        def answers() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as r:
                    assert (r.status, r.read()) == (200, b"OK")
                return True
            except OSError:
                assert proc.poll() is None, f"serve exited with {proc.returncode}"
                return False

        eventually_blocking(answers, "serve to answer on /", 30, poll_s=0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/keepalive", timeout=2) as r:
            assert (r.status, r.read()) == (200, b"OK")
        # serve tunes the garbage collector once built (open statz: development mode).
        url = f"http://127.0.0.1:{port}/statz?format=json&group=os"
        with urllib.request.urlopen(url, timeout=5) as r:
            os_group = json.loads(r.read())["os"]
        assert os_group["gcThresholds"][0] == YOUNG_THRESHOLD
        assert os_group["gcFrozenObjects"] > 10_000  # modules, the app, its config
        # Which C helpers run: /statz says, as does one start-up line (same environment,
        # same install as this process, so the same choice).
        url = f"http://127.0.0.1:{port}/statz?format=json&group=speedups"
        with urllib.request.urlopen(url, timeout=5) as r:
            assert json.loads(r.read())["speedups"] == {
                "summary": speedups.summary(),
                **speedups.active(),
            }
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    assert (tmp_path / "zero_0-cdc.db").exists()
    lines = [
        line
        for line in (tmp_path / "serve.log").read_text().splitlines()
        if "changestreamer: speedups" in line  # not the access line of /statz?group=speedups
    ]
    assert len(lines) == 1, lines
    assert lines[0].endswith(f"INFO changestreamer: speedups: {speedups.summary()}")
    if not speedups.ENABLED:
        assert lines[0].endswith("speedups: pure Python (CHANGESTREAMER_SPEEDUPS=0)")
    elif all(speedups.active().values()):
        assert lines[0].endswith("speedups: C (jsscan, wsfast, rowrun, fanout, pgrows, copyload)")


def test_serve_refuses_to_start_without_an_admin_password_outside_development(
    tmp_path: Path,
) -> None:
    result = run_cli(["serve"], tmp_path, NODE_ENV="production")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "changestreamer: ZERO_ADMIN_PASSWORD is required outside development mode "
        "(NODE_ENV=development)"
    ]


@pytest.mark.parametrize("password", ["s3cr%zzet", "s3cr t"])
def test_a_url_libpq_cannot_parse_never_shows_its_password(tmp_path: Path, password: str) -> None:
    """libpq's parse errors quote the piece they could not parse, which may be the
    password: the line that says why serve stops must not show it."""
    result = run_cli(
        ["serve", "--port", str(free_port())],
        tmp_path,
        NODE_ENV="development",
        ZERO_UPSTREAM_DB=f"postgres://user:{password}@127.0.0.1:5432/db",
    )
    assert result.returncode == 1
    assert "s3cr" not in result.stdout + result.stderr
    assert "invalid connection string" in result.stderr.strip().splitlines()[-1]


def test_the_discovery_address_is_never_a_wildcard(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from app.commands.serve import discovery_address

    monkeypatch.chdir(tmp_path)
    settings = load_settings()
    assert discovery_address(settings, "127.0.0.1", 4849) == "127.0.0.1:4849"
    wildcard = discovery_address(settings, "0.0.0.0", 4849)
    assert not wildcard.startswith("0.0.0.0")
    assert wildcard.endswith(":4849")
    monkeypatch.setenv("ZERO_CHANGE_STREAMER_ADDRESS", "cs.internal:9000")
    assert discovery_address(load_settings(), "0.0.0.0", 4849) == "cs.internal:9000"


@pytest.mark.parametrize(
    ("env", "line"),
    [
        (
            {"ZERO_UPSTREAM_BD": "postgres://x"},
            "changestreamer: unknown setting ZERO_UPSTREAM_BD (did you mean ZERO_UPSTREAM_DB?)",
        ),
        (
            {"ZERO_FROBNICATE": "1"},
            "changestreamer: unknown setting ZERO_FROBNICATE: not a zero-cache 1.9.0 setting",
        ),
        (
            {"ZERO_UPSTREAM_PG_REPLICATION_SLOT_FAILOVER": "maybe"},
            "changestreamer: invalid setting ZERO_UPSTREAM_PG_REPLICATION_SLOT_FAILOVER: "
            "Input should be a valid boolean",
        ),
        (
            {"ZERO_CHANGE_STREAMER_BACK_PRESSURE_LIMIT_HEAP_PROPORTION": "2"},
            "changestreamer: ZERO_CHANGE_STREAMER_BACK_PRESSURE_LIMIT_HEAP_PROPORTION must be a "
            "fraction above 0 and at most 1 (got '2')",
        ),
        (
            {"ZERO_LITESTREAM_BACKUP_URL": "file:///tmp/b"},
            "changestreamer: ZERO_LITESTREAM_BACKUP_URL needs a Postgres upstream",
        ),
        (
            {
                "ZERO_UPSTREAM_DB": "postgres://u@127.0.0.1:1/db",
                "ZERO_LITESTREAM_BACKUP_URL": "file:///tmp/b",
                "CHANGESTREAMER_BACKUP_WEDGED_AFTER_SECONDS": "600",
            },
            "changestreamer: CHANGESTREAMER_BACKUP_WEDGED_AFTER_SECONDS (600) must be longer "
            "than the backup interval, ZERO_LITESTREAM_INCREMENTAL_BACKUP_INTERVAL_MINUTES "
            "(900 s)",
        ),
        (
            {"ZERO_UPSTREAM_TYPE": "mysql"},
            "changestreamer: ZERO_UPSTREAM_TYPE must be pg or custom (got 'mysql')",
        ),
        (
            {"ZERO_UPSTREAM_TYPE": "custom"},
            "changestreamer: ZERO_UPSTREAM_TYPE=custom needs ZERO_UPSTREAM_DB",
        ),
        (
            {"ZERO_UPSTREAM_TYPE": "custom", "ZERO_UPSTREAM_DB": "postgres://u@h/db"},
            "changestreamer: ZERO_UPSTREAM_DB: custom change source URL must be ws:// or wss://",
        ),
    ],
)
def test_serve_refuses_bad_zero_settings_with_one_line(
    tmp_path: Path, env: dict[str, str], line: str
) -> None:
    result = run_cli(["serve"], tmp_path, NODE_ENV="development", **env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(line), lines[0]
