"""One Lua script's calls, pipelined: the calls made in one turn of the event loop go to Redis
together, as one pipeline of EVALSHAs on one connection (not a transaction: each call is still
its own atomic script).

Each call is still one Redis command; what the calls share is the connection taken from the
pool, the write and the wake-up. At 64 streams on a busy gateway that is most of what redis-py
costs per call (the pool alone tens of microseconds), and no call waits for a free connection
behind the others. A Redis that lost its scripts (restarted) gets the script again (SCRIPT
LOAD) and the calls it refused are sent again, once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio
from redis.exceptions import NoScriptError, ResponseError


@dataclass(frozen=True, slots=True)
class _Call:
    keys: Sequence[str]
    args: Sequence[str | int]
    reply: asyncio.Future


class ScriptBatcher:
    """`call` runs the script; calls queued in one loop turn share one pipeline."""

    def __init__(self, client: redis.asyncio.Redis, script: str) -> None:
        self._client = client
        self._script = script
        self._sha = client.register_script(script).sha  # computed here, nothing sent
        self._queued: list[_Call] = []
        self._sending: set[asyncio.Task[None]] = set()

    async def call(self, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        """The script's reply, as redis-py gives it; raises what redis-py raises
        (RedisError). A caller cancelled after the pipeline went out: the script ran."""
        loop = asyncio.get_running_loop()
        call = _Call(keys, args, loop.create_future())
        self._queued.append(call)
        if len(self._queued) == 1:  # the first of this turn: send after the others join
            loop.call_soon(self._send_queued)
        return await call.reply

    def _send_queued(self) -> None:
        calls, self._queued = self._queued, []
        task = asyncio.get_running_loop().create_task(self._send(calls))
        self._sending.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._sending.discard)

    async def _send(self, calls: list[_Call]) -> None:
        """Every caller hears its reply, or the error that stopped the pipeline."""
        try:
            replies = await self._replies(calls)
        except asyncio.CancelledError:
            for call in calls:
                call.reply.cancel()
            raise
        except Exception as error:  # RedisError for the callers to handle; any other is a bug
            for call in calls:
                _settle(call.reply, error)
            return
        for call, reply in zip(calls, replies, strict=True):
            _settle(call.reply, reply)

    async def _replies(self, calls: list[_Call]) -> list[object]:
        replies = await self._pipeline(calls)
        refused = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if refused:  # Redis restarted: load the script, send those calls again
            await self._client.script_load(self._script)
            again = await self._pipeline([calls[i] for i in refused])
            for i, reply in zip(refused, again, strict=True):
                replies[i] = reply
        return replies

    async def _pipeline(self, calls: list[_Call]) -> list[object]:
        """The replies in order, a script's error (ResponseError) among them as a value."""
        if len(calls) == 1:  # alone in its turn (a quiet gateway): no pipeline to build
            call = calls[0]
            try:
                return [
                    await self._client.evalsha(self._sha, len(call.keys), *call.keys, *call.args)
                ]
            except ResponseError as error:
                return [error]
        pipeline = self._client.pipeline(transaction=False)
        for call in calls:
            pipeline.evalsha(self._sha, len(call.keys), *call.keys, *call.args)
        return await pipeline.execute(raise_on_error=False)


def _settle(future: asyncio.Future, reply: object) -> None:
    if future.done():  # its caller was cancelled
        return
    if isinstance(reply, BaseException):
        future.set_exception(reply)
    else:
        future.set_result(reply)
