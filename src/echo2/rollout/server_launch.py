"""`rollout.server.launch = true`: a worker starts `vllm serve` for itself and stops it on exit.

The server listens on a Unix socket in a directory of the worker's own (no port to pick or race
for, and no address another machine can reach), runs with the dev-mode routes the install needs
(VLLM_SERVER_DEV_MODE=1) and the flags that make it generate as the in-process engine does: echo2's
worker extension, the log-prob mode and logits processor of rollout.sampling (rollout/vllm_args.py),
`--generation-config vllm` (no model-file sampling defaults), the engine's length and KV size, eager
mode on the CPU, and --tensor-parallel-size. `launch_command` is pure, so the flags are tested
without a server.

The process is stopped by its pid, as a process group (vLLM's API server starts its engine core as
a child), at `stop` and at interpreter exit; it runs under rollout/server_guard.py, which ends it
when the worker dies without cleaning up (SIGKILL), so no server outlives its worker.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from echo2.config import RolloutConfig
from echo2.rollout import vllm_args

logger = logging.getLogger(__name__)

EXTENSION = "echo2.rollout.vllm_ext.WeightInstaller"
PROGRESS_S = 15.0
"""A launch prints a progress line this often while it waits for /health."""


class ServerStartError(RuntimeError):
    """The launched server exited, or did not answer /health in time (message: why, and the last
    lines of its log)."""


class ServerDied(RuntimeError):
    """The launched server exited while the worker still needed it."""


def launch_command(
    config: RolloutConfig,
    *,
    model_dir: str | Path,
    dtype: str,
    socket_path: str | Path,
    llm_kwargs: dict,
    seed: int,
    python: str | None = None,
    threads: int | None = None,
) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) of `vllm serve` for this worker. `llm_kwargs`: the in-process
    engine's memory and length arguments (`vllm_engine.engine_args`); `threads`: OMP_NUM_THREADS
    (vLLM's CPU worker drops torch to one thread without it)."""
    argv = [
        python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--uds", str(socket_path),
        "--dtype", dtype,
        "--seed", str(seed),
        "--generation-config", "vllm",
        "--worker-extension-cls", EXTENSION,
        "--enable-prefix-caching",
        "--max-logprobs", "0",
        "--max-model-len", str(llm_kwargs["max_model_len"]),
        "--tensor-parallel-size", str(config.server.tensor_parallel_size),
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    sampling = vllm_args.sampling_kwargs(config)
    argv += ["--logprobs-mode", sampling["logprobs_mode"]]
    for proc in sampling.get("logits_processors", []):
        argv += ["--logits-processors", proc]
    if llm_kwargs.get("enforce_eager"):
        argv.append("--enforce-eager")
    if "kv_cache_memory_bytes" in llm_kwargs:
        argv += ["--kv-cache-memory-bytes", str(llm_kwargs["kv_cache_memory_bytes"])]
    if "gpu_memory_utilization" in llm_kwargs:
        argv += ["--gpu-memory-utilization", str(llm_kwargs["gpu_memory_utilization"])]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    if "enforce_eager" in llm_kwargs and "gpu_memory_utilization" not in llm_kwargs:  # a CPU engine
        # its engine core in the API server's process: on 2 cores that gave 429 tokens/s against
        # 372 in one side-by-side probe (docs/benchmarks.md, the server engine)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if config.sampling == "gumbel":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # the V1 logits-processor interface (vllm_sampling.py)
    return argv, env


class LaunchedServer:
    """A server process this worker started. `url` is `unix:<socket>`."""

    def __init__(self, argv: list[str], env: dict[str, str], *, socket_path: Path, log_path: Path) -> None:
        self.socket_path, self.log_path = socket_path, log_path
        self.written: Path | None = None
        """A model directory written for this server to load, removed once it is healthy."""
        self.url = f"unix:{socket_path}"
        self._log = open(log_path, "ab")  # noqa: SIM115 - held for the process's life
        guarded = [sys.executable, "-m", "echo2.rollout.server_guard", str(os.getpid()), "--", *argv]
        self.process = subprocess.Popen(
            guarded,
            env=os.environ | env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, stopped as a whole
        )
        self.pid = self.process.pid
        atexit.register(self.stop)
        logger.info("started %s (pid %d, log %s)", " ".join(argv[1:4]), self.pid, log_path)

    @classmethod
    def start(cls, argv: list[str], env: dict[str, str], *, workdir: Path | None = None) -> LaunchedServer:
        workdir = Path(workdir or tempfile.mkdtemp(prefix="echo2-server-"))
        sock = workdir / "server.sock"
        argv = [a if a != "{socket}" else str(sock) for a in argv]
        return cls(argv, env, socket_path=sock, log_path=workdir / "server.log")

    def alive(self) -> bool:
        return self.process.poll() is None

    def check_alive(self) -> None:
        """ServerDied (with the exit status and the log's last line) if the process has exited."""
        if not self.alive():
            raise ServerDied(f"the inference server (pid {self.pid}) exited with status "
                             f"{self.process.returncode}: {self.last_lines(1) or 'no output'}")  # fmt: skip

    def wait_healthy(self, healthy: Callable[[], bool], *, timeout_s: float) -> float:
        """Seconds until `healthy()` is true, printing a progress line every PROGRESS_S;
        ServerStartError (after stopping the process) if it exits or the time runs out."""
        start = time.monotonic()
        last = start
        while True:
            if not self.alive():
                self.stop()
                raise ServerStartError(
                    f"the inference server exited with status {self.process.returncode} while starting "
                    f"(log {self.log_path}): {self.last_lines(3)}"
                )
            if self.socket_path.exists() and healthy():
                waited = time.monotonic() - start
                logger.info("inference server (pid %d) healthy after %.0f s", self.pid, waited)
                return waited
            now = time.monotonic()
            if now - start > timeout_s:
                self.stop()
                raise ServerStartError(
                    f"the inference server did not answer /health within rollout.server.start_timeout_s = "
                    f"{timeout_s:.0f} s (log {self.log_path}): {self.last_lines(3)}"
                )
            if now - last >= PROGRESS_S:
                last = now
                print(f"echo2 worker: waiting for the inference server (pid {self.pid}): {now - start:.0f} s",
                      file=sys.stderr, flush=True)  # fmt: skip
            time.sleep(0.5)

    def last_lines(self, k: int) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(line.strip() for line in lines[-k:])

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server's process group (it leads one), SIGKILL after `timeout_s`, then
        SIGKILL to whatever of the group is left until none is (at most `timeout_s` more);
        idempotent."""
        if self.process.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGTERM)
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.process.wait(timeout=timeout_s)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # until no process of the group is left (reaped)
            try:  # the engine core, should it have outlived the API server
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.1)
        self._log.close()
        atexit.unregister(self.stop)
