from collections import deque
from typing import Any

from app.protocol.pieces import Text

def select_live(
    changes: list[Any],
    watermark: str,
    unsupported: frozenset[str],
    pushed: int,
    texts: list[Text],
    commits: deque[tuple[int, str]],
    /,
) -> str: ...
def running_totals(ends: list[int], messages: list[Text], total: int, /) -> int: ...
