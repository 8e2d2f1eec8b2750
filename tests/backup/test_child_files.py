"""What litestream's runs leave behind: the rendered configuration (it holds the
secrets the template names) is ours only, never written through a planted symlink,
and gone once its process ended; litestream gets none of our other secrets.
Real litestream, real files (the backup tests' fixtures)."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from app.backup.config import LitestreamOptions
from app.backup.process import LitestreamRunner, config_path, write_config
from app.backup.restore import restore_replica
from tests.waiting import eventually

TIMEOUT_S = 30.0
SECRETS = {
    "ZERO_ADMIN_PASSWORD": "admin-secret-2",
    "ZERO_OPERATOR_PASSWORD": "operator-secret-2",
    "ZERO_UPSTREAM_DB": "postgresql://u:upstream-secret-2@127.0.0.1/db",
}


@pytest.fixture
def secrets_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "storage-key")  # litestream's: passed on


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def _plant_symlink(path: Path, tmp_path: Path) -> Path:
    target = tmp_path / "victim.txt"
    target.write_text("do not touch\n")
    path.symlink_to(target)
    return target


def test_the_rendered_config_is_0600_even_with_a_permissive_umask(
    litestream_options: LitestreamOptions,
) -> None:
    old = os.umask(0)
    try:
        path = write_config(litestream_options)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # A stale one from a crash is replaced, still 0600.
    path.chmod(0o644)
    again = write_config(litestream_options)
    assert again == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


async def test_replicate_s_config_is_private_not_symlinked_and_removed_at_stop(
    litestream_options: LitestreamOptions, tmp_path: Path, secrets_in_env: None
) -> None:
    path = config_path(litestream_options)
    target = _plant_symlink(path, tmp_path)
    runner = LitestreamRunner(litestream_options)
    task = asyncio.create_task(runner.run())
    try:
        pid = await eventually(lambda: runner.state.pid, "litestream to start", TIMEOUT_S)
        assert not path.is_symlink()
        assert stat.S_IMODE(path.lstat().st_mode) == 0o600
        assert target.read_text() == "do not touch\n"
        env = _environ_of(pid)
    finally:
        await runner.stop()
        await asyncio.wait_for(task, TIMEOUT_S)
    assert not os.path.lexists(path)
    assert target.read_text() == "do not touch\n"
    assert not [k for k in env if k in SECRETS], env
    assert not [v for v in env.values() if "secret-2" in v]
    assert env["AWS_SECRET_ACCESS_KEY"] == "storage-key"


async def test_restore_s_config_is_not_symlinked_and_is_removed_after(
    litestream_options: LitestreamOptions, tmp_path: Path, secrets_in_env: None
) -> None:
    runner = LitestreamRunner(litestream_options)
    task = asyncio.create_task(runner.run())
    root = Path(litestream_options.backup_url.removeprefix("file://"))
    try:
        await eventually(
            lambda: root.exists() and list(root.rglob("*.ltx")), "the first upload", TIMEOUT_S
        )
    finally:
        await runner.stop()
        await asyncio.wait_for(task, TIMEOUT_S)
    restored = tmp_path / "restored" / "replica.db"
    restored.parent.mkdir()
    options = LitestreamOptions(
        executable=litestream_options.executable,
        replica_file=restored,
        backup_url=litestream_options.backup_url,
        port=litestream_options.port,
    )
    path = config_path(options, "restore")
    target = _plant_symlink(path, tmp_path)
    result = await restore_replica(options, attempts=1)
    assert result is not None
    assert not os.path.lexists(path)
    assert not os.path.lexists(config_path(options))
    assert target.read_text() == "do not touch\n"
