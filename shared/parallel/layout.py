"""Which part of the model each tensor-parallel rank holds (Megatron-style splits).

    rank r of tp:  query heads [r * H/tp, (r+1) * H/tp)
                   KV heads    [r * K/tp, (r+1) * K/tp)       when K >= tp
                   KV head     r // (tp/K), replicated         when K < tp (GQA)
                   gate/up rows and down columns [r * I/tp, (r+1) * I/tp)
                   MoE layers: a range of experts, or a slice of each (moe_shard.py)

With fewer KV heads than ranks, each KV head is held by tp/K ranks: exactly the ranks whose
query heads read it, so every rank attends locally and never needs another rank's KV.

MLA (DeepSeek) splits its query heads the same way (q_proj or q_b_proj, kv_b_proj's rows and
o_proj's columns per head); the latent projection, its norm and the latent pages are whole on
every rank, as vLLM keeps them: each rank writes the same rows, and its heads read them. So a
rank's pages are the pod's pages: they leave from rank 0's copy and reach every rank whole.

qkv and gate/up are column-parallel (each rank computes its own output columns from the full
hidden state); o_proj and down are row-parallel (each rank's partial product over its input
slice, summed by one all-reduce per block half).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from splitserve.engine.model.architecture import MLAConfig, ModelArchitecture
from splitserve.engine.model.moe_layer import moe_blocks
from splitserve.engine.parallel.expert_parallel import ExpertAllToAll
from splitserve.engine.parallel.moe_shard import MoeShard, check_moe_parallel, expert_dispatch
from splitserve.engine.parallel.ops import Opcode, send
from splitserve.engine.parallel.step_tensors import pack_chunks, unpack_chunks

if TYPE_CHECKING:
    from splitserve.engine.model.llama import LlamaForCausalLM
    from splitserve.engine.parallel.comm import Communicator
    from splitserve.engine.runner import ModelInputs, ModelRunner

_HEADS_DIM = 4  # of a packed page buffer [blocks, layers, 2, block_size, heads, head_dim]

logger = logging.getLogger(__name__)


def check_tensor_parallel(
    tp_size: int, arch: ModelArchitecture, device: str, expert_parallel: bool = False
) -> None:
    """Raises ValueError naming the numbers when `tp_size` cannot split `arch` (its experts,
    by range with `expert_parallel`), or for a device the ranks cannot share (`check_devices`).
    """
    if arch.num_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} must divide the model's {arch.num_heads} "
            "attention heads"
        )
    kv = arch.num_kv_heads
    if arch.mla is None and ((kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv)):
        raise ValueError(
            f"tensor_parallel_size {tp_size} must divide the model's {kv} KV heads or be a "
            "multiple of them (then KV heads are replicated)"
        )
    if arch.moe is not None:
        check_moe_parallel(tp_size, arch.moe, expert_parallel)
    if _has_dense_mlp(arch) and arch.intermediate_size % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} must divide the model's MLP intermediate size "
            f"{arch.intermediate_size}"
        )
    check_devices("tensor_parallel_size", tp_size, device)


def check_devices(name: str, size: int, device: str) -> None:
    """Raises ValueError for a device the ranks cannot share out yet (CUDA: every rank would
    use the same GPU, over gloo; NCCL with a GPU per rank is not wired). A CPU may run more
    ranks than cores (slower, still correct): logged."""
    if size == 1:
        return
    if not device.startswith("cpu"):
        raise ValueError(
            f"{name} {size} runs on device 'cpu' only so far (gloo between processes), "
            f"got device {device!r}"
        )
    num_cores = os.cpu_count() or 1
    if size > num_cores:
        logger.warning("%s %d exceeds the %d CPU cores: ranks share cores", name, size, num_cores)


@dataclass(frozen=True)
class TensorParallelLayout:
    """Rank `rank`'s share of a model split `tp_size` ways (see the module docstring)."""

    tp_size: int
    rank: int
    num_heads: int  # the whole model's
    num_kv_heads: int  # the whole model's
    head_dim: int
    intermediate_size: int  # the whole model's
    moe: MoeShard | None = None  # MoE layers' split; None for a dense model
    mla: MLAConfig | None = None  # MLA's sizes; its latent pages are whole on every rank
    dense_mlp: bool = True  # some layer has a dense MLP (intermediate_size split by rank)

    @classmethod
    def of(
        cls, arch: ModelArchitecture, tp_size: int, rank: int, expert_parallel: bool = False
    ) -> TensorParallelLayout:
        moe = None
        if arch.moe is not None:
            dispatch = expert_dispatch()  # a bad value fails here, before any rank starts
            moe = MoeShard(tp_size, rank, expert_parallel, arch.family, arch.moe, dispatch)
        return cls(
            tp_size,
            rank,
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
            arch.intermediate_size,
            moe,
            mla=arch.mla,
            dense_mlp=_has_dense_mlp(arch),
        )

    @property
    def world_size(self) -> int:
        return self.tp_size

    @property
    def page_copies(self) -> int:
        """Every rank holds MLA's latent pages whole; other pages are split by KV heads."""
        return self.tp_size if self.mla is not None else 1

    def of_rank(self, rank: int) -> TensorParallelLayout:
        moe = None if self.moe is None else dataclasses.replace(self.moe, rank=rank)
        return dataclasses.replace(self, rank=rank, moe=moe)

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    def kv_heads_of(self, rank: int) -> range:
        """The model's KV head indices that `rank` holds (its pages' heads, in order)."""
        if self.num_kv_heads >= self.tp_size:
            per_rank = self.kv_heads_per_rank
            return range(rank * per_rank, (rank + 1) * per_rank)
        replicas = self.tp_size // self.num_kv_heads
        return range(rank // replicas, rank // replicas + 1)

    @property
    def kv_heads(self) -> range:
        return self.kv_heads_of(self.rank)

    @property
    def query_heads(self) -> range:
        per_rank = self.heads_per_rank
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @property
    def mlp_columns(self) -> slice:
        per_rank = self.intermediate_size // self.tp_size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def local_arch(self, arch: ModelArchitecture) -> ModelArchitecture:
        """The architecture of this rank's slice: the model code builds it unchanged."""
        local = dataclasses.replace(
            arch, num_heads=self.heads_per_rank, num_kv_heads=self.kv_heads_per_rank
        )
        if self.moe is not None:
            local = dataclasses.replace(local, moe=self.moe.local_moe())
        if not self.dense_mlp:  # every layer sparse: intermediate_size is not used
            return local
        return dataclasses.replace(local, intermediate_size=self.intermediate_size // self.tp_size)

    def pod_kv_arch(self, arch: ModelArchitecture) -> ModelArchitecture:
        """What the pod's KV budget is sized for: every rank's heads (replicas each time)."""
        return dataclasses.replace(arch, num_kv_heads=self.kv_heads_per_rank * self.tp_size)

    def shard_weights(
        self, weights: dict[str, torch.Tensor], num_layers: int
    ) -> dict[str, torch.Tensor]:
        """This rank's slices of HF-named weights (views; the model copies them in)."""
        out = dict(weights)
        for i in range(num_layers):
            attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            if self.mla is not None:
                self._shard_latent_attention(out, attn)
            else:
                self._shard_attention(out, attn)
            if self.moe is not None and self.moe.moe.is_sparse(i):
                self.moe.shard_layer(out, i)
                continue
            for name in ("gate_proj.weight", "up_proj.weight"):
                out[mlp + name] = weights[mlp + name][self.mlp_columns]
            out[mlp + "down_proj.weight"] = weights[mlp + "down_proj.weight"][:, self.mlp_columns]
        return out

    def _shard_attention(self, out: dict[str, torch.Tensor], attn: str) -> None:
        """This rank's query heads and KV heads of one layer's q/k/v and o_proj, in `out`."""
        q_rows = _rows(self.query_heads, self.head_dim)
        kv_rows = _rows(self.kv_heads, self.head_dim)
        out[attn + "q_proj.weight"] = out[attn + "q_proj.weight"][q_rows]
        out[attn + "k_proj.weight"] = out[attn + "k_proj.weight"][kv_rows]
        out[attn + "v_proj.weight"] = out[attn + "v_proj.weight"][kv_rows]
        out[attn + "o_proj.weight"] = out[attn + "o_proj.weight"][:, q_rows]
        if attn + "q_proj.bias" in out:  # Qwen2's q/k/v biases: the heads' entries
            out[attn + "q_proj.bias"] = out[attn + "q_proj.bias"][q_rows]
            out[attn + "k_proj.bias"] = out[attn + "k_proj.bias"][kv_rows]
            out[attn + "v_proj.bias"] = out[attn + "v_proj.bias"][kv_rows]

    def _shard_latent_attention(self, out: dict[str, torch.Tensor], attn: str) -> None:
        """This rank's query heads of one MLA layer: the rows of q (q_proj, or q_b_proj after
        the whole q_a_proj), of kv_b_proj (each head's k_nope and v from the latent) and the
        columns of o_proj; kv_a_proj_with_mqa and the norms stay whole."""
        mla = self.mla
        assert mla is not None, "MLA layers only"
        query = "q_proj.weight" if attn + "q_proj.weight" in out else "q_b_proj.weight"
        q_rows = _rows(self.query_heads, mla.qk_head_dim)
        out[attn + query] = out[attn + query][q_rows]
        kv_b_rows = _rows(self.query_heads, mla.qk_nope_head_dim + mla.v_head_dim)
        out[attn + "kv_b_proj.weight"] = out[attn + "kv_b_proj.weight"][kv_b_rows]
        o_columns = _rows(self.query_heads, mla.v_head_dim)
        out[attn + "o_proj.weight"] = out[attn + "o_proj.weight"][:, o_columns]

    def attach(self, model: LlamaForCausalLM, comm: Communicator) -> None:
        model.set_tensor_parallel(comm)
        # all_reduce dispatch: nothing to add, each rank's experts compute their share of
        # every row and the block's all-reduce sums the shares.
        if self.moe is not None and self.moe.uses_all_to_all:
            dispatch = ExpertAllToAll(comm, self.moe.moe.num_experts)
            for block in moe_blocks(model):
                block.expert_parallel = dispatch

    def run_first_rank(
        self, comm: Communicator, runner: ModelRunner, inputs: ModelInputs
    ) -> torch.Tensor:
        """Rank 0: the step to the other ranks, then its slice, the head and the logits."""
        send(comm, Opcode.STEP, pack_chunks(inputs.chunks), count=len(inputs.chunks))
        return runner.forward_local(inputs)

    def run_other_rank(
        self,
        comm: Communicator,
        runner: ModelRunner[LlamaForCausalLM],
        payload: torch.Tensor,
        num_chunks: int,
    ) -> None:
        """A rank other than 0: its slice of the layers (the all-reduces inside); no head."""
        inputs = runner.prepare_inputs(unpack_chunks(payload, num_chunks))
        runner.model.decode_layers(
            inputs.input_ids, inputs.positions, runner.kv_cache, inputs.meta, runner.backend
        )

    # ---- pages in the wire layout (shared/parallel/pages.py) --------------------------------

    def wire_shape(self, kv_cache: torch.Tensor, num_blocks: int) -> tuple[int, ...]:
        """The model's KV heads, not this rank's (MLA: the rank's latent pages are the model's)."""
        num_layers, num_parts, _, block_size, num_heads, row = kv_cache.shape
        if self.mla is not None:
            return (num_blocks, num_layers, num_parts, block_size, num_heads, row)
        return (num_blocks, num_layers, 2, block_size, self.num_kv_heads, row)

    def split_pages(self, pages: torch.Tensor) -> list[torch.Tensor]:
        """Wire-layout pages -> each rank's heads (contiguous, replicas included), rank order;
        MLA: the whole pages to every rank."""
        if self.mla is not None:
            return [pages.contiguous()] * self.tp_size
        return [
            pages[..., heads.start : heads.stop, :].contiguous()
            for heads in map(self.kv_heads_of, range(self.tp_size))
        ]

    def join_pages(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Each rank's packed pages -> wire layout (a replicated head is taken once). MLA's
        pages never come here: rank 0 packs its own copy (ParallelPages, page_copies)."""
        shape = list(parts[0].shape)
        shape[_HEADS_DIM] = self.num_kv_heads
        pages = torch.empty(shape, dtype=parts[0].dtype, device=parts[0].device)
        for rank, part in enumerate(parts):
            heads = self.kv_heads_of(rank)
            pages[..., heads.start : heads.stop, :] = part
        return pages


def _has_dense_mlp(arch: ModelArchitecture) -> bool:
    """Whether some layer has a dense MLP (every layer of a dense model; DeepSeek's first
    layers and those off its sparse step)."""
    return any(not arch.is_sparse_layer(layer) for layer in range(arch.num_layers))


def _rows(heads: range, head_dim: int) -> slice:
    """The rows of a [heads * head_dim, ...] projection that `heads` (consecutive) own."""
    return slice(heads.start * head_dim, heads.stop * head_dim)
