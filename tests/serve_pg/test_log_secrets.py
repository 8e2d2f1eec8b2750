"""A Postgres upstream's password never reaches ``serve``'s output, in either log
format (``app/logs.py``): not from set-up, streaming, the replica follower's relayed
lines, nor a request line that quotes a secret."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.serve_pg.conftest import (
    ServeFactory,
    create_workload_schema,
    pg_execute,
    wait_until_replica_matches,
)

PLANTED = "PLANTED-pw-91c2"


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as response:
        return int(response.status)


@pytest.mark.parametrize(("fmt", "form"), [("text", "url"), ("json", "conninfo")])
async def test_the_upstream_password_appears_nowhere_in_serve_s_output(
    upstream: str, serve_factory: ServeFactory, fmt: str, form: str
) -> None:
    # The test server trusts loopback: the password is carried, never checked.
    info = conninfo_to_dict(upstream)
    planted = (
        f"postgresql://{info['user']}:{PLANTED}@{info['host']}:{info.get('port', 5432)}/"
        f"{info['dbname']}"
        if form == "url"
        else make_conninfo(upstream, password=PLANTED)
    )
    await create_workload_schema(upstream)
    serve = serve_factory(planted, ZERO_LOG_FORMAT=fmt)
    serve.start()
    await serve.wait_ready()
    await pg_execute(
        upstream, "INSERT INTO items VALUES (1000, 1, 'streamed', 0, true, '{}', now())"
    )
    await wait_until_replica_matches(upstream, serve.replica_file)
    # uvicorn's access line quotes the query: only the log's filter hides this one.
    assert await asyncio.to_thread(
        _get, f"http://127.0.0.1:{serve.port}/keepalive?apiKey={PLANTED}"
    )
    await serve.wait_output(r"/keepalive\?apiKey=\*\*\* ")
    await serve.terminate()
    output = serve.output()
    assert PLANTED not in output
    assert f"initial sync of {info['user']}@{info['host']}:" in output  # what it did name
    if fmt == "json":
        for line in output.splitlines():
            assert isinstance(json.loads(line), dict), line
