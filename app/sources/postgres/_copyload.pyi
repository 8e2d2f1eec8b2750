from collections.abc import Callable, Mapping
from typing import Any

from psycopg import pq

def api_names() -> tuple[str, ...]: ...
def setup(
    addresses: Mapping[str, int],
    format_error: type[Exception],
    integrity_error: type[Exception],
    operational_error: type[Exception],
) -> None: ...

class Loader:
    def __init__(
        self,
        path: str,
        insert: str,
        converters: tuple[Callable[[str], Any] | None, ...],
        busy_timeout_ms: int,
    ) -> None: ...
    def load(self, pgconn: pq.abc.PGconn, max_bytes: int) -> tuple[int, int, int]: ...
    def parse_line(self, line: bytes | bytearray | memoryview) -> list[str | None]: ...
    def close(self) -> None: ...
