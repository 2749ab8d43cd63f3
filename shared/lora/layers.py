"""LoRA on the model's projections: a forward hook on each fused projection adds the step's
per-row deltas to its output (shared/lora/batched.py). Hooks leave the layers as they are, so
dense, quantized and biased projections all take one, and a step without adapter rows runs
exactly the base model. The fused C++ decode holds the same slot tensors (build_lora hands
them over) and adds the same deltas inside its layer loop, so decode steps with adapter rows
stay there; on CUDA the hooks run the Triton SGMV kernels (batched.py's uses_sgmv).

Our projections fuse PEFT's: qkv_proj holds q/k/v_proj's rows, gate_up_proj gate/up_proj's.
Each hook keeps, per slot, the A of every slice stacked ([max_loras, slices, rank, in]) and one
B per slice ([max_loras, rank, out_s], transposed so that a slot's rows are contiguous).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from splitserve.engine.lora.batched import LoRABatch, add_lora_delta, add_lora_delta_sgmv
from splitserve.engine.lora.peft_format import LoRAWeights


@dataclass
class LoRAState:
    """The batch of the forward in progress; None outside one or when no row has an adapter.
    Set and cleared by the runner around each forward (one thread drives the engine)."""

    batch: LoRABatch | None = None


@dataclass(frozen=True)
class ProjectionLayout:
    """Which PEFT modules a fused projection holds, in its output order."""

    attribute: str  # the projection's attribute on its parent (self_attn or mlp)
    slice_names: tuple[str, ...]  # PEFT module names
    slice_sizes: tuple[int, ...]  # their output features


class LoRAHook:
    """The forward hook of one projection of one layer: the slots' weights for it."""

    def __init__(
        self,
        layer: int,
        layout: ProjectionLayout,
        in_features: int,
        max_loras: int,
        rank: int,
        state: LoRAState,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layer = layer
        self.layout = layout
        self.state = state
        num_slices = len(layout.slice_sizes)
        self.a = torch.zeros(max_loras, num_slices, rank, in_features, dtype=dtype, device=device)
        self.b = [
            torch.zeros(max_loras, rank, size, dtype=dtype, device=device)
            for size in layout.slice_sizes
        ]
        self.offsets = [sum(layout.slice_sizes[:i]) for i in range(num_slices)]

    def __call__(self, module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        batch = self.state.batch
        if batch is not None:
            (x,) = inputs
            add = add_lora_delta if batch.segments is None else add_lora_delta_sgmv
            add(out, x.reshape(-1, x.shape[-1]), self.a, self.b, self.offsets, batch)
        return out

    def check(self, weights: LoRAWeights, source: str) -> None:
        """ValueError when one of the adapter's modules for this projection does not fit it."""
        for s, name in enumerate(self.layout.slice_names):
            module = weights.modules.get((self.layer, name))
            if module is None:
                continue
            if module.a.shape[1] != self.a.shape[3] or module.b.shape[0] != self.b[s].shape[2]:
                raise ValueError(
                    f"LoRA adapter {source!r}: layer {self.layer} {name} has lora_A "
                    f"{tuple(module.a.shape)} and lora_B {tuple(module.b.shape)}, which do not "
                    f"fit the model's [{self.b[s].shape[2]}, {self.a.shape[3]}] projection"
                )

    def write_slot(self, slot: int, weights: LoRAWeights) -> None:
        """Copies the adapter's modules for this projection into `slot` (zeros for a module
        it does not adapt); `check` passed."""
        self.a[slot].zero_()
        for s, name in enumerate(self.layout.slice_names):
            self.b[s][slot].zero_()
            module = weights.modules.get((self.layer, name))
            if module is not None:
                rank = module.a.shape[0]
                self.a[slot, s, :rank] = module.a
                self.b[s][slot, :rank] = module.b.T


@dataclass
class LoRAModel:
    """The hooks attached to a model, by (layer, PEFT module name) of each slice."""

    state: LoRAState
    hooks: list[LoRAHook] = field(default_factory=list)

    def supported_modules(self) -> set[tuple[int, str]]:
        return {(hook.layer, name) for hook in self.hooks for name in hook.layout.slice_names}

    def check(self, weights: LoRAWeights, source: str) -> None:
        """ValueError when the adapter adapts a module this model has no hook for, or one
        whose shape does not fit."""
        unsupported = set(weights.modules) - self.supported_modules()
        if unsupported:
            layer, name = min(unsupported)
            raise ValueError(
                f"LoRA adapter {source!r} adapts layer {layer} {name}, which this model has no "
                "LoRA-capable projection for (a mixture-of-experts MLP, say)"
            )
        for hook in self.hooks:
            hook.check(weights, source)

    def write_slot(self, slot: int, weights: LoRAWeights) -> None:
        for hook in self.hooks:
            hook.write_slot(slot, weights)


def attach_lora(
    layers: Sequence[nn.Module],
    arch_sizes: dict[str, int],
    max_loras: int,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LoRAModel:
    """Hooks every dense projection of `layers` (decoder layers with `self_attn` and `mlp`).
    `arch_sizes`: hidden, q, kv and intermediate feature counts."""
    layouts = {
        "self_attn": [
            ProjectionLayout(
                "qkv_proj",
                ("q_proj", "k_proj", "v_proj"),
                (arch_sizes["q"], arch_sizes["kv"], arch_sizes["kv"]),
            ),
            ProjectionLayout("o_proj", ("o_proj",), (arch_sizes["hidden"],)),
        ],
        "mlp": [
            ProjectionLayout(
                "gate_up_proj",
                ("gate_proj", "up_proj"),
                (arch_sizes["intermediate"], arch_sizes["intermediate"]),
            ),
            ProjectionLayout("down_proj", ("down_proj",), (arch_sizes["hidden"],)),
        ],
    }
    in_features = {
        "qkv_proj": arch_sizes["hidden"],
        "o_proj": arch_sizes["q"],
        "gate_up_proj": arch_sizes["hidden"],
        "down_proj": arch_sizes["intermediate"],
    }
    lora = LoRAModel(LoRAState())
    for index, layer in enumerate(layers):
        for parent_name, parent_layouts in layouts.items():
            parent = getattr(layer, parent_name)
            for layout in parent_layouts:
                projection = getattr(parent, layout.attribute, None)
                if not isinstance(projection, nn.Module):
                    continue  # a mixture-of-experts block has no gate_up_proj
                hook = LoRAHook(
                    index,
                    layout,
                    in_features[layout.attribute],
                    max_loras,
                    rank,
                    lora.state,
                    dtype,
                    device,
                )
                projection.register_forward_hook(hook)
                lora.hooks.append(hook)
    return lora
