"""The provider's SDK boundary (`SkyClient`) and its real implementation, `BridgeClient`.

SkyPilot cannot be installed beside echo2 (its pins conflict with transformers' dependencies),
so it runs in an interpreter of its own: `BridgeClient` starts bridge.py, by path, with
`scheduler.skypilot.python` and talks to it over JSON lines on its stdin and stdout. Every call
is a SkyPilot request that returns a request id at once (`poll` reads finished ones only), so the
provider's background thread waits on the bridge for a round trip, never on a cloud; the
coordinator's thread never calls it at all.

The worker's token goes to the bridge in a launch request's `secrets` (a pipe, not a command
line nor the bridge's environment); the bridge's stderr, which carries SkyPilot's own output, is
logged here with the token redacted. Imports nothing of SkyPilot.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from echo2.config import ConfigError
from echo2.fleet.providers.skypilot.task import SLOT_SECRET_ENV, TOKEN_ENV

logger = logging.getLogger(__name__)

BRIDGE = Path(__file__).with_name("bridge.py")
"""Run by path with SkyPilot's interpreter: it imports only the standard library and sky."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """A finished SkyPilot request."""

    ok: bool
    value: Any = None
    """`status`: {cluster name: status string ("UP", "INIT", "STOPPED")} of the clusters found."""
    error: str = ""


class SkyClient(Protocol):
    """What the provider needs from SkyPilot: requests that return an id at once, and a poll.
    Implemented by `BridgeClient` (SkyPilot's SDK, in its own interpreter) and by the tests' fake."""

    def launch(
        self, task: dict, *, token: str, slot_secret: str, cluster_name: str, idle_minutes: int
    ) -> str:
        """Submit a launch of the YAML-style `task` (task.task_config) with `token` as its secret
        ECHO2_TOKEN and `slot_secret` as ECHO2_SLOT_SECRET, autodown after `idle_minutes` idle; the
        request id."""
        ...

    def down(self, cluster_name: str) -> str:
        """Submit a teardown; the request id."""
        ...

    def status(self, cluster_names: list[str]) -> str:
        """Submit a status query; its outcome's value maps each cluster found to its status."""
        ...

    def poll(self, request_id: str) -> Outcome | None:
        """None while the request runs; its outcome once finished. Must not wait for it."""
        ...

    def cancel(self, request_id: str) -> None:
        """Cancel a request still in flight (a launch the learner no longer wants)."""
        ...


def bridge_env(extra_path: list[str] | None = None) -> dict[str, str]:
    """The bridge's environment: the learner's, without its token (the bridge gets it per launch)
    and without the learner's PYTHONPATH; `extra_path` (tests: a fake sky) goes first."""
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, "PYTHONPATH", "PYTHONHOME")}
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(extra_path)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def check_python(python: str | None, *, env: dict[str, str] | None = None, timeout: float = 120.0) -> dict:
    """`scheduler.skypilot.python` must name an interpreter that imports sky: its versions, or a
    ConfigError naming the key (the CLI exits with status 2)."""
    key = "scheduler.skypilot.python"
    if not python:
        raise ConfigError(
            f"{key}: required for provider = skypilot: the python of a venv with SkyPilot installed "
            "(SkyPilot cannot share echo2's venv; docs/fleet.md)"
        )
    exe = os.path.expanduser(python)
    try:
        done = subprocess.run(
            [exe, str(BRIDGE), "--check"],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env or bridge_env(),
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"{key}: cannot run {exe}: {type(e).__name__}: {e}") from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise ConfigError(f"{key}: {exe} cannot import sky ({why}); install SkyPilot in that venv")
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise ConfigError(f"{key}: {exe} answered {done.stdout!r} to the bridge's --check") from None


class BridgeError(RuntimeError):
    """The bridge refused a request, died or did not answer in time."""


class BridgeClient:
    """`SkyClient` over bridge.py in SkyPilot's own interpreter. Started lazily, and
    again after it died; one request at a time (the provider's background thread, and `stop`).
    In a session of its own: a Ctrl-C or SIGTERM to the learner's process group does not end it
    before the learner's `stop` has used it; it ends when its stdin closes (the learner's exit)."""

    def __init__(
        self,
        python: str,
        *,
        timeout: float = 120.0,
        env: dict[str, str] | None = None,
        bridge: Path = BRIDGE,
    ) -> None:
        self.python = os.path.expanduser(python)
        self.timeout = timeout
        """Seconds one round trip may take (a launch uploads its task; none waits on a cloud)."""
        self.env = env if env is not None else bridge_env()
        self.bridge = bridge
        self.secrets: set[str] = set()
        """Values redacted from the bridge's stderr as it is logged."""
        self._proc: subprocess.Popen | None = None
        self._replies: queue.Queue = queue.Queue()
        self._next = 0
        self._lock = threading.Lock()
        self.version: dict | None = None
        self._status_requests: set[str] = set()
        """Status requests in flight: their outcome's value is read as {cluster: status}."""

    # ------------------------------------------------------------------ the process
    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen(
            [self.python, str(self.bridge)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=self.env,
            start_new_session=True,  # Ctrl-C on the learner must leave it to tear the fleet down
        )
        replies: queue.Queue = queue.Queue()
        self._proc, self._replies = proc, replies
        threading.Thread(target=self._read, args=(proc, replies), name="sky-bridge-out", daemon=True).start()
        threading.Thread(target=self._log, args=(proc,), name="sky-bridge-err", daemon=True).start()
        logger.info("skypilot bridge started: %s %s (pid %d)", self.python, self.bridge.name, proc.pid)
        return proc

    @staticmethod
    def _read(proc: subprocess.Popen, replies: queue.Queue) -> None:
        for line in proc.stdout:
            try:
                replies.put(json.loads(line))
            except ValueError:
                logger.warning("skypilot bridge: not a reply: %.200r", line)
        replies.put(None)  # the bridge ended

    def _log(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            text = line.rstrip()
            for s in tuple(self.secrets):  # a copy: a launch may add one meanwhile
                text = text.replace(s, "<redacted>")
            if text.startswith("<sky-payload>"):  # SkyPilot's spinner updates for a terminal
                logger.debug("sky: %s", text)
            elif text:
                logger.info("sky: %s", text)

    def call(self, op: str, **args: Any) -> Any:
        """One request and its reply's value; BridgeError when refused, or the bridge died or
        did not answer within `timeout` (then it is killed and started again on the next call)."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                proc = self._start()
            self._next += 1
            rid = self._next
            try:
                proc.stdin.write(json.dumps({"id": rid, "op": op, **args}) + "\n")
                proc.stdin.flush()
            except OSError as e:
                self._kill()
                raise BridgeError(f"skypilot bridge: {op}: cannot write: {e}") from None
            while True:
                try:
                    reply = self._replies.get(timeout=self.timeout)
                except queue.Empty:
                    self._kill()
                    raise BridgeError(f"skypilot bridge: {op}: no answer in {self.timeout:.0f}s") from None
                if reply is None:
                    self._kill()
                    raise BridgeError(f"skypilot bridge: {op}: the bridge exited ({proc.poll()})")
                if reply.get("id") == rid:
                    break  # an older reply (a call that timed out) is dropped
        if not reply.get("ok"):
            raise BridgeError(f"skypilot bridge: {op}: {reply.get('error', 'refused')}")
        return reply.get("value")

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """End the bridge (its stdin closed: it exits after its last reply)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()

    # ------------------------------------------------------------------ SkyClient
    def hello(self) -> dict:
        self.version = self.call("hello")
        return self.version

    def validate(self, task: dict, *, token: str) -> dict:
        """SkyPilot's validated task (a summary; its YAML form redacted), launching nothing (the slot
        secret is a placeholder: no slot starts)."""
        self.secrets.add(token)
        return self.call("validate", task=task, secrets={TOKEN_ENV: token, SLOT_SECRET_ENV: "validate"})

    def launch(
        self, task: dict, *, token: str, slot_secret: str, cluster_name: str, idle_minutes: int
    ) -> str:
        self.secrets.update((token, slot_secret))
        return self.call(
            "launch",
            task=task,
            secrets={TOKEN_ENV: token, SLOT_SECRET_ENV: slot_secret},
            cluster_name=cluster_name,
            idle_minutes=idle_minutes,
        )

    def down(self, cluster_name: str) -> str:
        return self.call("down", cluster_name=cluster_name)

    def status(self, cluster_names: list[str]) -> str:
        rid = self.call("status", cluster_names=cluster_names)
        self._status_requests.add(rid)
        return rid

    def poll(self, request_id: str) -> Outcome | None:
        kind = "status" if request_id in self._status_requests else "other"
        reply = self.call("poll", request_id=request_id, kind=kind)
        if not reply.get("done"):
            return None
        self._status_requests.discard(request_id)
        return Outcome(ok=bool(reply.get("ok")), value=reply.get("value"), error=reply.get("error") or "")

    def cancel(self, request_id: str) -> None:
        self.call("cancel", request_id=request_id)
