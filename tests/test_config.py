"""Settings: the zero-cache 1.9.0 catalog, strict names, backups' fields, start-up notes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.config import (
    SETTING_NAMES,
    SettingsError,
    check_change_db_directory,
    load_settings,
    read_environment,
)
from app.zero_settings import (
    CATALOG,
    OUTSIDE_OPTIONS,
    OWN_EXTENSIONS,
    Category,
    refusal,
    startup_notes,
)

REPO = Path(__file__).resolve().parents[1]
ZERO_SETTINGS_TSV = REPO / "docs" / "zero-1.9.0-settings.tsv"


def load(env: dict[str, str], **overrides: Any) -> Any:
    """Settings from exactly ``env``: not the machine's environment, no .env file."""
    return load_settings(environ=env, env_file=None, **overrides)


def refused(env: dict[str, str]) -> str:
    with pytest.raises(SettingsError) as e:
        load(env)
    return str(e.value)


# The catalog


def test_the_catalog_holds_exactly_zero_cache_1_9_0s_names_in_its_order() -> None:
    lines = ZERO_SETTINGS_TSV.read_text(encoding="utf-8").splitlines()
    names = [line.split("\t")[0] for line in lines]
    assert len(names) == 117
    assert list(CATALOG) == names


def test_implemented_names_are_exactly_the_zero_aliases_of_settings() -> None:
    implemented = {n for n, s in CATALOG.items() if s.category is Category.IMPLEMENTED}
    zero_aliases = {n for n in SETTING_NAMES if n.startswith("ZERO_")}
    assert implemented == zero_aliases - OWN_EXTENSIONS.keys()
    assert OWN_EXTENSIONS.keys() <= SETTING_NAMES
    assert not OWN_EXTENSIONS.keys() & CATALOG.keys()
    # The other names Settings reads are this service's own, or NODE_ENV as in zero.
    assert {n for n in SETTING_NAMES - zero_aliases if not n.startswith("CHANGESTREAMER_")} == {
        "NODE_ENV"
    }


def test_names_outside_zeros_options_are_not_in_the_catalog_nor_settings() -> None:
    assert not OUTSIDE_OPTIONS.keys() & CATALOG.keys()
    assert not OUTSIDE_OPTIONS.keys() & SETTING_NAMES
    assert all(s.category is not Category.IMPLEMENTED for s in OUTSIDE_OPTIONS.values())
    assert all(s.category is not Category.UNSUPPORTED for s in OUTSIDE_OPTIONS.values())


def test_every_name_not_implemented_says_why() -> None:
    for name, setting in {**CATALOG, **OUTSIDE_OPTIONS}.items():
        implemented = setting.category is Category.IMPLEMENTED
        assert bool(setting.reason) != implemented, name
        assert not setting.harmless or setting.category is Category.UNSUPPORTED, name
    assert all(OWN_EXTENSIONS.values())


# Unknown names


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("ZERO_UPSTREAM_BD", "unknown setting ZERO_UPSTREAM_BD (did you mean ZERO_UPSTREAM_DB?)"),
        ("ZERO_PROT", "unknown setting ZERO_PROT (did you mean ZERO_PORT?)"),
        ("zero_port", "unknown setting zero_port (did you mean ZERO_PORT?)"),
        (
            "ZERO_FOLLOW_REPLICA",
            "unknown setting ZERO_FOLLOW_REPLICA (did you mean CHANGESTREAMER_FOLLOW_REPLICA?)",
        ),
        (
            "CHANGESTREAMER_SQLITE_WRITTER",
            "unknown setting CHANGESTREAMER_SQLITE_WRITTER "
            "(did you mean CHANGESTREAMER_SQLITE_WRITER?)",
        ),
        ("ZERO_FOO", "unknown setting ZERO_FOO: not a zero-cache 1.9.0 setting"),
        ("CHANGESTREAMER_FOO", "unknown setting CHANGESTREAMER_FOO: not a changestreamer setting"),
    ],
)
def test_an_unknown_name_is_refused_with_the_closest_known_one(name: str, message: str) -> None:
    assert refused({name: "x"}) == message
    # Even empty: a misspelt name is wrong whatever it holds.
    assert refused({name: ""}) == message


def test_an_unknown_name_in_the_env_file_is_refused(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("ZERO_APP_ID=zoro\nZERO_REPLICA_FLIE=/tmp/r.db\n", encoding="utf-8")
    with pytest.raises(SettingsError) as e:
        load_settings(environ={}, env_file=env_file)
    assert str(e.value) == "unknown setting ZERO_REPLICA_FLIE (did you mean ZERO_REPLICA_FILE?)"


def test_the_default_env_file_is_dot_env_in_the_working_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("ZERO_APP_ID=from_file\nZERO_PORT=5000\n", encoding="utf-8")
    settings = load_settings(environ={"ZERO_PORT": "6000"})
    # The environment wins over .env, as before.
    assert (settings.app_id, settings.port) == ("from_file", 6000)


def test_the_machines_environment_is_read_when_none_is_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ZERO_APP_ID", "from_env")
    assert load_settings().app_id == "from_env"
    monkeypatch.setenv("ZERO_UPSTREAM_BD", "postgres://x")
    with pytest.raises(SettingsError, match="did you mean ZERO_UPSTREAM_DB"):
        load_settings()


def test_every_kind_of_known_name_is_accepted() -> None:
    env = {
        "ZERO_UPSTREAM_DB": "",  # implemented
        "ZERO_OPERATOR_PASSWORD": "op",  # own extension
        "ZERO_CVR_DB": "postgres://cvr",  # other role
        "ZERO_CHANGE_LOG_BATCH_SIZE": "10",  # tuning ignored
        "ZERO_UPSTREAM_TYPE": "pg",  # implemented
        "ZERO_IN_CONTAINER": "1",  # outside zero's options
        "CHANGESTREAMER_SQLITE_WRITER": "thread",
        # The test suite's own variables reach `serve` through inherited environments.
        "CHANGESTREAMER_TEST_PG_URL": "postgresql://postgres@127.0.0.1/t",
        "CHANGESTREAMER_TEST_DB": "t",
        "NODE_ENV": "development",
        "PATH": "/usr/bin",
    }
    settings = load(env)
    assert (settings.operator_password, settings.sqlite_writer) == ("op", "thread")


def test_an_unknown_override_is_refused() -> None:
    with pytest.raises(SettingsError) as e:
        load({}, ZERO_UPSTREAM_BD="x")
    assert (
        str(e.value) == "invalid setting ZERO_UPSTREAM_BD: Extra inputs are not permitted (got 'x')"
    )


def test_overrides_win_over_the_environment() -> None:
    settings = load({"ZERO_APP_ID": "env", "ZERO_PORT": "5000"}, ZERO_APP_ID="override")
    assert (settings.app_id, settings.port) == ("override", 5000)


def test_empty_values_are_unset_as_in_zero() -> None:
    settings = load(
        {"ZERO_CHANGE_STREAMER_PORT": "", "ZERO_APP_ID": "", "ZERO_LITESTREAM_PORT": ""}
    )
    assert (settings.change_streamer_port, settings.app_id, settings.litestream_port) == (
        None,
        "zero",
        None,
    )


def test_read_environment_puts_the_environment_over_the_env_file(tmp_path: Path) -> None:
    env_file = tmp_path / "settings.env"
    env_file.write_text("ZERO_APP_ID=file\nZERO_PORT=1\nZERO_TASK_ID\n", encoding="utf-8")
    assert read_environment({"ZERO_PORT": "2"}, env_file) == {
        "ZERO_APP_ID": "file",
        "ZERO_PORT": "2",
        "ZERO_TASK_ID": None,
    }
    assert read_environment({"A": "b"}, tmp_path / "missing.env") == {"A": "b"}
    assert read_environment({"A": "b"}, None) == {"A": "b"}


# Unsupported settings


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("ZERO_SHARD_ID", "0", "zero-cache refuses it too; use ZERO_APP_ID"),
    ],
)
def test_an_unsupported_setting_stops_start_up(name: str, value: str, reason: str) -> None:
    assert refused({name: value}) == (
        f"{name} is a zero-cache setting this service does not implement ({reason}); unset it"
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("ZERO_UPSTREAM_PG_REPLICATION_SLOT_FAILOVER", ""),
        ("ZERO_UPSTREAM_PG_REPLICATION_SLOT_FAILOVER", "false"),
        ("ZERO_UPSTREAM_PG_REPLICATION_SLOT_FAILOVER", "0"),
        ("ZERO_CHANGE_STREAMER_PROTOCOL", "ws"),
        ("ZERO_SHARD_ID", ""),
    ],
)
def test_an_unsupported_setting_at_zeros_default_is_accepted(name: str, value: str) -> None:
    assert refusal(name, value) is None
    assert load({name: value}).startup_notes == ()


# The upstream type


@pytest.mark.parametrize(("value", "expected"), [("pg", "pg"), ("custom", "custom"), ("", "pg")])
def test_the_upstream_type_is_pg_or_custom(value: str, expected: str) -> None:
    assert load({"ZERO_UPSTREAM_TYPE": value}).upstream_type == expected


@pytest.mark.parametrize("value", ["mysql", "PG", "custom "])
def test_any_other_upstream_type_is_one_line(value: str) -> None:
    assert refused({"ZERO_UPSTREAM_TYPE": value}) == (
        f"ZERO_UPSTREAM_TYPE must be pg or custom (got {value!r})"
    )


# Start-up notes


def test_start_up_notes_name_other_roles_and_ignored_tuning_once() -> None:
    env = {
        "ZERO_NUM_SYNC_WORKERS": "0",
        "ZERO_CVR_DB": "postgres://cvr",
        "ZERO_MUTATE_URL": "",  # empty: unset
        "ZERO_REPLICA_VACUUM_INTERVAL_HOURS": "3",
        "ZERO_INITIAL_SYNC_TEXT_COPY": "true",
        "ZERO_UPSTREAM_DB": "postgres://up",
        "ZERO_TASK_ID": None,
    }
    expected = [
        "settings for other zero-cache roles, not used by this service: "
        "ZERO_CVR_DB, ZERO_NUM_SYNC_WORKERS",
        "settings accepted but without effect here: "
        "ZERO_INITIAL_SYNC_TEXT_COPY (initial sync always copies in text format), "
        "ZERO_REPLICA_VACUUM_INTERVAL_HOURS (the replica is not VACUUMed at start-up)",
    ]
    assert startup_notes(env) == expected
    loaded = {k: v for k, v in env.items() if v is not None}
    assert load(loaded).startup_notes == tuple(expected)


def test_no_start_up_notes_without_such_settings() -> None:
    assert startup_notes({"ZERO_PORT": "5000", "HOME": "/root"}) == []
    assert startup_notes({"ZERO_LITESTREAM_RESTORE_USING_V5": "true"}) == [
        "settings accepted but without effect here: "
        "ZERO_LITESTREAM_RESTORE_USING_V5 (restores always use litestream v0.5)"
    ]


# Backup settings


def test_backup_settings_default_to_zeros_values() -> None:
    s = load({})
    assert (s.litestream_executable, s.litestream_executable_v5) == (None, None)
    assert s.litestream_backup_using_v5 is False
    assert (s.litestream_config_path, s.litestream_vfs_extension_path) == (None, None)
    assert (s.litestream_vfs_probe_interval_ms, s.litestream_vfs_probe_timeout_ms) == (1000, 30000)
    assert (s.litestream_vfs_log_file, s.litestream_log_level) == (None, "warn")
    assert (s.litestream_backup_url, s.litestream_endpoint, s.litestream_region) == (None,) * 3
    assert (s.litestream_port, s.litestream_port_resolved) == (None, 4850)
    assert s.litestream_checkpoint_threshold_mb == 40
    assert (s.litestream_min_checkpoint_page_count, s.litestream_max_checkpoint_page_count) == (
        None,
        None,
    )
    assert s.litestream_incremental_backup_interval_minutes == 15
    assert s.litestream_snapshot_backup_interval_hours == 12
    assert (s.litestream_restore_parallelism, s.litestream_multipart_concurrency) == (48, 48)
    assert s.litestream_multipart_size == 16 * 1024 * 1024
    assert s.log_format == "text"
    assert (s.backup_wedged_after_s, s.reservation_max_s) == (None, 14400)
    # Twice the 15-minute backup interval: litestream uploads once per interval.
    assert s.backup_wedged_after_seconds == 1800
    assert (s.change_log_retention_s, s.replica_poll_interval_s) == (300, 10)


def test_backup_settings_are_read_with_zeros_names() -> None:
    env = {
        "ZERO_PORT": "5000",
        "ZERO_LITESTREAM_EXECUTABLE": "/opt/litestream",
        "ZERO_LITESTREAM_EXECUTABLE_V5": "/opt/litestream5",
        "ZERO_LITESTREAM_BACKUP_USING_V5": "1",
        "ZERO_LITESTREAM_CONFIG_PATH": "/etc/litestream.yml",
        "ZERO_LITESTREAM_VFS_EXTENSION_PATH": "/usr/local/lib/litestream-vfs.so",
        "ZERO_LITESTREAM_VFS_PROBE_INTERVAL_MS": "250",
        "ZERO_LITESTREAM_VFS_PROBE_TIMEOUT_MS": "5000",
        "ZERO_LITESTREAM_VFS_LOG_FILE": "/tmp/vfs.log",
        "ZERO_LITESTREAM_LOG_LEVEL": "debug",
        "ZERO_LITESTREAM_BACKUP_URL": "s3://bucket/replica",
        "ZERO_LITESTREAM_ENDPOINT": "http://127.0.0.1:9000",
        "ZERO_LITESTREAM_REGION": "eu-west-1",
        "ZERO_LITESTREAM_CHECKPOINT_THRESHOLD_MB": "2.5",
        "ZERO_LITESTREAM_MIN_CHECKPOINT_PAGE_COUNT": "0",
        "ZERO_LITESTREAM_MAX_CHECKPOINT_PAGE_COUNT": "9000",
        "ZERO_LITESTREAM_INCREMENTAL_BACKUP_INTERVAL_MINUTES": "0.05",
        "ZERO_LITESTREAM_SNAPSHOT_BACKUP_INTERVAL_HOURS": "0.5",
        "ZERO_LITESTREAM_RESTORE_PARALLELISM": "4",
        "ZERO_LITESTREAM_MULTIPART_CONCURRENCY": "2",
        "ZERO_LITESTREAM_MULTIPART_SIZE": "5242880",
        "ZERO_LOG_FORMAT": "json",
        "CHANGESTREAMER_BACKUP_WEDGED_AFTER_SECONDS": "60",
        "CHANGESTREAMER_RESERVATION_MAX_SECONDS": "1.5",
        "CHANGESTREAMER_CHANGE_LOG_RETENTION_SECONDS": "3600",
        "CHANGESTREAMER_REPLICA_POLL_INTERVAL_SECONDS": "0.2",
    }
    s = load(env)
    assert (s.litestream_executable, s.litestream_executable_v5) == (
        "/opt/litestream",
        "/opt/litestream5",
    )
    assert s.litestream_backup_using_v5 is True
    assert s.litestream_config_path == "/etc/litestream.yml"
    assert s.litestream_vfs_extension_path == "/usr/local/lib/litestream-vfs.so"
    assert (s.litestream_vfs_probe_interval_ms, s.litestream_vfs_probe_timeout_ms) == (250, 5000)
    assert (s.litestream_vfs_log_file, s.litestream_log_level) == ("/tmp/vfs.log", "debug")
    assert s.litestream_backup_url == "s3://bucket/replica"
    assert (s.litestream_endpoint, s.litestream_region) == ("http://127.0.0.1:9000", "eu-west-1")
    assert s.litestream_port_resolved == 5002  # ZERO_PORT + 2
    assert s.litestream_checkpoint_threshold_mb == 2.5
    assert (s.litestream_min_checkpoint_page_count, s.litestream_max_checkpoint_page_count) == (
        0,
        9000,
    )
    assert s.litestream_incremental_backup_interval_minutes == 0.05
    assert s.litestream_snapshot_backup_interval_hours == 0.5
    assert (s.litestream_restore_parallelism, s.litestream_multipart_concurrency) == (4, 2)
    assert (s.litestream_multipart_size, s.log_format) == (5242880, "json")
    assert (s.backup_wedged_after_s, s.reservation_max_s) == (60, 1.5)
    assert s.backup_wedged_after_seconds == 60  # as set
    # With uploads every 3 s, the default stays at its floor of 15 minutes.
    del env["CHANGESTREAMER_BACKUP_WEDGED_AFTER_SECONDS"]
    assert load(env).backup_wedged_after_seconds == 900
    assert (s.change_log_retention_s, s.replica_poll_interval_s) == (3600, 0.2)
    assert load({"ZERO_LITESTREAM_PORT": "7000"}).litestream_port_resolved == 7000


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("0", False), ("false", False)])
def test_backup_booleans_take_zeros_spellings(value: str, expected: bool) -> None:
    assert load({"ZERO_LITESTREAM_BACKUP_USING_V5": value}).litestream_backup_using_v5 is expected


@pytest.mark.parametrize("url", ["file:///var/backups/zero", "s3://bucket/path?x=1"])
def test_a_file_or_s3_backup_url_is_accepted(url: str) -> None:
    assert load({"ZERO_LITESTREAM_BACKUP_URL": url}).litestream_backup_url == url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("gs://bucket/x", "'gs://bucket/x'"),
        ("/var/backups/zero", "'/var/backups/zero'"),
        ("http://user:secret@host/x", "'http://user:***@host/x'"),
    ],
)
def test_another_backup_url_is_one_line(url: str, shown: str) -> None:
    assert refused({"ZERO_LITESTREAM_BACKUP_URL": url}) == (
        f"ZERO_LITESTREAM_BACKUP_URL must be a file:// or s3:// URL (got {shown})"
    )


def test_an_empty_backup_url_is_none() -> None:
    assert load({"ZERO_LITESTREAM_BACKUP_URL": ""}).litestream_backup_url is None
    assert load({}, ZERO_LITESTREAM_BACKUP_URL="").litestream_backup_url is None


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("ZERO_LITESTREAM_PORT", "0", "Input should be greater than or equal to 1"),
        ("ZERO_LITESTREAM_PORT", "65536", "Input should be less than or equal to 65535"),
        ("ZERO_LITESTREAM_LOG_LEVEL", "loud", "Input should be 'debug', 'info', 'warn' or 'error'"),
        ("ZERO_LOG_FORMAT", "xml", "Input should be 'text' or 'json'"),
        ("ZERO_LITESTREAM_VFS_PROBE_INTERVAL_MS", "0", "Input should be greater than 0"),
        ("ZERO_LITESTREAM_CHECKPOINT_THRESHOLD_MB", "inf", "Input should be a finite number"),
        (
            "ZERO_LITESTREAM_MIN_CHECKPOINT_PAGE_COUNT",
            "-1",
            "Input should be greater than or equal to 0",
        ),
        (
            "ZERO_LITESTREAM_INCREMENTAL_BACKUP_INTERVAL_MINUTES",
            "0",
            "Input should be greater than 0",
        ),
        (
            "ZERO_LITESTREAM_MULTIPART_SIZE",
            "1.5",
            "Input should be a valid integer, unable to parse string as an integer",
        ),
        (
            "ZERO_LITESTREAM_BACKUP_USING_V5",
            "maybe",
            "Input should be a valid boolean, unable to interpret input",
        ),
        (
            "CHANGESTREAMER_CHANGE_LOG_RETENTION_SECONDS",
            "-1",
            "Input should be greater than or equal to 0",
        ),
        ("CHANGESTREAMER_REPLICA_POLL_INTERVAL_SECONDS", "0", "Input should be greater than 0"),
    ],
)
def test_a_bad_backup_setting_is_one_line(name: str, value: str, message: str) -> None:
    assert refused({name: value}) == f"invalid setting {name}: {message} (got {value!r})"


# The change DB's directory


def test_a_change_db_in_a_missing_directory_is_refused(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    settings = load({"ZERO_CHANGE_DB": str(missing / "cdc.db")})
    with pytest.raises(SettingsError) as e:
        check_change_db_directory(settings)
    assert str(e.value) == f"ZERO_CHANGE_DB: directory {missing} does not exist"
    settings = load({"ZERO_CHANGE_DB": f"sqlite:///{missing}/cdc.db"})
    with pytest.raises(SettingsError, match=f"^ZERO_CHANGE_DB: directory {missing} does not"):
        check_change_db_directory(settings)


def test_the_default_change_db_beside_a_replica_in_a_missing_directory_is_refused(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "gone"
    settings = load({"ZERO_REPLICA_FILE": str(missing / "replica.db")})
    with pytest.raises(SettingsError) as e:
        check_change_db_directory(settings)
    assert str(e.value) == (
        f"ZERO_REPLICA_FILE: directory {missing} does not exist "
        "(the default SQLite change DB goes beside the replica)"
    )
    assert not missing.exists()


def test_a_change_db_in_an_existing_directory_or_on_postgres_passes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    check_change_db_directory(load({}))  # zero_0-cdc.db in the working directory
    check_change_db_directory(load({"ZERO_CHANGE_DB": str(tmp_path / "cdc.db")}))
    check_change_db_directory(load({"ZERO_CHANGE_DB": "postgres://u@127.0.0.1:1/nowhere"}))
    # A malformed URL is left to opening the change DB, which says what is wrong.
    check_change_db_directory(load({"ZERO_CHANGE_DB": "mysql://x/y"}))


# .env.example


def test_env_example_lists_every_setting_and_loads_as_a_dot_env(tmp_path: Path) -> None:
    example = REPO / ".env.example"
    names = set(read_environment({}, example))
    assert names == SETTING_NAMES
    # Copied to .env as it is, it changes nothing: its values are the defaults.
    assert load_settings(environ={}, env_file=example) == load({})


def test_allowed_hosts_are_host_names_and_a_url_is_one_line() -> None:
    assert load({"CHANGESTREAMER_ALLOWED_HOSTS": "Node-1.internal, [fd00::1]"}).allowed_hosts == [
        "node-1.internal",
        "[fd00::1]",
    ]
    refusal_line = refused({"CHANGESTREAMER_ALLOWED_HOSTS": "https://node-1:4849"})
    assert "CHANGESTREAMER_ALLOWED_HOSTS" in refusal_line
    assert "is not a host name or address (no port, no scheme)" in refusal_line
    assert "\n" not in refusal_line
