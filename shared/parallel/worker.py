"""Ranks 1..n-1 of a parallel engine: a process that runs rank 0's steps on its part.

    rank 0 (the engine)                      rank r (this module)
    scheduler.schedule()
    broadcast header, payload      ----->    unpack chunks, prepare_inputs (same code)
    forward over its part          <---->    forward over its part (tensor parallel: all-reduce
                                             x2 per layer; pipeline: hidden states in and out;
                                             both: the all-reduces inside the rank's stage)
    lm head, sampling                        wait for the next header

It never schedules, samples or sees a request: only token ids, positions and block ids. It
exits on the STOP opcode, when rank 0's sockets close (the engine died), or when its parent
process is gone (polled: PR_SET_PDEATHSIG fires on the death of the *thread* that started the
process, and engines are built on worker threads of the pods' event loops).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.gc_heap import freeze_startup_heap
from splitserve.engine.model.loader import load_checkpoint
from splitserve.engine.parallel.comm import Communicator, connect_store
from splitserve.engine.parallel.ops import Opcode, receive_header
from splitserve.engine.parallel.pages import run_page_op
from splitserve.engine.parallel.rank import RankLayout, build_rank, layout_for
from splitserve.engine.runner import ModelRunner

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 1.0


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to start: pickled once, at spawn."""

    rank: int
    world_size: int
    port: int
    config: EngineConfig
    num_blocks: int
    max_model_len: int
    parent_pid: int
    timeout_s: float  # of each collective
    start_timeout_s: float  # of joining rank 0's store
    num_threads: int


def run_worker(spec: WorkerSpec) -> None:
    """The process entry point (torch.multiprocessing spawn target)."""
    _exit_with_parent(spec.parent_pid)
    torch.set_num_threads(spec.num_threads)
    store = connect_store(spec.port, spec.world_size, spec.start_timeout_s)
    checkpoint = load_checkpoint(spec.config.model.model)
    layout = layout_for(spec.config, checkpoint.architecture, spec.rank)
    model, kv_cache = build_rank(
        layout,
        checkpoint.architecture,
        checkpoint.weights,
        spec.config,
        spec.max_model_len,
        spec.num_blocks,
    )
    del checkpoint
    # Before announcing readiness: the runner's attention backend may compile the CPU kernel
    # first (minutes on a busy machine), longer than a step's collectives wait.
    runner = ModelRunner(model, kv_cache, spec.config.cache.block_size, eos_token_ids=())
    store.set(f"loaded/{spec.rank}", "1")
    comm = Communicator(store, spec.rank, spec.world_size, spec.timeout_s)
    layout.attach(model, comm)
    # As rank 0's pod does: a full collection over the loaded rank would stall every rank's
    # collectives of the step it falls in.
    freeze_startup_heap()
    try:
        _serve(comm, runner, layout)
    except RuntimeError as exc:  # rank 0 went away mid-collective: nothing left to serve
        logger.warning("parallel engine rank %d stops: %s", spec.rank, exc)


@torch.inference_mode()
def _serve(comm: Communicator, runner: ModelRunner, layout: RankLayout) -> None:
    while True:
        header, payload = receive_header(comm)
        if header.opcode == Opcode.STOP:
            return
        if header.opcode in (Opcode.STEP, Opcode.PIPELINE_STEP):
            layout.run_other_rank(comm, runner, payload, header.count)
        else:
            run_page_op(comm, header, payload, runner.kv_cache)


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(0)

    if os.getppid() != parent_pid:
        os._exit(0)  # the engine died before this rank started
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
