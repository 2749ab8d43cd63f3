"""Pipeline parallelism: consecutive layers per rank (a stage), hidden states passed along.

    rank 0: embed, layers [0, L/pp)          --hidden [num_tokens, hidden]-->  rank 1
    rank 1: layers [L/pp, 2L/pp)             --> ... --> rank pp-1
    rank pp-1: its layers, then the sampled rows only  --hidden [num_logits, hidden]-->  rank 0
    rank 0: final norm, lm head, sampling

Each stage holds the KV of its own layers. A step's chunks are cut into up to pp micro-batches
(consecutive requests, about equal tokens), announced in one PIPELINE_STEP; rank 0 hands each
micro-batch on and starts the next at once, so stage s works on micro-batch i while stage s-1
works on i+1:

    rank 0:  | mb1 | mb2 |          head
    rank 1:        | mb1 | mb2 |

Micro-batches never share a request, so their KV writes and reads are independent. A gloo send
completes only once its receiver has posted the receive (broadcasts too: hence one header per
step, not one per micro-batch), so sends are waited for at the end, never before the next
piece of work.

With tensor parallelism inside each stage (`tp_size` > 1, shared/parallel/grid.py) the ranks
form a grid, vLLM's layout: rank = stage * tp_size + tp_rank. Every rank of a stage runs the
stage's layers on its heads; after each block's all-reduce it holds the full hidden rows, so
rank (s, t) sends them to its counterpart (s+1, t), and only (last stage, 0) sends the sampled
rows back to rank 0.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from splitserve.engine.model.architecture import ModelArchitecture
from splitserve.engine.parallel.comm import Communicator
from splitserve.engine.parallel.ops import Opcode, send
from splitserve.engine.parallel.step_tensors import ChunkInputs, pack_chunks, unpack_chunks

if TYPE_CHECKING:
    from splitserve.engine.model.llama import LlamaForCausalLM
    from splitserve.engine.runner import ModelInputs, ModelRunner

_LAYERS_DIM = 1  # of a packed page buffer [blocks, layers, 2, block_size, heads, head_dim]


def check_pipeline_parallel(pp_size: int, arch: ModelArchitecture) -> None:
    if arch.num_layers % pp_size:
        raise ValueError(
            f"pipeline_parallel_size {pp_size} must divide the model's {arch.num_layers} layers"
        )


@dataclass(frozen=True)
class PipelineLayout:
    """Rank `rank`'s stage of a model split `pp_size` ways by layers (each stage `tp_size`
    tensor-parallel ranks; `rank` counts over all of them)."""

    pp_size: int
    rank: int
    num_layers: int  # the whole model's
    tp_size: int = 1  # ranks per stage

    @property
    def world_size(self) -> int:
        return self.pp_size * self.tp_size

    @property
    def page_copies(self) -> int:
        return 1  # each stage holds its own layers' pages

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def _last_stage_first_rank(self) -> int:
        """The rank that sends the sampled rows back to rank 0."""
        return (self.pp_size - 1) * self.tp_size

    def layers_of(self, stage: int) -> range:
        per_stage = self.num_layers // self.pp_size
        return range(stage * per_stage, (stage + 1) * per_stage)

    def of_rank(self, rank: int) -> PipelineLayout:
        return dataclasses.replace(self, rank=rank)

    def local_arch(self, arch: ModelArchitecture) -> ModelArchitecture:
        layers = self.layers_of(self.stage)
        # Window layers (Mistral, Gemma) keep their windows on whichever stage holds them.
        windows = tuple(arch.layer_windows[i] for i in layers) if arch.layer_windows else ()
        return dataclasses.replace(arch, num_layers=len(layers), layer_windows=windows)

    def pod_kv_arch(self, arch: ModelArchitecture) -> ModelArchitecture:
        """Every layer's KV once, over all stages."""
        return arch

    def shard_weights(
        self, weights: dict[str, torch.Tensor], num_layers: int
    ) -> dict[str, torch.Tensor]:
        """This stage's layers, renumbered from 0; embedding, norm and head kept (the model
        code expects them; only rank 0 runs them)."""
        layers = self.layers_of(self.stage)
        out = {name: t for name, t in weights.items() if not name.startswith("model.layers.")}
        for i in layers:
            prefix = f"model.layers.{i}."
            for name, tensor in weights.items():
                if name.startswith(prefix):
                    out[f"model.layers.{i - layers.start}." + name[len(prefix) :]] = tensor
        return out

    def attach(self, model: LlamaForCausalLM, comm: Communicator) -> None:
        """Nothing to wire inside the model: the hand-offs happen between its layers and head."""

    def run_first_rank(
        self, comm: Communicator, runner: ModelRunner[LlamaForCausalLM], inputs: ModelInputs
    ) -> torch.Tensor:
        """Rank 0: the step in micro-batches (see the module docstring); the logits."""
        micro_batches = split_micro_batches(inputs.chunks, self.pp_size)
        sizes = torch.tensor([len(chunks) for chunks in micro_batches], dtype=torch.int64)
        payload = torch.cat([sizes, pack_chunks(inputs.chunks)])
        send(comm, Opcode.PIPELINE_STEP, payload, count=len(micro_batches))
        model, sent = runner.model, []
        for chunks in micro_batches:
            batch = inputs if len(micro_batches) == 1 else runner.prepare_inputs(chunks)
            hidden = model.decode_layers(
                batch.input_ids, batch.positions, runner.kv_cache, batch.meta, runner.backend
            )
            # Not waited for: this stage goes on with the next micro-batch meanwhile.
            # To the next stage's counterpart of this rank (rank 1 without tensor parallel).
            to = self.tp_size
            sent.append((Sent(comm.isend(hidden, to), hidden), batch.logits_indices.shape[0]))
        rows = []
        for send_in_flight, num_rows in sent:
            rows.append(send_in_flight.tensor.new_empty(num_rows, model.arch.hidden_size))
            comm.recv(rows[-1], self._last_stage_first_rank)
            send_in_flight.work.wait()
        return model.compute_logits(torch.cat(rows))

    def run_other_rank(
        self, comm: Communicator, runner: ModelRunner, payload: torch.Tensor, num_micro_batches: int
    ) -> None:
        """A rank other than 0: each micro-batch's hidden states from the previous stage (the
        first stage's other tensor-parallel ranks: embedded here) through this stage's layers,
        on to the next stage (the last stage: only the sampled rows, to rank 0, from its first
        rank). Its sends are waited for at the end: each completes only once the receiver
        posts its receive, which it does in micro-batch order."""
        sizes = payload[:num_micro_batches].tolist()
        chunks = unpack_chunks(payload[num_micro_batches:], sum(sizes))
        sent = []
        for start, size in zip(itertools.accumulate([0, *sizes]), sizes):
            inputs = runner.prepare_inputs(chunks[start : start + size])
            sent.append(self._run_micro_batch(comm, runner, inputs))
        for send_in_flight in sent:
            if send_in_flight is not None:
                send_in_flight.work.wait()

    def _run_micro_batch(
        self, comm: Communicator, runner: ModelRunner[LlamaForCausalLM], inputs: ModelInputs
    ) -> Sent | None:
        """This stage's layers over one micro-batch; the send to the next rank (None: a rank
        of the last stage other than its first sends nothing)."""
        model, meta, kv_cache = runner.model, inputs.meta, runner.kv_cache
        if self.stage == 0:  # a tensor-parallel peer of rank 0: it embeds as rank 0 does
            hidden = model.decode_layers(
                inputs.input_ids, inputs.positions, kv_cache, meta, runner.backend
            )
        else:
            hidden = self._receive_hidden(comm, model, inputs.input_ids)
            hidden = model.run_layers(hidden, inputs.positions, kv_cache, meta, runner.backend)
        if self.stage < self.pp_size - 1:
            return Sent(comm.isend(hidden, self.rank + self.tp_size), hidden)
        if self.rank != self._last_stage_first_rank:
            return None
        rows = hidden[inputs.logits_indices].contiguous()
        return Sent(comm.isend(rows, 0), rows)

    def _receive_hidden(
        self, comm: Communicator, model: LlamaForCausalLM, input_ids: torch.Tensor
    ) -> torch.Tensor:
        """The previous stage's hidden states [num_tokens, hidden], from this rank's
        counterpart there."""
        hidden = torch.empty(
            input_ids.shape[0],
            model.arch.hidden_size,
            dtype=model.norm.weight.dtype,  # the model's dtype (materialize casts every weight)
            device=input_ids.device,
        )
        comm.recv(hidden, self.rank - self.tp_size)
        return hidden

    # ---- pages in the wire layout (shared/parallel/pages.py) --------------------------------

    def wire_shape(self, kv_cache: torch.Tensor, num_blocks: int) -> tuple[int, ...]:
        _, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        return (num_blocks, self.num_layers, 2, block_size, num_kv_heads, head_dim)

    def split_pages(self, pages: torch.Tensor) -> list[torch.Tensor]:
        return [
            pages[:, layers.start : layers.stop].contiguous()
            for layers in map(self.layers_of, range(self.pp_size))
        ]

    def join_pages(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts, dim=_LAYERS_DIM)


class Sent(NamedTuple):
    """A send in flight and the tensor it reads (kept alive until it completes)."""

    work: dist.Work
    tensor: torch.Tensor


def split_micro_batches(
    chunks: Sequence[ChunkInputs], num_stages: int
) -> list[list[ChunkInputs]]:
    """min(num_stages, len(chunks)) consecutive runs of `chunks`, cut where the running token
    count passes each equal share (each run keeps the runner's order, decodes first). A chunk
    is never split: a lone prefill chunk is one micro-batch."""
    num_batches = min(num_stages, len(chunks))
    total = sum(chunk.num_tokens for chunk in chunks)
    batches: list[list[ChunkInputs]] = [[]]
    done = 0  # tokens in the runs so far
    for i, chunk in enumerate(chunks):
        batches[-1].append(chunk)
        done += chunk.num_tokens
        runs_left, chunks_left = num_batches - len(batches), len(chunks) - i - 1
        passed_share = done * num_batches >= total * len(batches)
        if runs_left and chunks_left and (passed_share or chunks_left == runs_left):
            batches.append([])
    return batches
