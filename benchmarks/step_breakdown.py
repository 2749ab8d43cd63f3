"""Where a decode step's time goes, at batch 1, 2, 4, 8 and 16, beside the floor it aims at.

    python -m benchmarks.step_breakdown [--batches 1 2 4 8 16] [--steps 40] [--threads 2]
                                        [--kv-cache-dtype auto|int8] [--model PATH]

For each batch size, that many requests with different ~128-token prompts are prefilled, then
`--steps` decode steps are timed. Each engine part is timed by wrapping its entry point in this
process only (the engine has no timers of its own): the layers' matrix products, attention,
the KV write, the rest of the forward (embedding, norms, rotary, activations, the vocabulary
projection), input preparation, sampling, the scheduler, and output processing (incremental
detokenization, stop strings). A float32 cache is written by the rotary kernel
(shared/model/layer_ops.py), so its KV write counts in forward_rest. The engine serves
decode-only steps through the fused C++ layer loop, which no wrapper sees into: its whole step
is timed separately (fused_total). The peer figure is the floor: one read of the weights a
decode step multiplies by, at the read bandwidth measured in this process.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.model.linear import Linear

PARTS = (
    "matmul",
    "attention",
    "kv_write",
    "forward_rest",
    "prepare",
    "sampling",
    "schedule",
    "update",
    "output",
    "other",
)


@dataclass
class StageClock:
    """Seconds spent in each wrapped part since the last `reset`."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def wrap(self, part: str, function: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        return timed

    def reset(self) -> None:
        self.seconds.clear()


def instrument(llm: LLM, clock: StageClock) -> None:
    """Wraps the engine's parts in `clock` (this process only)."""
    engine = llm.engine
    runner, backend = engine.runner, engine.runner.backend
    Linear.forward = clock.wrap("matmul", Linear.forward)
    backend.attend = clock.wrap("attention", backend.attend)
    backend.write_kv = clock.wrap("kv_write", backend.write_kv)
    runner.forward = clock.wrap("forward", runner.forward)
    runner.prepare_inputs = clock.wrap("prepare", runner.prepare_inputs)
    runner.sampler.sample = clock.wrap("sampling", runner.sampler.sample)
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    engine.scheduler.update = clock.wrap("update", engine.scheduler.update)
    engine.output_processor.process = clock.wrap("output", engine.output_processor.process)
    engine.step = clock.wrap("step", engine.step)


def breakdown(clock: StageClock, num_steps: int) -> dict[str, float]:
    """Milliseconds per step of each part; `other` is what no wrapper covers."""
    s = clock.seconds
    inside_forward = s["matmul"] + s["attention"] + s["kv_write"]
    per_step = {
        "matmul": s["matmul"],
        "attention": s["attention"],
        "kv_write": s["kv_write"],
        "forward_rest": s["forward"] - inside_forward,
        "prepare": s["prepare"],
        "sampling": s["sampling"],
        "schedule": s["schedule"],
        "update": s["update"],
        "output": s["output"],
    }
    per_step["other"] = s["step"] - sum(per_step.values())
    per_step["total"] = s["step"]
    return {part: 1000 * seconds / num_steps for part, seconds in per_step.items()}


def time_decode_steps(llm: LLM, clock: StageClock, batch: int, num_steps: int) -> dict[str, float]:
    """The parts of `num_steps` decode steps through the Python layers (the wrappers see each
    part), then the whole of as many steps through the fused C++ layer loop, which serves
    decode-only steps in the engine (shared/model/fused_decode.py): `fused_total`."""
    engine = llm.engine
    model = engine.runner.model
    fused, model.fused_decode = model.fused_decode, None
    # Enough tokens for both timed runs (the Python parts, then the fused steps).
    params = SamplingParams(temperature=0.0, max_tokens=2 * num_steps + 16, ignore_eos=True)
    for i in range(batch):
        prompt = llm.tokenizer.encode(f"Request {batch}-{i}: " + "a story about the sea. " * 20)
        engine.add_request(f"b{batch}-{i}", prompt[:128], params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill (and warm-up) outside the timed steps
    for _ in range(3):
        engine.step()
    clock.reset()
    for _ in range(num_steps):
        engine.step()
    figures = breakdown(clock, num_steps)
    figures["fused_total"] = float("nan")
    if fused is not None:
        model.fused_decode = fused
        clock.reset()
        for _ in range(num_steps):
            engine.step()
        figures["fused_total"] = 1000 * clock.seconds["step"] / num_steps
    engine.abort_requests(list(engine.scheduler.requests))
    return figures


def weight_read_floor_ms(llm: LLM) -> tuple[float, float]:
    """(ms to read once every weight a decode step multiplies by, GB/s measured here)."""
    model = llm.engine.runner.model
    num_bytes = sum(
        m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, Linear)
    )
    num_bytes += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    bandwidth = read_bandwidth()
    return 1000 * num_bytes / bandwidth, bandwidth / 1e9


def read_bandwidth() -> float:
    """Bytes per second a reduction streams from memory (best of 5, past the caches)."""
    source = torch.ones(64 * 2**20)  # 256 MiB
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        source.sum()
        best = min(best, time.perf_counter() - start)
    return source.numel() * 4 / best


def print_table(rows: dict[int, dict[str, float]], floor_ms: float, bandwidth: float) -> None:
    header = ["batch", *PARTS, "total", "fused_total", "floor", "fused/floor"]
    print(" ".join(f"{h:>12}" for h in header))
    for batch, figures in rows.items():
        parts = (*PARTS, "total", "fused_total")
        cells = [f"{batch:>12}"] + [f"{figures[p]:>12.2f}" for p in parts]
        cells += [f"{floor_ms:>12.2f}", f"{figures['fused_total'] / floor_ms:>12.2f}"]
        print(" ".join(cells))
    print(
        f"(ms per decode step; parts and total through the Python layers, fused_total through "
        f"the C++ layer loop the engine takes; floor = weights read once at {bandwidth:.1f} GB/s "
        "read bandwidth)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    # int8: the KV write quantizes and attention reads codes and scales (docs/quantization.md)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    parser.add_argument("--model", default=None, help="a .gguf file or HF directory (SmolLM2)")
    args = parser.parse_args(argv)
    print(f"loading the model ({args.threads} threads)...", flush=True)
    llm = LLM(
        args.model,
        num_threads=args.threads,
        adaptive_threads=False,
        kv_cache_bytes=256 * 2**20,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    clock = StageClock()
    instrument(llm, clock)
    floor_ms, bandwidth = weight_read_floor_ms(llm)
    rows = {}
    for batch in args.batches:
        print(f"batch {batch}: {args.steps} decode steps...", flush=True)
        rows[batch] = time_decode_steps(llm, clock, batch, args.steps)
    print_table(rows, floor_ms, bandwidth)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
