"""Slow start-up work (loading a model or a tokenizer) off the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def in_daemon_thread(work: Callable[[], T], name: str) -> asyncio.Future[T]:
    """Runs `work` in a daemon thread and returns a future for its result.

    Not `asyncio.to_thread`: interpreter exit waits for executor threads, so a SIGTERM that
    arrives during a long load would only take effect once the load finished. A daemon thread
    is simply dropped.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            result = work()
        except BaseException as error:  # handed to whoever awaits the future
            loop.call_soon_threadsafe(_settle, future, None, error)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():  # cancelled meanwhile: nobody wants the result
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def wait_first(*futures: asyncio.Future[Any]) -> None:
    """Until the first of `futures` is done; the others go on (asyncio.wait, FIRST_COMPLETED,
    over futures of different result types)."""
    await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
