"""The server engine: the `Engine` protocol over an inference server (`echo2 worker --engine
server`, `[rollout.server]`), so the worker loop is the same as with the in-process engines.

- Generation goes to `POST /v1/completions` with token-id prompts and every sampling field explicit
  (rollout/server_api.py), many requests at once (the server batches them); a reply is checked
  before it becomes a `Sample` (the prompt echoed, finite log-probs, one per token).
- An install writes the snapshot's verified bytes to a file of this worker's (the bytes the
  broadcast plane verified, chunk by chunk), then the backend's admin pauses, loads it on every
  rank, proves it and resumes (rollout/server_admin.py). Only a proven install changes `version`;
  a failed one leaves what the server serves (`InstallFailed.served`: the old version, or -1, and
  the worker leases nothing at -1) and is retried by the broadcast client.
- LoRA: the adapter is merged into the base weights this engine keeps, and the adapted layers
  (with their fused siblings) go in one partial install: the numerics of the in-process engine.
- A launched server (rollout/server_launch.py) that exits ends generation with `ServerDied`: the
  worker stops with that one line.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from echo2.config import Config, ConfigError, RolloutConfig
from echo2.data.tasks.base import Prompt
from echo2.records import Snapshot
from echo2.rollout import server_api
from echo2.rollout.engine import Sample, default_keys, generate_prompts, sample_of
from echo2.rollout.install_digest import file_digest, write_hashed
from echo2.rollout.safetensors_view import SafetensorsView
from echo2.rollout.sampling import SamplingKeys
from echo2.rollout.server_admin import ADMINS, Client, InstallFailed, ServerDown, api_key_for
from echo2.rollout.server_launch import LaunchedServer

logger = logging.getLogger(__name__)

PARALLEL_REQUESTS = 64
"""Requests in flight at once from one engine (the server schedules and batches them)."""


@dataclass(frozen=True, slots=True)
class Staged:
    """A version's install file, written and hashed, waiting for `ServerEngine.install`."""

    folder: Path
    path: Path
    digest: str
    partial: bool


class ServerEngine:
    def __init__(
        self,
        tokenizer,
        config: RolloutConfig,
        *,
        admin,
        model: str | None = None,
        version: int = -1,
        base_model=None,
        launched: LaunchedServer | None = None,
    ) -> None:
        self.tokenizer, self.config, self.admin = tokenizer, config, admin
        self.client: Client = admin.client
        self.model, self.version, self.base_model = model, version, base_model
        self.launched = launched
        self.eos_id = tokenizer.eos_token_id
        self.lora_base: dict = {}
        self.packed_modules: dict | None = None
        self.pool = ThreadPoolExecutor(PARALLEL_REQUESTS, thread_name_prefix="echo2-server")
        self.install_s: list[float] = []
        self.stage_s: list[float] = []
        self.staged: dict[int, Staged] = {}
        """Versions whose install file is written and hashed (`stage`), not yet installed."""
        self._staging = threading.RLock()

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompts: list[Prompt], *, n: int, greedy: bool = False, keys: SamplingKeys | None = None
    ) -> list[list[Sample]]:
        return generate_prompts(self, prompts, n=n, greedy=greedy, keys=keys)

    def generate_ids(
        self, encoded: list[list[int]], *, n: int, greedy: bool = False, keys: SamplingKeys | None = None
    ) -> list[list[Sample]]:
        """As the other engines' (context i's n samples in order); ServerDied if a launched server
        has exited, ServerDown if the server does not answer, BadReply for a malformed answer."""
        if self.config.sampling == "gumbel" and not greedy and keys is None:
            keys = default_keys([str(i) for i in range(len(encoded))])
        bodies = server_api.completion_bodies(
            self.config, encoded, n=n, greedy=greedy, keys=keys, eos_id=self.eos_id, version=self.version
        )
        if self.model is not None:
            bodies = [b | {"model": self.model} for b in bodies]
        replies = list(self.pool.map(self._complete, bodies))
        per = len(bodies) // len(encoded)
        results: list[list[Sample]] = []
        for i, ids in enumerate(encoded):
            group = []
            for body, reply in zip(bodies[i * per : (i + 1) * per], replies[i * per : (i + 1) * per], strict=True):
                for resp, logprobs in server_api.samples_of(
                    reply, prompt=ids, n=body["n"], max_tokens=self.config.max_new_tokens
                ):
                    group.append(sample_of(self.tokenizer, ids, resp, logprobs))
            results.append(group)
        return results

    def _complete(self, body: dict) -> dict:
        try:
            return self.client.call("POST", "/v1/completions", json=body)
        except ServerDown:
            if self.launched is not None:
                self.launched.check_alive()  # ServerDied with its exit status
            raise

    # ------------------------------------------------------------------ installs
    def stage(self, snapshot: Snapshot) -> None:
        """Write `snapshot`'s install file and take its digest while the server goes on serving:
        the part of an install that needs no pause. The worker calls it before it takes the
        engine lock (rollout/worker.py `install_snapshot`), so generation waits only for
        `install`'s pause, load, proof and resume; `install` stages a version not staged yet.
        Staging a version drops the files of older ones staged and never installed."""
        with self._staging:
            if snapshot.version in self.staged:
                return
            start = time.perf_counter()
            state, partial = snapshot.state, False
            if snapshot.is_adapter:
                from echo2.rollout.vllm_engine import merged_layers

                if not hasattr(self.admin, "rpc"):
                    raise InstallFailed(f"{self.admin.backend}: LoRA adapter snapshots need the vllm backend",
                                        served=self.version)  # fmt: skip
                if self.packed_modules is None:
                    self.packed_modules = self.admin.rpc("echo2_packed_modules")[0]
                state = merged_layers(self.base_model, dict(snapshot.state), self.lora_base, self.packed_modules)
                partial = True
            folder = install_folder(snapshot.version, state_bytes(state))
            try:
                path, digest = write_snapshot(state, folder / "model.safetensors")
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            self._drop_staged(below=snapshot.version)
            self.staged[snapshot.version] = Staged(folder, path, digest, partial)
            self.stage_s.append(time.perf_counter() - start)

    def install(self, snapshot: Snapshot) -> None:
        """Have the server load and prove the snapshot's install file (`stage`d now if it was not
        before); `version` changes only when it did (InstallFailed otherwise, `version` = what the
        server serves). The file is removed either way. `install_s`: this call's seconds, the
        time generation waits in the worker."""
        start = time.perf_counter()
        with self._staging:
            self.stage(snapshot)
            staged = self.staged.pop(snapshot.version)
        try:
            self.admin.install(
                staged.path, digest=staged.digest, version=snapshot.version, partial=staged.partial, served=self.version
            )
        except InstallFailed as e:
            if self.launched is not None:
                self.launched.check_alive()
            self.version = e.served
            logger.warning("version %d not installed (serving %d): %s", snapshot.version, e.served, e)
            raise
        finally:  # the server has read it (or will never)
            shutil.rmtree(staged.folder, ignore_errors=True)
        self.version = snapshot.version
        self.install_s.append(time.perf_counter() - start)
        logger.debug("installed version %d in %.2f s", snapshot.version, self.install_s[-1])

    def _drop_staged(self, *, below: int | None = None) -> None:
        for version in [v for v in self.staged if below is None or v < below]:
            shutil.rmtree(self.staged.pop(version).folder, ignore_errors=True)

    def close(self) -> None:
        """Stop a launched server (by its pid), drop the install files."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
        with self._staging:
            self._drop_staged()
        if self.launched is not None:
            self.launched.stop()


SHM = Path("/dev/shm")


def install_folder(version: int, nbytes: int) -> Path:
    """A new folder for version's install file: in /dev/shm (memory; the file lives only while the
    server loads it, and writing it costs no disk I/O) when it has twice the snapshot free, else in
    the temporary directory (removed with the file after the install)."""
    try:
        if shutil.disk_usage(SHM).free >= 2 * nbytes:
            return Path(tempfile.mkdtemp(prefix=f"echo2-v{version}-", dir=SHM))
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix=f"echo2-v{version}-"))


def state_bytes(state) -> int:
    if isinstance(state, SafetensorsView):
        return state.data.size
    return sum(t.numel() * t.element_size() for t in state.values())


def write_snapshot(state, path: Path) -> tuple[Path, str]:
    """`state` as a safetensors file at `path` (a received snapshot: its verified bytes as they
    are, straight from its chunks; else `safetensors.torch.save_file`), written to a temporary
    name and renamed; (path, the file's digest: rollout/install_digest.py)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    if isinstance(state, SafetensorsView):
        digest = write_hashed(tmp, state.data.size, state.data.views)
    else:
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(tmp))
        digest = file_digest(tmp)
    os.replace(tmp, path)
    return path, digest


def start_server_engine(config: Config, *, tokenizer, url: str | None, device, dtype: str) -> ServerEngine:
    """The engine of `echo2 worker --engine server`: attached to `url` (else rollout.server.url),
    or a server launched for this worker when rollout.server.launch, in `dtype` (rollout/engines.py
    `vllm_dtype`); checked against the run's sampling before the first request (ConfigError naming
    the key otherwise)."""
    rcfg = config.rollout
    scfg = rcfg.server
    url = url or scfg.url
    launched = None
    if url is None:
        if not scfg.launch:
            raise ConfigError(
                "rollout.server: no server to drive: set rollout.server.url (or echo2 worker --server-url), "
                "or rollout.server.launch = true"
            )
        launched = launch(config, tokenizer=tokenizer, dtype=dtype, device=device)
        url, api_key = launched.url, None
    else:
        api_key = api_key_for(url, scfg.api_key_env)
    admin = ADMINS[scfg.backend](Client(url, api_key=api_key, timeout_s=scfg.request_timeout_s),
                                 install_timeout_s=scfg.install_timeout_s)  # fmt: skip
    try:
        if launched is not None:
            try:
                launched.wait_healthy(admin.health, timeout_s=scfg.start_timeout_s)
            finally:
                if launched.written is not None:  # the weights are loaded (or never will be)
                    shutil.rmtree(launched.written, ignore_errors=True)
        elif not admin.health():
            raise ConfigError(f"rollout.server.url: nothing healthy answers at {url}")
        info = admin.check(rcfg)
    except BaseException:
        if launched is not None:
            launched.stop()
        raise
    logger.info("inference server %s: %s", url, info)
    base = None
    if config.learner.lora is not None:  # adapter snapshots merge into the base weights kept here
        from echo2.models import load_model

        base = load_model(config.model, vocab_size=len(tokenizer), seed=config.run.seed)
    return ServerEngine(tokenizer, rcfg, admin=admin, model=info.get("model"), base_model=base, launched=launched)


def launch(config: Config, *, tokenizer, dtype: str, device) -> LaunchedServer:
    """Start `vllm serve` on the model section's weights (written once to a temporary directory
    when they have no local one), with the in-process engine's memory and length arguments."""
    from echo2.rollout.server_launch import launch_command
    from echo2.rollout.vllm_engine import engine_args, model_source, write_model_dir

    rcfg = config.rollout
    import torch

    source, written = model_source(config.model), None
    if source is None:  # a tiny model or a hub id: the weights the run starts from, written once
        from echo2.models import load_model

        model = load_model(config.model, vocab_size=len(tokenizer), seed=config.run.seed)
        source = written = write_model_dir(model, tokenizer, dtype)
    kind = "cuda" if device.type == "cuda" else "cpu"
    llm_kwargs = engine_args(rcfg, model_dir=source, dtype=dtype, device_kind=kind)
    argv, env = launch_command(
        rcfg,
        model_dir=source,
        dtype=dtype,
        socket_path="{socket}",
        llm_kwargs=llm_kwargs,
        seed=config.run.seed,
        python=rcfg.server.python,
        threads=int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads()),
    )
    server = LaunchedServer.start(argv, env)
    server.written = written  # removed once the server has loaded it (`start_server_engine`)
    return server
