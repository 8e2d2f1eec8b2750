from typing import Any

from app.protocol.messages import Data

def setup(data: type[Data], unchanged_toast: object) -> None: ...
def decode(
    buffer: bytes | memoryview, offset: int, specs: dict[int, tuple[Any, ...]]
) -> Data | None: ...
