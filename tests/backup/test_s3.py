"""Backups to an S3 API: a real S3-compatible server (moto's) on loopback, real litestream.

moto stands in for S3 (it cannot be reached from here); litestream, the VFS
read-back and the restore talk to it over HTTP exactly as they would to S3.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from app.backup.config import LitestreamOptions
from app.backup.process import LitestreamRunner
from app.backup.restore import restore_replica
from app.backup.watermarks import VfsProbe
from tests.backup.conftest import REPLICA_VERSION, advance, item_count
from tests.backup.test_litestream import TIMEOUT_S, _try_read, eventually, vfs_extension

BUCKET = "zero-backups"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    # litestream v0.5's S3 client cannot take a custom CA bundle ("unable to add
    # custom RootCAs HTTPClient"); this sandbox sets one, and loopback needs none.
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    # Credentials for moto; litestream and the VFS worker inherit them from us.
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket=BUCKET
        )
        yield endpoint
    finally:
        server.stop()


@pytest.fixture
def s3_options(litestream_options: LitestreamOptions, s3_endpoint: str) -> LitestreamOptions:
    return replace(
        litestream_options,
        backup_url=f"s3://{BUCKET}/zero/replica",
        endpoint=s3_endpoint,
        region="us-east-1",
    )


async def test_backup_read_back_and_restore_through_an_s3_api(
    s3_options: LitestreamOptions, tmp_path: Path
) -> None:
    assert "endpoint=" in s3_options.vfs_url()
    runner = LitestreamRunner(s3_options)
    task = asyncio.create_task(runner.run())
    probe = VfsProbe(s3_options.vfs_url(), vfs_extension(), timeout_s=10)
    try:
        state = await eventually(lambda: _try_read(probe), "the backup's state in S3")
        assert state.watermark == REPLICA_VERSION
        advance(s3_options.replica_file, "0b", rows=40)
        await eventually(lambda: _try_read(probe, want="0b"), "the S3 backup to reach 0b")
    finally:
        await probe.close()
        await runner.stop()
        await asyncio.wait_for(task, TIMEOUT_S)
    assert os.environ["AWS_ACCESS_KEY_ID"] == "testing"

    target = tmp_path / "from-s3.db"
    restored = await restore_replica(
        replace(s3_options, replica_file=target), replica_version=REPLICA_VERSION
    )
    assert restored is not None
    assert restored.state.state_version == "0b"
    assert item_count(target) == 140
