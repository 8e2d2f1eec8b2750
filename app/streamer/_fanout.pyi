from collections import deque
from typing import Any

def select_live(
    changes: list[Any],
    watermark: str,
    unsupported: frozenset[str],
    pushed: int,
    texts: list[str],
    commits: deque[tuple[int, str]],
    /,
) -> str: ...
def running_totals(ends: list[int], messages: list[str], total: int, /) -> int: ...
