"""The `splitserve` command line. Subcommands grow with the services."""

from __future__ import annotations

import argparse
import json
import sys
import time

from splitserve.engine.progress import ConsoleProgress
from splitserve.engine.sampling_params import SamplingParams
from splitserve.launcher import add_up_flags, run_up
from splitserve.planner.__main__ import add_plan_subcommands, run_plan
from splitserve.pod.flags import add_kv_cache_dtype_flag, add_quantization_flag

ENGINE_FLAGS = (
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "block_size",
    "max_num_batched_tokens",
    "max_model_len",
    "num_threads",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands.add_parser("generate", help="stream a completion from the local engine"))
    _add_up(commands.add_parser("up", help="run gateway, prefill and decode processes here"))
    _add_plan(commands.add_parser("plan", help="capacity planner and autoscaler"))
    _add_env(commands.add_parser("env", help="versions, CPU features and the kernel paths here"))
    return parser


def _add_env(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--json", action="store_true", help="one JSON object (what pods log)")


def run_env(args: argparse.Namespace) -> int:
    from splitserve.environment import environment_report, format_report  # lazy: torch

    report = environment_report()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _add_up(sub: argparse.ArgumentParser) -> None:
    add_up_flags(sub)


def _add_plan(sub: argparse.ArgumentParser) -> None:
    # The planner owns its flags: `splitserve plan X` is `python -m splitserve.planner X`.
    add_plan_subcommands(sub)


def _add_generate(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--prompt", required=True, help="the prompt, or the user message with --chat")
    sub.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    sub.add_argument("--system", default=None, help="system message (with --chat)")
    sub.add_argument(
        "--model", default=None, help="a .gguf file or HF directory (default: SmolLM2)"
    )
    sub.add_argument("--max-tokens", type=int, default=128)
    sub.add_argument("--temperature", type=float, default=0.0)
    sub.add_argument("--top-p", type=float, default=1.0)
    sub.add_argument("--top-k", type=int, default=0)
    sub.add_argument("--seed", type=int, default=None)
    sub.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_quantization_flag(sub)
    add_kv_cache_dtype_flag(sub)
    sub.add_argument("--block-size", type=int, default=16)
    sub.add_argument("--max-num-batched-tokens", type=int, default=512)
    sub.add_argument("--max-model-len", type=int, default=None)
    sub.add_argument("--num-threads", type=int, default=None)


def run_generate(args: argparse.Namespace) -> int:
    from splitserve.engine.llm import LLM  # lazy: torch, which up and plan do without

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    options = {name: getattr(args, name) for name in ENGINE_FLAGS}
    llm = LLM(args.model, progress=ConsoleProgress("loading model"), **options)
    spec = llm.engine.kv_spec
    print(f"[KV cache: {spec.describe()}, {spec.total_bytes / 2**20:.0f} MiB]", file=sys.stderr)
    prompt: object = args.prompt
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = llm.tokenizer.encode(text, add_special_tokens=False)
    start = time.monotonic()
    num_tokens = 0
    for delta in llm.stream(prompt, params):
        num_tokens += len(delta.token_ids)
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    elapsed = time.monotonic() - start
    print(
        f"\n[{num_tokens} tokens in {elapsed:.2f} s, {num_tokens / elapsed:.1f} tokens/s]",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "up":
            return run_up(args)
        if args.command == "plan":
            return run_plan(args)
        if args.command == "env":
            return run_env(args)
    except ValueError as error:
        print(f"splitserve: error: {error}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
