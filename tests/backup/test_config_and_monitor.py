"""The pure parts of app/backup: config rendering, log lines, the monitor's rules."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.backup.config import BUILTIN_TEMPLATE, BackupConfigError, LitestreamOptions, render
from app.backup.monitor import BackupMonitor
from app.backup.process import parse_line
from app.backup.watermarks import BackedUpWatermark, LocalState

# zero-cache 1.9.0's own litestream config.yml, as its package ships it: it must
# work unchanged as ZERO_LITESTREAM_CONFIG_PATH.
ZERO_CONFIG_YML = """\
dbs:
  - path: ${ZERO_REPLICA_FILE}
    min-checkpoint-page-count: ${ZERO_LITESTREAM_MIN_CHECKPOINT_PAGE_COUNT}
    max-checkpoint-page-count: ${ZERO_LITESTREAM_MAX_CHECKPOINT_PAGE_COUNT}
    watermark-table: _zero.replicationState
    watermark-column: stateVersion
    replicas:
      - url: ${ZERO_LITESTREAM_BACKUP_URL}
        endpoint: ${ZERO_LITESTREAM_ENDPOINT}
        region: ${ZERO_LITESTREAM_REGION}
        snapshot-interval: ${ZERO_LITESTREAM_SNAPSHOT_BACKUP_INTERVAL_HOURS}h
        retention: ${ZERO_LITESTREAM_SNAPSHOT_RETENTION_INTERVAL_HOURS}h
        retention-check-interval: 15m
        sync-interval: ${ZERO_LITESTREAM_INCREMENTAL_BACKUP_INTERVAL_MINUTES}m
        multipart-concurrency: ${ZERO_LITESTREAM_MULTIPART_CONCURRENCY}
        multipart-size: ${ZERO_LITESTREAM_MULTIPART_SIZE}

logging:
  level: ${ZERO_LITESTREAM_LOG_LEVEL}
  type: ${ZERO_LOG_FORMAT}

addr: localhost:${LITESTREAM_PORT}
"""


def options(tmp_path: Path, **kw: object) -> LitestreamOptions:
    return LitestreamOptions(
        executable=Path("/bin/true"),
        replica_file=tmp_path / "replica.db",
        backup_url="s3://bucket/zero",
        **kw,  # type: ignore[arg-type]
    )


def test_the_builtin_template_gets_zero_s_values(tmp_path: Path) -> None:
    text = render(options(tmp_path, incremental_backup_interval_minutes=0.5, port=4999), {})
    assert f"path: {tmp_path / 'replica.db'}" in text
    assert "sync-interval: 0.5m" in text  # fractional minutes, as zero-cache allows
    assert "min-checkpoint-page-count: 10000" in text  # 40 MB × 250
    assert "interval: 12h" in text
    assert "retention: 18h" in text
    assert "addr: 127.0.0.1:4999" in text
    assert "endpoint: \n" in text  # unset: empty, not "None"
    assert "$" not in text


def test_zero_cache_s_own_config_yml_renders_unchanged(tmp_path: Path) -> None:
    config = tmp_path / "config.yml"
    config.write_text(ZERO_CONFIG_YML)
    text = render(
        options(tmp_path, config_path=config, max_checkpoint_page_count=0, region="eu-1"), {}
    )
    assert "max-checkpoint-page-count: 0" in text
    assert "region: eu-1" in text
    assert "sync-interval: 15m" in text
    assert "multipart-size: 16777216" in text
    assert "$" not in text


def test_a_template_variable_nobody_sets_is_named(tmp_path: Path) -> None:
    config = tmp_path / "config.yml"
    config.write_text("dbs:\n  - path: ${ZERO_REPLICA_FILE}\n    x: $NOT_SET_ANYWHERE\n")
    with pytest.raises(
        BackupConfigError, match=r"config.yml uses NOT_SET_ANYWHERE, which is not set"
    ):
        render(options(tmp_path, config_path=config), {})
    assert "${ZERO_REPLICA_FILE}" in BUILTIN_TEMPLATE


def test_a_missing_config_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(BackupConfigError, match=r"^ZERO_LITESTREAM_CONFIG_PATH .*nope.yml: "):
        render(options(tmp_path, config_path=tmp_path / "nope.yml"), {})


def test_the_vfs_url_carries_the_s3_endpoint_and_region(tmp_path: Path) -> None:
    o = options(tmp_path, endpoint="http://127.0.0.1:9000", region="us-east-1")
    assert o.vfs_url() == "s3://bucket/zero?endpoint=http://127.0.0.1:9000&region=us-east-1"
    assert options(tmp_path).vfs_url() == "s3://bucket/zero"


@pytest.mark.parametrize(
    ("line", "level", "text"),
    [
        (
            'time=2026-12-01T13:18:04.988Z level=INFO msg="initialized db" path=/x',
            logging.INFO,
            'msg="initialized db" path=/x',
        ),
        ("time=2026-12-01T13:18:04.988Z level=WARN msg=slow", logging.WARNING, "msg=slow"),
        (
            '{"time":"t","level":"ERROR","msg":"sync failed","db":"/x"}',
            logging.ERROR,
            "sync failed db=/x",
        ),
        ("Error: cannot open store: boom", logging.ERROR, "Error: cannot open store: boom"),
        ("plain words", logging.INFO, "plain words"),
    ],
)
def test_litestream_log_lines_keep_their_level(line: str, level: int, text: str) -> None:
    assert parse_line(line) == (level, text)


# -- the monitor ---------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def _stream(items: list[BackedUpWatermark]) -> AsyncIterator[BackedUpWatermark]:
    for item in items:
        yield item


def w(watermark: str) -> BackedUpWatermark:
    return BackedUpWatermark(watermark, 0)


def problem(monitor: BackupMonitor) -> str | None:
    """``monitor.problem``, read afresh: mypy keeps an attribute narrowed by an
    ``assert`` across the calls that change it."""
    return monitor.problem


def where_the_gate_opens(monitor: BackupMonitor) -> list[str]:
    """The watermark whose offer opened ``monitor``'s coverage gate (empty until then)."""
    covered_at: list[str] = []
    original = monitor.offer

    def offer(backed_up: BackedUpWatermark) -> None:
        original(backed_up)
        if monitor.covered.is_set() and not covered_at:
            covered_at.append(backed_up.watermark)

    monitor.offer = offer  # type: ignore[method-assign]
    return covered_at


async def test_the_monitor_tracks_newer_watermarks_only_and_opens_the_gate_at_coverage() -> None:
    tracked: list[str] = []
    targets: list[str | None] = []
    monitor = BackupMonitor(
        _stream([w("03"), w("05"), w("04"), w("05"), w("07"), w("09")]),
        tracked.append,
        lambda: LocalState("07"),
        wedged_after_s=60,
        on_coverage_target=targets.append,
    )
    covered_at = where_the_gate_opens(monitor)
    await monitor.run()
    assert tracked == ["03", "05", "07", "09"]  # older and repeated ones ignored
    assert targets == ["07"]
    assert covered_at == ["07"]  # not at the first watermark: at the replica's position


async def test_the_gate_waits_for_the_replica_as_read_at_start_not_for_its_later_position() -> None:
    # Seed 000: the target is pinned when the monitor starts, so that the gate can be
    # reached under sustained writes; a replica that moved on since does not move it.
    targets: list[str | None] = []
    positions = iter([LocalState("05"), LocalState("09")])
    monitor = BackupMonitor(
        _stream([w("04"), w("05"), w("06")]),
        lambda _: None,
        lambda: next(positions, LocalState("09")),
        wedged_after_s=60,
        on_coverage_target=targets.append,
    )
    covered_at = where_the_gate_opens(monitor)
    await monitor.run()
    assert targets == ["05"]
    assert covered_at == ["05"]


async def test_an_unreadable_replica_opens_the_gate_at_the_first_watermark(
    caplog: pytest.LogCaptureFixture,
) -> None:
    targets: list[str | None] = []
    monitor = BackupMonitor(
        _stream([w("02")]),
        lambda _: None,
        lambda: None,
        wedged_after_s=60,
        on_coverage_target=targets.append,
    )
    with caplog.at_level(logging.WARNING):
        await monitor.run()
    assert monitor.covered.is_set()
    assert any("first backup opens readiness" in r.getMessage() for r in caplog.records)
    # /ready and the takeover are told the same: no target, the first backup will do.
    assert targets == [None]


def test_a_backup_behind_the_replica_for_too_long_is_wedged_until_it_moves() -> None:
    clock = Clock()
    monitor = BackupMonitor(
        _stream([]), lambda _: None, lambda: None, wedged_after_s=60, clock=clock
    )
    monitor.offer(w("05"))
    clock.now = 59
    monitor.check(LocalState("06"))
    assert problem(monitor) is None
    clock.now = 61
    monitor.check(LocalState("06"))
    assert monitor.problem is not None
    assert monitor.problem.startswith("backup wedged: no progress for 61 s (backup at 05")
    monitor.offer(w("06"))
    assert problem(monitor) is None


def test_an_idle_caught_up_backup_is_never_wedged() -> None:
    clock = Clock()
    monitor = BackupMonitor(
        _stream([]), lambda _: None, lambda: None, wedged_after_s=60, clock=clock
    )
    monitor.offer(w("05"))
    for t in (100.0, 1000.0, 5000.0):
        clock.now = t
        monitor.check(LocalState("05"))
        assert problem(monitor) is None
    clock.now = 5030.0  # the replica moves on; the clock starts at its last idle check
    monitor.check(LocalState("06"))
    assert problem(monitor) is None
    clock.now = 5061.0
    monitor.check(LocalState("06"))
    assert monitor.problem is not None


def test_the_write_lag_is_the_replica_write_time_minus_the_backup_time() -> None:
    monitor = BackupMonitor(_stream([]), lambda _: None, lambda: None, wedged_after_s=60)
    assert monitor.lag_seconds() is None
    monitor.offer(BackedUpWatermark("05", backup_time_ms=10_000))
    monitor.check(LocalState("07", write_time_ms=13_500))
    assert monitor.lag_seconds() == 3.5
    monitor.check(LocalState("05", write_time_ms=9_000))
    assert monitor.lag_seconds() == 0.0  # the backup holds the replica's position
    assert monitor.stats()["lag_seconds"] == 0.0
