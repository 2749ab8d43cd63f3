"""Grammar state per sequence, and the token masks of one engine step.

    compiler = GrammarCompiler(tokenizer.to_json, vocab_size, eos_token_ids)
    request.grammar = compiler.new_sequence(params.structured_output)   # at admission
    masks = compiler.start_step(sched)    # computed in a worker thread while the forward runs
    masks.allowed(request_id, j)          # bool [vocab] for the j-th logits row of a request

A sequence's matcher catches up with the request's output tokens at the start of each step, so
every way tokens arrive (sampled here, verified drafts, a prefill pod's first token, a replay
after preemption) goes through one place. Draft tokens are consumed while the masks of a
verification chunk are computed and rolled back afterwards; a draft the grammar refuses gets
probability 0 under its mask, so the verification rejects it exactly as it would any other.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence

import llguidance
import torch

from splitserve.engine.step import SchedulerOutput
from splitserve.engine.structured_output.grammar import GrammarError, grammar_for
from splitserve.engine.structured_output.spec import StructuredOutput

logger = logging.getLogger(__name__)

_BITS = torch.arange(32, dtype=torch.int32)


class SequenceGrammar:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self._eos_token_ids = tuple(eos_token_ids)
        self.num_consumed = 0
        self.has_failed = False

    def catch_up(self, output_token_ids: Sequence[int]) -> None:
        """Consumes the output tokens not seen yet. A token the grammar refuses (one this engine
        sampled under the mask never is; one from elsewhere can be) ends the sequence: from
        then on only EOS is allowed."""
        new = output_token_ids[self.num_consumed :]
        self.num_consumed = len(output_token_ids)
        if not new or self.has_failed:
            return
        if self._matcher.try_consume_tokens(list(new)) < len(new):
            self.has_failed = True
            logger.warning("output left its grammar; only EOS is allowed now")

    def fill_masks(self, draft_token_ids: Sequence[int], bitmask: torch.Tensor) -> None:
        """Row j of `bitmask` [len(drafts) + 1, words] gets the tokens allowed after the first
        j drafts. Rows after a draft the grammar refuses are never reached by the verification
        (that draft is rejected), so they are left allowing only EOS."""
        num_consumed = 0
        for j in range(len(draft_token_ids) + 1):
            if self.has_failed or j > num_consumed:
                self._eos_only(bitmask[j])
                continue
            row = bitmask[j]
            self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            if j < len(draft_token_ids) and self._matcher.try_consume_tokens(
                [draft_token_ids[j]]
            ):
                num_consumed += 1
        if num_consumed:
            self._matcher.rollback(num_consumed)

    def _eos_only(self, row: torch.Tensor) -> None:
        row.zero_()
        for token_id in self._eos_token_ids:
            row[token_id // 32] |= _bit(token_id % 32)


def _bit(position: int) -> int:
    """The int32 value with only `position` set (bit 31 is the sign bit)."""
    return -(2**31) if position == 31 else 1 << position


class StepMasks:
    """The allowed tokens of one step's constrained logits rows, filled by a worker thread;
    the first `allowed` call waits for it."""

    def __init__(
        self,
        rows: dict[tuple[str, int], int],
        bitmask: torch.Tensor,
        done: concurrent.futures.Future | None,
        vocab_size: int,
    ) -> None:
        self._rows = rows  # (request id, logits row of that request) -> bitmask row
        self._bitmask = bitmask
        self._done = done
        self._vocab_size = vocab_size
        self._allowed: torch.Tensor | None = None

    def allowed(self, request_id: str, row: int = 0) -> torch.Tensor | None:
        """bool [vocab] of the tokens the grammar allows there; None for a free row."""
        index = self._rows.get((request_id, row))
        if index is None:
            return None
        return self._unpacked()[index]

    def wait(self) -> None:
        if self._done is not None:
            self._done.result()

    def _unpacked(self) -> torch.Tensor:
        if self._allowed is None:
            self.wait()
            bits = (self._bitmask.unsqueeze(-1) >> _BITS) & 1  # [rows, words, 32]
            self._allowed = bits.flatten(1)[:, : self._vocab_size].bool()
        return self._allowed


NO_MASKS = StepMasks({}, torch.empty(0, 0, dtype=torch.int32), None, 0)


class GrammarCompiler:
    """Compiles constraints for one tokenizer. The tokenizer's llguidance view is built on the
    first constraint, as vLLM builds its grammar backend: it holds about 36 MiB for a 49k
    vocabulary, which a pod that never sees a constraint should not keep resident (issue 33's
    memory target). Each distinct constraint's start state is cached (LRU) and copied per
    sequence, so a schema many requests share costs its compile once."""

    def __init__(
        self,
        tokenizer_json: Callable[[], str],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = 256,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(1, "grammar-compile")
        self._mask_pool = concurrent.futures.ThreadPoolExecutor(1, "grammar-mask")
        self._tokenizer_json = tokenizer_json
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()  # one build, whichever thread asks first
        self._cache: collections.OrderedDict[StructuredOutput, llguidance.LLMatcher] = (
            collections.OrderedDict()
        )
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                started = time.perf_counter()
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json(),
                    n_vocab=self.vocab_size,
                    eos_token=list(self.eos_token_ids),
                )
                logger.info(
                    "built the grammar tokenizer for the first constraint in %.2f s",
                    time.perf_counter() - started,
                )
            return self._tokenizer

    # ---- compiling --------------------------------------------------------------------------

    def compile(self, output: StructuredOutput) -> llguidance.LLMatcher:
        """The start state of `output` (cached). Raises GrammarError. Any thread."""
        with self._lock:
            cached = self._cache.get(output)
            if cached is not None:
                self._cache.move_to_end(output)
                return cached
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar_for(output), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"structured_output {output.kind} is invalid: {matcher.get_error()}")
        with self._lock:
            self._cache[output] = matcher
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher

    async def compile_async(self, output: StructuredOutput) -> None:
        """Compiles in the compile thread, so neither the event loop nor the engine thread
        waits on a new schema. Raises GrammarError."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._compile_pool, self.compile, output)

    def new_sequence(self, output: StructuredOutput) -> SequenceGrammar:
        return SequenceGrammar(self.compile(output).deep_copy(), self.eos_token_ids)

    # ---- one step ---------------------------------------------------------------------------

    def start_step(self, sched: SchedulerOutput) -> StepMasks:
        """Starts computing the masks of every constrained row `sched` samples, in the mask
        thread; the caller runs the forward meanwhile."""
        work = []
        rows: dict[tuple[str, int], int] = {}
        for chunk in sched.chunks:
            grammar = chunk.request.grammar
            if grammar is None or not chunk.num_logits:
                continue
            work.append((chunk.request, grammar, chunk.draft_token_ids, len(rows)))
            for j in range(chunk.num_logits):
                rows[(chunk.request.request_id, j)] = len(rows)
        if not work:
            return NO_MASKS
        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
        done = self._mask_pool.submit(_fill_masks, work, bitmask)
        return StepMasks(rows, bitmask, done, self.vocab_size)

    def shutdown(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._mask_pool.shutdown(wait=False, cancel_futures=True)


def _fill_masks(work: list, bitmask: torch.Tensor) -> None:
    for request, grammar, drafts, first_row in work:
        grammar.catch_up(request.output_token_ids)
        grammar.fill_masks(drafts, bitmask[first_row : first_row + len(drafts) + 1])
