"""The engine's speed on a GPU beside Hugging Face transformers on the same GPU and weights.

    python -m benchmarks.gpu_engine_timings [--json PATH] [--smoke]

SmolLM2-135M-Instruct in bfloat16 on CUDA, for the engine without and with CUDA graphs
(`cuda_graphs=True`), with graphs and async scheduling (`async_scheduling=True`: the next step
launched while the device runs this one; `--smoke` runs it without graphs) and for
transformers (`AutoModelForCausalLM` loaded from the same GGUF, dequantized as the engine's
`quantization="none"` does):
- batch-1 ITL: the median gap between tokens of one request decoding `itl_tokens` tokens;
- throughput: `batch` requests of `batch_tokens` new tokens each (EOS ignored), all at once,
  output tokens per second of wall time;
- for the engine, the share of a decode step at `batch` spent outside GPU kernels: the union
  of the kernels' busy intervals (torch.profiler, CUDA activity only) against the wall time of
  the same steps run without the profiler (its callbacks slow the host's side);
- for the engine, where the host's part of such a step goes (no profiler: each part's entry
  point wrapped in a timer, as benchmarks.step_breakdown does): scheduling, input preparation,
  the forward's launches (a graph's input copies and replay), the wait for the device (a
  synchronize before sampling; with async scheduling the wait for the step before's tokens),
  sampling, the scheduler's update, output processing;
- for the engine, what made the host wait for the device during those steps (torch's sync
  debug mode), by the line that called it.
Each configuration runs once untimed first (Triton compiles, graphs are captured).

`--smoke` runs every line on the CPU in float32 with tiny sizes (no kernel share there: the
profiler sees no device kernels); its figures mean nothing. Prints figures, never asserts a
speed; `--json` writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from splitserve import LLM, SamplingParams
from splitserve.engine.launched_step import LaunchedStep
from splitserve.engine.model_paths import default_model_path
from splitserve.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class TimingPlan:
    device: str
    dtype: str
    itl_tokens: int
    batch: int
    batch_tokens: int
    profile_steps: int
    kv_cache_bytes: int


FULL = TimingPlan("cuda", "bfloat16", 128, 64, 128, 20, 2**30)
SMOKE = TimingPlan("cpu", "float32", 4, 3, 4, 2, 64 * 2**20)
EOS_TOKEN_ID = 2  # SmolLM2's; the pad token of transformers' batched generate


@dataclass(frozen=True)
class EngineFigures:
    itl_ms: float  # batch 1, median
    throughput_tokens_per_s: float  # `batch` requests at once
    batch_itl_ms: float  # median over every request of the batch
    step_ms: float  # a decode step at `batch`, without the profiler (host_parts_ms["step"])
    profiled_step_ms: float  # the same under the profiler, which slows the host's side
    kernel_busy_ms: float | None  # None where no device kernel is seen (the CPU)
    outside_kernels_share: float | None
    host_parts_ms: dict[str, float]  # a decode step at `batch`, part -> ms (HOST_PARTS)
    # Operations that made the host wait for the device in `profile_steps` decode steps
    # (torch.cuda.set_sync_debug_mode): "file:line message" -> count; {} off CUDA.
    host_syncs: dict[str, int]


@dataclass(frozen=True)
class TransformersFigures:
    itl_ms: float
    throughput_tokens_per_s: float


def prompt_ids(tokenizer: Any, count: int) -> list[list[int]]:
    """`count` chat prompts of a few dozen tokens, each different (no shared prefix cache
    beyond the template's)."""
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Tell me a short story about the number {i}."}]
            ),
            add_special_tokens=False,
        )
        for i in range(count)
    ]


def _fixed_length(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def time_engine(plan: TimingPlan, **options: object) -> EngineFigures:
    llm = LLM(device=plan.device, dtype=plan.dtype, kv_cache_bytes=plan.kv_cache_bytes, **options)
    prompts = prompt_ids(llm.tokenizer, plan.batch)
    llm.generate(prompts, _fixed_length(4))  # warm-up: compiles, captures, allocates
    (single,) = llm.generate(prompts[:1], _fixed_length(plan.itl_tokens))
    start = time.perf_counter()
    results = llm.generate(prompts, _fixed_length(plan.batch_tokens))
    seconds = time.perf_counter() - start
    gaps = [gap for r in results for gap in r.outputs[0].timings.inter_token_latencies]
    profiled_step_ms, busy_ms = profile_decode_steps(llm, prompts, plan)
    host_parts = time_host_parts(llm, prompts, plan)
    # The kernels' busy time comes from the profiler, which does not change it; the step's
    # wall time from steps without it: its callbacks on every launch and copy add host time,
    # which a step bound by the host (async scheduling) shows whole (7.4 against 3.1 ms on the
    # H100, 2026-11-27).
    step_ms = host_parts["step"]
    syncs = count_host_syncs(llm, prompts, plan)
    return EngineFigures(
        itl_ms=1e3 * statistics.median(single.outputs[0].timings.inter_token_latencies),
        throughput_tokens_per_s=plan.batch * plan.batch_tokens / seconds,
        batch_itl_ms=1e3 * statistics.median(gaps),
        step_ms=step_ms,
        profiled_step_ms=profiled_step_ms,
        kernel_busy_ms=busy_ms,
        outside_kernels_share=None if busy_ms is None else 1.0 - busy_ms / step_ms,
        host_parts_ms=host_parts,
        host_syncs=syncs,
    )


HOST_PARTS = ("schedule", "prepare", "forward", "device_wait", "sampling", "update", "output")
# With async_scheduling: the wait is for the step before (LaunchedStep.token_ids), `update`
# resolves its tokens and `advance` moves the launched step's counts on.
ASYNC_HOST_PARTS = (*HOST_PARTS, "advance")


def time_host_parts(llm: LLM, prompts: list[list[int]], plan: TimingPlan) -> dict[str, float]:
    """Mean ms per decode-only step at `batch` of each of HOST_PARTS, `other` (the rest of the
    step) and `step`. The engine's methods are wrapped on its instances for the measurement
    and unwrapped after."""
    from benchmarks.step_breakdown import StageClock

    engine, clock = llm.engine, StageClock()
    runner = engine.runner
    is_cuda = plan.device.startswith("cuda")

    def wait_for_device() -> None:
        if is_cuda:
            torch.cuda.synchronize()

    is_async = engine.overlap is not None
    targets = [
        (engine.scheduler, "schedule", "schedule"),
        (runner, "prepare_inputs", "prepare"),
        (runner, "forward", "forward"),
        (runner.sampler, "sample_on_device" if is_async else "sample", "sampling"),
        (engine.scheduler, "resolve_launched" if is_async else "update", "update"),
        (engine.output_processor, "process", "output"),
        (engine, "step", "step"),
    ]
    if is_async:
        targets.append((engine.scheduler, "advance_launched", "advance"))
    for owner, method, part in targets:
        setattr(owner, method, clock.wrap(part, getattr(owner, method)))
    if is_async:  # the event wait inside LaunchedStep.token_ids is the device wait
        token_ids = LaunchedStep.token_ids
        LaunchedStep.token_ids = clock.wrap("device_wait", token_ids)  # type: ignore[method-assign]
    else:
        sample = runner.sampler.sample
        timed_wait = clock.wrap("device_wait", wait_for_device)

        def sample_after_the_device(*args: Any, **kwargs: Any) -> Any:
            timed_wait()
            return sample(*args, **kwargs)

        runner.sampler.sample = sample_after_the_device
    request_ids = [f"host-{i}" for i in range(len(prompts))]
    try:
        for request_id, prompt in zip(request_ids, prompts):
            engine.add_request(request_id, prompt, _fixed_length(plan.profile_steps + 8))
        _step_until_every_request_decodes(llm, set(request_ids))
        clock.reset()
        for _ in range(plan.profile_steps):
            engine.step()
    finally:
        engine.abort_requests(request_ids)
        for owner, method, _ in targets:
            vars(owner).pop(method, None)
        if is_async:
            LaunchedStep.token_ids = token_ids  # type: ignore[method-assign]
        else:
            vars(runner.sampler).pop("sample", None)
    names = ASYNC_HOST_PARTS if is_async else HOST_PARTS
    parts = {part: 1e3 * clock.seconds[part] / plan.profile_steps for part in names}
    parts["step"] = 1e3 * clock.seconds["step"] / plan.profile_steps
    parts["other"] = parts["step"] - sum(parts[part] for part in names)
    return parts


def count_host_syncs(llm: LLM, prompts: list[list[int]], plan: TimingPlan) -> dict[str, int]:
    """What made the host wait for the device in `profile_steps` decode steps at `batch`:
    torch's sync debug mode warns at each synchronizing call (a blocking copy, .item(),
    .tolist() of a device tensor); counted by the engine's line that called it."""
    if not plan.device.startswith("cuda"):
        return {}
    engine = llm.engine
    request_ids = [f"sync-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(request_ids, prompts):
        engine.add_request(request_id, prompt, _fixed_length(plan.profile_steps + 8))
    _step_until_every_request_decodes(llm, set(request_ids))
    counts: dict[str, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(plan.profile_steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    engine.abort_requests(request_ids)
    for warning in caught:
        key = f"{warning.filename}:{warning.lineno} {str(warning.message)[:60]}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def profile_decode_steps(
    llm: LLM, prompts: list[list[int]], plan: TimingPlan
) -> tuple[float, float | None]:
    """Mean wall ms of a decode-only step at `batch`, and the kernels' busy ms in it."""
    engine = llm.engine
    request_ids = [f"profile-{i}" for i in range(len(prompts))]
    params = _fixed_length(plan.profile_steps + 8)
    for request_id, prompt in zip(request_ids, prompts):
        engine.add_request(request_id, prompt, params)
    _step_until_every_request_decodes(llm, set(request_ids))
    is_cuda = plan.device.startswith("cuda")
    activities = [ProfilerActivity.CUDA] if is_cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(plan.profile_steps):
            engine.step()
        if is_cuda:
            torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - start) / plan.profile_steps
    engine.abort_requests(request_ids)
    busy_ms = _kernel_busy_ms(prof) / plan.profile_steps if is_cuda else None
    return wall_ms, busy_ms


def _step_until_every_request_decodes(llm: LLM, request_ids: set[str]) -> None:
    """Steps until each request has its first token (its prompt is prefilled), then once more,
    so the profiled steps are decode-only."""
    waiting = set(request_ids)
    while waiting:
        waiting -= {delta.request_id for delta in llm.engine.step() if delta.token_ids}
    llm.engine.step()


def _kernel_busy_ms(prof: profile) -> float:
    """The union of the device kernels' intervals (overlapping kernels counted once)."""
    intervals = sorted(
        (event.time_range.start, event.time_range.end)
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    )
    busy_us, covered_to = 0.0, float("-inf")
    for start, end in intervals:
        start = max(start, covered_to)
        if end > start:
            busy_us += end - start
            covered_to = end
    return busy_us / 1e3


def time_transformers(plan: TimingPlan, prompts: list[list[int]]) -> TransformersFigures:
    model = _transformers_model(plan)
    _hf_generate(model, prompts[:1], 2, plan)  # warm-up
    one = _hf_seconds(model, prompts[:1], 1, plan)
    many = _hf_seconds(model, prompts[:1], plan.itl_tokens, plan)
    _hf_generate(model, prompts, 2, plan)  # warm-up at the batch
    batch_seconds = _hf_seconds(model, prompts, plan.batch_tokens, plan)
    return TransformersFigures(
        itl_ms=1e3 * (many - one) / (plan.itl_tokens - 1),
        throughput_tokens_per_s=plan.batch * plan.batch_tokens / batch_seconds,
    )


def _transformers_model(plan: TimingPlan) -> Any:
    from transformers import AutoModelForCausalLM  # optional: the engine itself never needs it

    path = default_model_path()
    directory, name = path.rsplit("/", 1)
    dtype = getattr(torch, plan.dtype)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
    return model.to(plan.device).eval()


def _hf_seconds(model: Any, prompts: list[list[int]], new_tokens: int, plan: TimingPlan) -> float:
    start = time.perf_counter()
    _hf_generate(model, prompts, new_tokens, plan)
    return time.perf_counter() - start


def _hf_generate(model: Any, prompts: list[list[int]], new_tokens: int, plan: TimingPlan) -> None:
    """Exactly `new_tokens` new tokens per prompt, greedy, prompts left-padded into one batch."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[EOS_TOKEN_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            ids.to(plan.device),
            attention_mask=mask.to(plan.device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=EOS_TOKEN_ID,
        )
    out.cpu()  # waits for the device


VARIANTS = ("engine", "engine_cuda_graphs", "engine_cuda_graphs_async", "transformers")


def run(plan: TimingPlan, names: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    """Each named configuration's figures, or the error that stopped it (the others still
    run)."""
    is_cuda = plan.device.startswith("cuda")
    # --smoke: no graphs on the CPU, so the async variant runs without them there.
    graphs: dict[str, object] = {"cuda_graphs": True} if is_cuda else {}
    measures: dict[str, Any] = {
        "engine": lambda: time_engine(plan),
        "engine_cuda_graphs": lambda: time_engine(plan, **graphs),
        "engine_cuda_graphs_async": lambda: time_engine(plan, async_scheduling=True, **graphs),
        "transformers": lambda: time_transformers(
            plan, prompt_ids(Tokenizer.from_gguf(default_model_path()), plan.batch)
        ),
    }
    variants: dict[str, Any] = {}
    for name in names:
        if name == "engine_cuda_graphs" and not is_cuda:
            variants[name] = {"skipped": "CUDA graphs run on CUDA only"}
        else:
            variants[name] = _figures_or_error(measures[name])
    return {"plan": asdict(plan), "device": _device_name(plan), "variants": variants}


def _figures_or_error(measure: Any) -> dict[str, Any]:
    try:
        return asdict(measure())
    except (RuntimeError, ValueError, ImportError, OSError) as error:
        # Recorded, not swallowed: the record says which configuration failed and why.
        print(f"  failed: {type(error).__name__}: {error}", file=sys.stderr)
        return {"error": f"{type(error).__name__}: {error}"}


def _device_name(plan: TimingPlan) -> str:
    return torch.cuda.get_device_name() if plan.device.startswith("cuda") else "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_engine_timings")
    parser.add_argument("--json", default="", help="also write the figures here")
    parser.add_argument("--smoke", action="store_true", help="every line on the CPU, tiny")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    args = parser.parse_args(argv)
    names = tuple(name for name in args.variants.split(",") if name)
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    plan = SMOKE if args.smoke else FULL
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_engine_timings: no CUDA device; on the CPU, pass --smoke", file=sys.stderr)
        return 2
    record = run(plan, names)
    print(json.dumps(record, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    failed = [name for name, figures in record["variants"].items() if "error" in figures]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
