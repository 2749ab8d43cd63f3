"""An asyncio front for the engine: `async for delta in llm.generate(...)`.

The engine runs in one dedicated thread (torch releases the GIL inside its kernels, so the event
loop stays responsive). Commands go to it through a thread-safe queue and are applied between
steps; deltas come back through `loop.call_soon_threadsafe` into one asyncio queue per request.

Disaggregation adds two plain entry points; where a prompt is prefilled is the pod's decision,
never made here:
- decode pods: `reserve_remote_prefill` -> a `RemotePrefillReservation` whose blocks a prefill
  pod fills; the pod then calls `complete(result)` or `fall_back()` and reads `deltas()`;
- prefill pods: `prefill_and_export` -> the first token and the packed prompt pages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from splitserve.engine.config import EngineConfig
from splitserve.engine.core import EngineCore, EngineStats, LoRAInfo
from splitserve.engine.kv.block_hash import BlockHash
from splitserve.engine.kv.disaggregation import (
    ExportedPrefill,
    RemotePrefillPlan,
    RemotePrefillResult,
)
from splitserve.engine.kv.events import KVCacheEvent
from splitserve.engine.kv.tiers import Tier
from splitserve.engine.lora.request import LoRARequest
from splitserve.engine.outputs import StreamDelta, merge_deltas
from splitserve.engine.parallel.group import ParallelError
from splitserve.engine.prompts import child_sequences
from splitserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Submit:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    sink: _Sink
    export_kv_from_block: int | None = None
    resumed_output: list[int] = field(default_factory=list)  # see EngineCore.add_request
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model


@dataclass
class _Reserve:
    """Reserve blocks for a remote prefill; the plan (or None: prefilled locally) goes to
    `reserved`."""

    submit: _Submit
    reserved: concurrent.futures.Future


@dataclass
class _CompleteRemote:
    request_id: str
    result: RemotePrefillResult


@dataclass
class _FallBack:
    request_id: str


@dataclass
class _Abort:
    request_id: str


@dataclass
class _SnapshotCache:
    """Every cached block hash now; events recorded before it are dropped (it supersedes
    them), so `take_kv_events` afterwards returns only later changes."""

    hashes: concurrent.futures.Future


@dataclass
class _ChangeLoRA:
    """Registers (`add`) or forgets (`remove`, by name) an adapter between two steps; the
    outcome (None / whether it was registered, or the ValueError) goes to `done`."""

    done: concurrent.futures.Future
    add: LoRARequest | None = None
    remove: str | None = None


_Command = (
    _Submit | _Reserve | _CompleteRemote | _FallBack | _Abort | _SnapshotCache | _ChangeLoRA
)


@dataclass
class _Sink:
    """Where one request's deltas go: the asyncio queue of the coroutine that reads them."""

    loop: asyncio.AbstractEventLoop
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_open: int = 1  # sequences not finished yet
    # An item `coalesce` took from the queue but could not merge (an error): read next.
    pending: StreamDelta | BaseException | None = None

    def take_pending(self) -> StreamDelta | BaseException | None:
        item, self.pending = self.pending, None
        return item

    def coalesce(self, delta: StreamDelta) -> StreamDelta:
        """`delta` merged with the deltas of its sequence already queued behind it. Reader's
        side (the event loop); for a sink of one sequence."""
        while not delta.finished and not self.deltas.empty():
            later = self.deltas.get_nowait()
            if isinstance(later, BaseException):
                self.pending = later
                break
            delta = merge_deltas(delta, later)
        return delta

    def put(self, item: StreamDelta | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.deltas.put_nowait, item)
        except RuntimeError:
            # A closed loop took its consumer with it (whose abort is queued); anything else
            # is a real error and must not be hidden.
            if not self.loop.is_closed():
                raise


class RemotePrefillReservation:
    """A decode pod's request whose prompt KV a prefill pod computes into reserved blocks.
    Used from the event loop that reserved it."""

    def __init__(
        self, llm: AsyncLLM, request_id: str, plan: RemotePrefillPlan | None, sink: _Sink
    ) -> None:
        self.request_id = request_id
        # Where the pages go; None when no blocks were free and the engine prefills it here.
        self.plan = plan
        self._llm = llm
        self._sink = sink

    def complete(self, result: RemotePrefillResult) -> None:
        """The pages and first token arrived: they go into the blocks and the request joins the
        running batch. Ignored for a request aborted meanwhile."""
        self._llm._commands.put(_CompleteRemote(self.request_id, result))

    def fall_back(self) -> None:
        """The remote prefill is not happening: the blocks are freed and the prompt is queued
        for a local prefill. Ignored for a request aborted meanwhile."""
        self._llm._commands.put(_FallBack(self.request_id))

    def deltas(self) -> AsyncIterator[StreamDelta]:
        """The request's deltas; leaving early (or being cancelled) aborts it."""
        return self._llm._stream(self._sink, self.request_id, 1)

    def abort(self) -> None:
        """Ends a reservation whose deltas will not be read (nothing happens if it ended)."""
        if self._sink.num_open:
            self._sink.num_open = 0
            self._llm.abort(self.request_id)


class AsyncLLM:
    def __init__(self, model: str | None = None, progress=None, **engine_options: object) -> None:
        self.config = EngineConfig.from_options(model, **engine_options)
        self.engine = EngineCore(self.config, progress=progress)
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # sequence id -> sink; engine thread only
        self._ids = itertools.count()
        self._stats = self.engine.stats()
        self._lora_info = self.engine.lora_info()
        # Prefix-cache events for a publisher (the Redis index); kept only once one asked
        # for them, so a pod without an index does not hoard them.
        self._kv_events: list[KVCacheEvent] = []
        self._kv_events_lock = threading.Lock()
        self._is_keeping_kv_events = False
        self._stopped = threading.Event()
        # after_current_step(): whether the engine thread is inside a step, and the event-loop
        # futures to settle when it leaves it.
        self._step_lock = threading.Lock()
        self._is_stepping = False
        self._step_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        # Set when a step failed in a way no later step recovers from (a parallel engine lost
        # a rank): a pod then stops serving, so its streams move elsewhere.
        self.engine_lost = threading.Event()
        self._thread = threading.Thread(target=self._engine_loop, name="engine", daemon=True)
        self._thread.start()

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        resumed_output: list[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Streams the deltas of all n sequences, interleaved; `delta.index` tells them apart.

        Raises ValueError before the first delta for a request the engine can never serve
        (also for a `request_id` still in use). Leaving the loop early (or being cancelled)
        aborts the request and frees its blocks. `resumed_output` (n = 1 only): the tokens a
        migrated sequence already generated elsewhere; generation continues after them.
        """
        if resumed_output and params.n != 1:
            raise ValueError(f"n must be 1 to resume a sequence, got {params.n}")
        deltas = self._submit_and_stream(
            prompt_token_ids,
            params,
            request_id,
            priority,
            resumed_output=resumed_output or [],
            lora_request=lora_request,
        )
        async for delta in deltas:
            yield delta

    async def prefill_and_export(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        export_kv_from_block: int,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> ExportedPrefill | None:
        """Prefill pods: computes the prompt (batched with everything else in flight), samples
        its first token under `params` (which should stop there: max_tokens=1) and packs the
        pages of prompt blocks `export_kv_from_block`.. for a decode pod. None when the request
        was aborted first. Raises ValueError as `generate` does; cancelling aborts it."""
        final = None
        try:
            deltas = self._submit_and_stream(
                prompt_token_ids,
                params,
                request_id,
                priority,
                export_kv_from_block,
                lora_request=lora_request,
            )
            async for delta in deltas:
                final = delta.final or final
        finally:
            pages = self.engine.take_exported_pages(request_id)
        if final is None or final.finish_reason == "abort" or pages is None:
            return None
        lora_name = lora_request.lora_name if lora_request is not None else None
        return ExportedPrefill(final, pages, lora_name)

    async def reserve_remote_prefill(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RemotePrefillReservation:
        """Decode pods: allocates the prompt's blocks (reusing this cache's prefix) for a
        prefill pod to fill. When they are not free now, the request is queued for a local
        prefill instead and the reservation's `plan` is None. Raises ValueError for a request
        the engine can never serve; n must be 1. The caller must end the reservation: read
        `deltas()` to the end, or `abort()` it."""
        self._check_running()
        self.engine.validate_request(prompt_token_ids, params, priority)
        if params.n != 1:
            raise ValueError(f"n must be 1 with a remote prefill, got {params.n}")
        await self._compile_grammar(params)
        sink = _Sink(asyncio.get_running_loop())
        reserved: concurrent.futures.Future = concurrent.futures.Future()
        submit = _Submit(
            request_id, list(prompt_token_ids), params, priority, sink, lora_request=lora_request
        )
        self._commands.put(_Reserve(submit, reserved))
        try:
            plan = await asyncio.wrap_future(reserved)
        except ValueError:
            raise  # nothing was added, so nothing of ours to abort
        except BaseException:
            self.abort(request_id)  # the caller gave up: free what may have been reserved
            raise
        return RemotePrefillReservation(self, request_id, plan, sink)

    async def _submit_and_stream(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None,
        priority: int,
        export_kv_from_block: int | None = None,
        resumed_output: list[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[StreamDelta]:
        self._check_running()
        self.engine.validate_request(prompt_token_ids, params, priority)
        await self._compile_grammar(params)
        request_id = request_id or f"req-{next(self._ids)}"
        sink = _Sink(asyncio.get_running_loop(), num_open=params.n)
        submit = _Submit(
            request_id,
            list(prompt_token_ids),
            params,
            priority,
            sink,
            export_kv_from_block,
            list(resumed_output or []),
            lora_request,
        )
        self._commands.put(submit)
        async for delta in self._stream(sink, request_id, params.n):
            yield delta

    async def _stream(self, sink: _Sink, request_id: str, n: int) -> AsyncIterator[StreamDelta]:
        """The deltas `sink` receives until all n sequences finished; leaving early aborts.
        A single sequence's deltas that queued up while the reader was busy come as one (never
        the first: its time is the request's TTFT)."""
        num_read = 0
        try:
            while sink.num_open:
                item = sink.take_pending() or await sink.deltas.get()
                if isinstance(item, BaseException):
                    sink.num_open = 0  # the engine thread has already dropped the sequences
                    raise item
                if n == 1 and num_read:
                    item = sink.coalesce(item)
                num_read += 1
                if item.finished:
                    sink.num_open -= 1
                yield item
        finally:
            if sink.num_open:
                self.abort(request_id, n)

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """A new constraint compiles in the grammar thread before the request is queued, so
        the engine thread finds it cached and never stalls the batch on it."""
        if params.structured_output is not None:
            await self.engine.grammars.compile_async(params.structured_output)

    def _check_running(self) -> None:
        if self._stopped.is_set():
            raise RuntimeError("AsyncLLM has been shut down")

    def abort(self, request_id: str, n: int = 1) -> None:
        for child_id, _ in child_sequences(request_id, SamplingParams(n=n)):
            self._commands.put(_Abort(child_id))

    def stats(self) -> EngineStats:
        """A snapshot taken by the engine thread after its latest step."""
        return self._stats

    def lora_info(self) -> LoRAInfo:
        """The adapters' state as the engine thread saw it after its latest step."""
        return self._lora_info

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Registers the adapter and reads it (EngineCore.add_lora) between two steps;
        ValueError when it cannot run here."""
        await self._change_lora(_ChangeLoRA(concurrent.futures.Future(), add=lora_request))

    async def remove_lora(self, lora_name: str) -> bool:
        """EngineCore.remove_lora between two steps: False if it was not registered,
        ValueError while a request still runs with it."""
        return await self._change_lora(_ChangeLoRA(concurrent.futures.Future(), remove=lora_name))

    async def _change_lora(self, command: _ChangeLoRA):
        self._check_running()
        self._commands.put(command)
        return await asyncio.wrap_future(command.done)

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The prefix-cache events since the last call (or snapshot), oldest first. The first
        call starts the keeping; until then events are dropped. Any thread."""
        with self._kv_events_lock:
            self._is_keeping_kv_events = True
            events, self._kv_events = self._kv_events, []
        return events

    async def snapshot_cached_blocks(self) -> dict[Tier, list[BlockHash]]:
        """Every block hash each tier of the cache holds, taken between two steps; pending
        events are dropped, so later `take_kv_events` calls continue exactly from this state."""
        hashes: concurrent.futures.Future = concurrent.futures.Future()
        with self._kv_events_lock:
            self._is_keeping_kv_events = True
        self._commands.put(_SnapshotCache(hashes))
        return await asyncio.wrap_future(hashes)

    def shutdown(self) -> None:
        """Stops the engine thread; requests still streaming end with a RuntimeError."""
        self._stopped.set()
        self._commands.put(None)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            error = RuntimeError("AsyncLLM was shut down")
            self._fail_open_requests(error)
            self._fail_queued_submits(error)
            # The disk tier's queued writes land (a warm restart finds them); the other
            # processes of a parallel engine stop.
            self.engine.close()

    # ---- the engine thread ------------------------------------------------------------------

    def _engine_loop(self) -> None:
        while not self._stopped.is_set():
            # Requests waiting for remote KV give a step nothing to do: wait for a command.
            idle = not self.engine.has_schedulable_requests()
            self._apply_commands(block=idle)
            if self._stopped.is_set():
                break
            if self.engine.has_schedulable_requests():
                self._step()
            self._stats = self.engine.stats()
            if self.engine.lora is not None:
                self._lora_info = self.engine.lora_info()
            self._keep_kv_events(self.engine.take_kv_events())

    def _keep_kv_events(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        with self._kv_events_lock:
            if self._is_keeping_kv_events:
                self._kv_events.extend(events)

    async def after_current_step(self) -> None:
        """Returns once the step the engine thread is running now has ended (at once when it
        runs none): work started then meets the next step's choices (a decode pod leaving a
        prefill pod its threads, shared/thread_tuner.py), not one made before it existed."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._step_lock:
            if not self._is_stepping:
                return
            self._step_waiters.append((loop, future))
        await future

    def _end_step_wait(self) -> None:
        with self._step_lock:
            self._is_stepping = False
            waiters, self._step_waiters = self._step_waiters, []
        for loop, future in waiters:
            loop.call_soon_threadsafe(_settle_if_pending, future)

    def _step(self) -> None:
        with self._step_lock:
            self._is_stepping = True
        try:
            self._step_and_route()
        finally:
            self._end_step_wait()

    def _step_and_route(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception as error:
            # A step that raises leaves its batch half done; failing every open request (and
            # freeing its blocks) keeps the thread, and so the server, alive for the next ones.
            logger.exception("engine step failed; failing all in-flight requests")
            self._fail_open_requests(RuntimeError(f"engine step failed: {error!r}"))
            if isinstance(error, ParallelError):
                self.engine_lost.set()
            return
        # Snapshot first: a client that sees its final delta then sees its blocks freed.
        self._stats = self.engine.stats()
        self._route(deltas)

    def _fail_open_requests(self, error: BaseException) -> None:
        sinks = {id(sink): sink for sink in self._sinks.values()}
        self.engine.abort_requests(list(self._sinks))
        self._sinks.clear()
        for sink in sinks.values():
            sink.put(error)

    def _fail_queued_submits(self, error: BaseException) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Submit):
                command.sink.put(error)
            elif isinstance(command, _Reserve):
                _settle(command.reserved, error=error)
            elif isinstance(command, _SnapshotCache):
                _settle(command.hashes, error=error)
            elif isinstance(command, _ChangeLoRA):
                _settle(command.done, error=error)

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return
        while command is not None:
            try:
                self._apply(command)
            except Exception:
                # One broken command must not end the thread: every later request of the
                # process would wait for it forever.
                logger.exception("engine command %s failed", type(command).__name__)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _SnapshotCache):
            self._snapshot_cache(command)
        elif isinstance(command, _Abort):
            self._route(self.engine.abort_requests([command.request_id]))
        elif isinstance(command, _Reserve):
            self._reserve(command)
        elif isinstance(command, _CompleteRemote):
            self._route(self.engine.complete_remote_prefill(command.request_id, command.result))
        elif isinstance(command, _FallBack):
            self.engine.fall_back_to_local_prefill(command.request_id)
        elif isinstance(command, _ChangeLoRA):
            self._change_lora_now(command)
        else:
            self._submit(command)

    def _change_lora_now(self, command: _ChangeLoRA) -> None:
        try:
            result: bool | None = None
            if command.add is not None:
                self.engine.add_lora(command.add)
            else:
                assert command.remove is not None, "a change adds or removes"
                result = self.engine.remove_lora(command.remove)
        except (ValueError, OSError) as error:  # a bad adapter, or one still in use
            _settle(command.done, error=error)
        else:
            _settle(command.done, result=result)
        self._lora_info = self.engine.lora_info()

    def _snapshot_cache(self, command: _SnapshotCache) -> None:
        self.engine.take_kv_events()
        with self._kv_events_lock:
            self._kv_events.clear()
        _settle(command.hashes, result=self.engine.cached_block_hashes())

    def _reserve(self, command: _Reserve) -> None:
        submit = command.submit
        try:
            plan = self.engine.reserve_remote_prefill(
                submit.request_id,
                submit.prompt_token_ids,
                submit.params,
                submit.priority,
                lora_request=submit.lora_request,
            )
            if plan is None:
                self.engine.add_request(
                    submit.request_id,
                    submit.prompt_token_ids,
                    submit.params,
                    submit.priority,
                    lora_request=submit.lora_request,
                )
        except ValueError as error:
            _settle(command.reserved, error=error)
            return
        self._sinks[submit.request_id] = submit.sink
        # If the caller gave up (its task was cancelled), its abort is queued behind this
        # command and frees what was just reserved.
        _settle(command.reserved, result=plan)

    def _submit(self, command: _Submit) -> None:
        added: list[str] = []
        try:
            children = child_sequences(command.request_id, command.params)
            for index, (child_id, child_params) in enumerate(children):
                self.engine.add_request(
                    child_id,
                    command.prompt_token_ids,
                    child_params,
                    command.priority,
                    index,
                    export_kv_from_block=command.export_kv_from_block,
                    resumed_output=command.resumed_output,
                    lora_request=command.lora_request,
                )
                added.append(child_id)
                self._sinks[child_id] = command.sink
        except ValueError as error:
            # Only the sequences this command added: a duplicate request_id names a request
            # that belongs to someone else and must keep running.
            self.engine.abort_requests(added)
            for child_id in added:
                del self._sinks[child_id]
            command.sink.put(error)

    def _route(self, deltas: list[StreamDelta]) -> None:
        for delta in deltas:
            sink = self._sinks.get(delta.request_id)
            if sink is None:
                continue
            if delta.finished:
                del self._sinks[delta.request_id]
            sink.put(delta)


def _settle_if_pending(future: asyncio.Future[None]) -> None:
    if not future.done():  # its waiter may have been cancelled meanwhile
        future.set_result(None)


def _settle(
    future: concurrent.futures.Future, *, result: object = None, error: BaseException | None = None
) -> None:
    """Completes a future that its coroutine may have stopped waiting for. Cancelling the
    awaiting task cancels the future too, and completing a cancelled future raises, which in
    the engine thread would end the thread; a cancelled one is passed over."""
    if not future.set_running_or_notify_cancel():
        return  # cancelled: nobody reads it
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
