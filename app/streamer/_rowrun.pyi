from collections.abc import Callable
from typing import Any

def setup(
    data: type,
    change: type,
    encode_fast: Callable[[Any], str | None],
    /,
) -> None: ...
def encode_rows(
    messages: list[Any],
    start: int,
    watermark: str,
    changes: list[Any],
    budget: int,
    /,
) -> tuple[int, int]: ...
