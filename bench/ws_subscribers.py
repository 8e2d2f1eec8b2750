"""K websocket subscribers in their own process, for ``bench.fanout --transport ws``.

    python -m bench.ws_subscribers URL K FINAL_WATERMARK

Each subscriber connects to ``URL`` (a ``/replication/v6|v7/changes`` URL without
the ``id``), acks every frame as soon as it arrives, and stops at the commit of
FINAL_WATERMARK. Prints one JSON line: frames received in total and the seconds
from the first frame to the last subscriber's final commit.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from websockets.asyncio.client import connect


async def subscriber(url: str, final: str, first_frame: list[float]) -> int:
    frames = 0
    marker = f'{{"watermark":"{final}"}}]'
    async with connect(url, max_size=None, max_queue=None, compression=None) as ws:
        async for frame in ws:
            assert isinstance(frame, str)
            if not first_frame:
                first_frame.append(time.perf_counter())
            frames += 1
            await ws.send('{"ack":' + frame[6 : frame.index(",")] + "}")
            if frame.endswith((marker + "}", marker + "]}")):
                return frames
    return frames


async def main(url: str, k: int, final: str) -> None:
    first_frame: list[float] = []
    results = await asyncio.gather(
        *(subscriber(f"{url}&id=bench-{i}", final, first_frame) for i in range(k))
    )
    elapsed = time.perf_counter() - first_frame[0]
    print(
        json.dumps(
            {
                "frames": sum(results),
                "seconds": elapsed,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
