"""The SkyPilot bridge: SkyPilot's SDK in an interpreter of its own, driven over JSON lines.

SkyPilot pins versions echo2's own dependencies refuse (skypilot 0.14 wants click<8.2; the
huggingface-hub that transformers needs wants click>=8.4), so it lives in a venv of its own and
the learner never imports it. The provider (client.py) starts this file BY PATH with
`scheduler.skypilot.python`:

    ~/.venvs/sky/bin/python .../echo2/fleet/providers/skypilot/bridge.py

It imports only the standard library and `sky` (never echo2, torch or transformers). Each line
on stdin is one request, {"id": N, "op": OP, ...}; each line on stdout its reply,
{"id": N, "ok": true, "value": ...} or {"id": N, "ok": false, "error": "..."}. The ops:

    hello                                       -> {"sky": version, "python": version}
    validate  task, secrets                     -> a summary of the validated sky.Task
    launch    task, secrets, cluster_name, idle_minutes -> request id (autodown)
    down      cluster_name                      -> request id
    status    cluster_names                     -> request id
    poll      request_id, kind                  -> {"done": false} or
                                                   {"done": true, "ok": ..., "value": ..., "error": ...}
    cancel    request_id                        -> null

`task` is the YAML-style dict echo2 builds (task.py); `secrets` fills the secrets it
declares (`sky.Task.from_yaml_config(..., secrets_overrides=...)`). A secret value never leaves
this process in a reply or on stderr: both are redacted. Every SDK call returns at once (SkyPilot's
requests are asynchronous; `poll` reads a finished one only). SkyPilot's own output goes to stderr,
so stdout carries the protocol alone. `--check` prints the versions and exits (0, or 3 when sky
cannot be imported).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
# run by path, Python puts this file's directory first on sys.path: its neighbours (http.py, ...)
# would shadow the standard library's modules of the same names inside sky
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import json  # noqa: E402

FINISHED = ("SUCCEEDED", "FAILED", "CANCELLED")
"""SkyPilot's request statuses after which `sky.get` returns (or raises) at once."""


class Redacting:
    """A text stream that writes through with every known secret value replaced."""

    def __init__(self, stream, secrets):
        self.stream, self.secrets = stream, secrets

    def write(self, text):
        return self.stream.write(redact(str(text), self.secrets))

    def flush(self):
        self.stream.flush()

    def isatty(self):
        return False

    def fileno(self):
        return self.stream.fileno()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def redact(text, secrets):
    for value in secrets:
        if value:
            text = text.replace(value, "<redacted>")
    return text


def _value(record, key):
    value = record[key] if isinstance(record, dict) else getattr(record, key)
    return getattr(value, "value", value)


class Bridge:
    """The ops, over the `sky` module given (the real one, or a test's fake placed first on the path)."""

    def __init__(self, sky, secrets):
        self.sky = sky
        self.secrets = secrets
        """Every secret value seen: redacted from replies and stderr."""

    def task(self, msg):
        secrets = msg.get("secrets") or {}
        self.secrets.update(str(v) for v in secrets.values() if v)
        task = self.sky.Task.from_yaml_config(
            dict(msg["task"]), secrets_overrides=[(str(k), str(v)) for k, v in secrets.items()]
        )
        task.validate(skip_file_mounts=True, skip_workdir=True)
        return task

    def op_hello(self, msg):
        return {"sky": getattr(self.sky, "__version__", "unknown"), "python": sys.version.split()[0]}

    def op_validate(self, msg):
        task = self.task(msg)
        return {
            "name": task.name,
            "setup": task.setup,
            "run": task.run,
            "secrets": sorted(task.secrets),
            "envs": sorted(task.envs),
            "resources": [
                {
                    "cloud": None if r.cloud is None else str(r.cloud),
                    "accelerators": r.accelerators,
                    "use_spot": r.use_spot,
                    "disk_size": r.disk_size,
                    "image_id": r.image_id,
                    "autostop": None
                    if r.autostop_config is None
                    else {
                        "enabled": r.autostop_config.enabled,
                        "idle_minutes": r.autostop_config.idle_minutes,
                        "down": r.autostop_config.down,
                    },
                }
                for r in sorted(task.resources, key=lambda r: str(r.cloud))
            ],
            "yaml": task.to_yaml_config(use_user_specified_yaml=True),  # SkyPilot's redacted form
        }

    def op_launch(self, msg):
        task = self.task(msg)
        rid = self.sky.launch(
            task, cluster_name=msg["cluster_name"], idle_minutes_to_autostop=msg["idle_minutes"], down=True
        )
        return str(rid)

    def op_down(self, msg):
        return str(self.sky.down(msg["cluster_name"]))

    def op_status(self, msg):
        rid = self.sky.status(cluster_names=msg["cluster_names"], refresh=self.sky.StatusRefreshMode.AUTO)
        return str(rid)

    def op_poll(self, msg):
        rid = msg["request_id"]
        found = self.sky.api_status(request_ids=[rid])
        if not found:  # purged, or the API server restarted without it
            return {"done": True, "ok": False, "error": f"request {rid} unknown to the SkyPilot API server"}
        if str(_value(found[0], "status")) not in FINISHED:
            return {"done": False}
        try:
            value = self.sky.get(rid)  # finished: returns (or raises) at once
        except Exception as e:  # the request's own error (no capacity, quota, auth)
            return {"done": True, "ok": False, "error": f"{type(e).__name__}: {e}"}
        if msg.get("kind") == "status":  # StatusResponse records -> {cluster: status}
            value = {_value(r, "name"): str(_value(r, "status")) for r in value or []}
        else:  # launch: (job id, handle); down: None. The handle is not for echo2.
            value = None
        return {"done": True, "ok": True, "value": value}

    def op_cancel(self, msg):
        self.sky.api_cancel(msg["request_id"])
        return None

    def handle(self, line):
        msg = {}
        try:
            msg = json.loads(line)
            op = getattr(self, "op_" + str(msg.get("op")), None)
            if op is None:
                raise ValueError(f"unknown op {msg.get('op')!r}")
            reply = {"id": msg.get("id"), "ok": True, "value": op(msg)}
        except Exception as e:  # one request's failure is its reply, not the bridge's end
            reply = {"id": msg.get("id"), "ok": False, "error": f"{type(e).__name__}: {e}"}
        return redact(json.dumps(reply, default=str), self.secrets)


def main(argv):
    secrets = set()
    if "--check" in argv[1:]:
        try:
            import sky
        except Exception as e:
            print(f"{type(e).__name__}: {e}", file=sys.stderr)
            return 3
        print(json.dumps(Bridge(sky, secrets).op_hello({})))
        return 0
    # stdout is the protocol's alone: SkyPilot's prints and its children's output go to stderr
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr = Redacting(sys.__stderr__, secrets)  # before sky makes its log handlers
    import sky

    bridge = Bridge(sky, secrets)
    for line in sys.stdin:
        if line.strip():
            proto.write(bridge.handle(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
