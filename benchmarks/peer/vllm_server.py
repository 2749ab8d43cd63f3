"""vLLM's OpenAI server (CPU build, its own virtual environment) as a system under test, started
and stopped like our `RunningStack`, serving the same float32 weights."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.peer.hf_export import ensure_hf_export
from benchmarks.peer.vllm_venv import ensure_vllm_venv
from splitserve.common.ports import free_port
from splitserve.loadgen.client import Target
from splitserve.loadgen.stacks import HOST

SERVED_NAME = "smollm2"
STARTUP_TIMEOUT_S = 600.0


class VllmServer:
    """`with VllmServer(kv_cache_gib) as server:` serves until the block ends."""

    def __init__(self, kv_cache_gib: int = 2, log_path: Path = Path("build/vllm-server.log")):
        self.kv_cache_gib = kv_cache_gib
        self.log_path = log_path
        self.port = free_port()
        self._process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def target(self) -> Target:
        return Target(f"{self.base_url}/v1/completions", SERVED_NAME)

    def __enter__(self) -> VllmServer:
        python = ensure_vllm_venv()
        model_dir = ensure_hf_export()
        argv = [str(python), "-m", "vllm.entrypoints.openai.api_server"]
        argv += ["--model", str(model_dir), "--served-model-name", SERVED_NAME]
        argv += ["--dtype", "float32", "--max-model-len", "2048", "--host", HOST]
        argv += ["--port", str(self.port)]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib)}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 (the process writes it while it runs)
        print(f"[vllm] starting (log: {self.log_path})", flush=True)
        self._process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        assert self._process is not None, "started in __enter__"
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self._process.returncode}: {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vLLM did not answer /health in {STARTUP_TIMEOUT_S:.0f} s")

    def __exit__(self, *exc: object) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        os.killpg(self._process.pid, signal.SIGTERM)  # its engine core is a child process
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
