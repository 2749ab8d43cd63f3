"""Ranks 1..tp-1 of a tensor-parallel engine: a process that runs rank 0's steps on its slice.

    rank 0 (the engine)                      rank r (this module)
    scheduler.schedule()
    broadcast header, payload      ----->    unpack chunks, prepare_inputs (same code)
    forward over its slice         <---->    forward over its slice (all-reduce x2 per layer)
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

from shared.config import EngineConfig
from shared.model.kv_cache import KVCacheSpec, allocate_kv_cache
from shared.model.llama import LlamaForCausalLM
from shared.model.loader import load_checkpoint
from shared.parallel.comm import Communicator, connect_store
from shared.parallel.layout import TensorParallelLayout
from shared.parallel.ops import Opcode, receive_header, run_page_op
from shared.parallel.step_tensors import unpack_chunks
from shared.runner import ModelRunner

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 1.0


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to start: pickled once, at spawn."""

    rank: int
    tp_size: int
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
    store = connect_store(spec.port, spec.tp_size, spec.start_timeout_s)
    model, kv_cache, block_size = _build(spec)
    store.set(f"loaded/{spec.rank}", "1")
    comm = Communicator(store, spec.rank, spec.tp_size, spec.timeout_s)
    model.set_tensor_parallel(comm)
    runner = ModelRunner(model, kv_cache, block_size, eos_token_ids=())
    try:
        _serve(comm, runner)
    except RuntimeError as exc:  # rank 0 went away mid-collective: nothing left to serve
        logger.warning("tensor-parallel rank %d stops: %s", spec.rank, exc)


def _build(spec: WorkerSpec) -> tuple[LlamaForCausalLM, torch.Tensor, int]:
    config = spec.config
    checkpoint = load_checkpoint(config.model.model)
    arch = checkpoint.architecture
    layout = TensorParallelLayout.of(arch, spec.tp_size, spec.rank)
    local_arch = layout.local_arch(arch)
    device, dtype = torch.device(config.model.device), getattr(torch, config.model.dtype)
    model = LlamaForCausalLM(local_arch, spec.max_model_len, device)
    model.materialize(device, dtype)
    model.load_hf_weights(layout.shard_weights(checkpoint.weights, arch.num_layers))
    del checkpoint
    block_size = config.cache.block_size
    # Only the block count matters for allocation; rank 0 sized it for the whole pod.
    kv_spec = KVCacheSpec(spec.num_blocks, block_size, bytes_per_block=0)
    return model, allocate_kv_cache(kv_spec, local_arch, dtype, device), block_size


def _serve(comm: Communicator, runner: ModelRunner) -> None:
    model = runner.model
    while True:
        header, payload = receive_header(comm)
        if header.opcode == Opcode.STOP:
            return
        if header.opcode == Opcode.STEP:
            inputs = runner.prepare_inputs(unpack_chunks(payload, header.count))
            model.decode_layers(
                inputs.input_ids, inputs.positions, runner.kv_cache, inputs.meta, runner.backend
            )
        else:
            run_page_op(comm, header, payload, runner.kv_cache)


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(0)

    if os.getppid() != parent_pid:
        os._exit(0)  # the engine died before this rank started
    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()
