"""The SkyPilot bridge's protocol (skypilot_bridge.py, driven by skypilot_client.BridgeClient).

The bridge runs as in production (by path, as its own process), but with a FAKE `sky` module
(tests/fixtures/skypilot_fake_sky, first on its path) in place of SkyPilot: these tests show what
the bridge asks of the SDK and what it answers, not what SkyPilot does. test_skypilot_task.py
runs the same bridge against SkyPilot itself (scripts/test_skypilot.sh).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from echo2.config import ConfigError
from echo2.fleet.providers.skypilot.client import (
    BRIDGE,
    BridgeClient,
    BridgeError,
    Outcome,
    bridge_env,
    check_python,
)
from echo2.fleet.providers.skypilot.provider import SkyPilotFleet, make_fleet
from echo2.fleet.providers.skypilot.task import SLOT_SECRET_ENV, TOKEN_ENV, task_config

sys.path.insert(0, str(Path(__file__).parent))
from test_skypilot import sky_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FAKE_SKY = ROOT / "tests" / "fixtures" / "skypilot_fake_sky"
TOKEN = "tok-77aa-never-in-a-log"


def fake_env(tmp_path, **fake) -> dict[str, str]:
    env = bridge_env([str(FAKE_SKY)])
    env["FAKE_SKY_LOG"] = str(tmp_path / "sky.jsonl")
    env.update({f"FAKE_SKY_{k.upper()}": str(v) for k, v in fake.items()})
    return env


def journal(tmp_path) -> list[list]:
    path = tmp_path / "sky.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def client(tmp_path):
    c = BridgeClient(sys.executable, env=fake_env(tmp_path), timeout=60)
    yield c
    c.close()


def _task(slot="vast-4090-spot-0"):
    config = sky_config()
    return task_config(config.workers[0], config, slot=slot, learner_key="fp")


# ---------------------------------------------------------------------------- the bridge file
def test_the_bridge_imports_only_the_standard_library_and_sky():
    tree = ast.parse(BRIDGE.read_text())
    names = {
        (a.name if isinstance(node, ast.Import) else node.module).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for a in (node.names if isinstance(node, ast.Import) else [node])
    }
    assert names - set(sys.stdlib_module_names) == {"sky"}


def test_the_task_is_a_pure_yaml_style_dict_without_the_token():
    task = _task()
    assert json.loads(json.dumps(task)) == task
    assert task["secrets"] == {TOKEN_ENV: None, SLOT_SECRET_ENV: None}
    assert task["resources"]["autostop"] == {"idle_minutes": 10, "down": True}
    assert task["resources"]["infra"] == "vast" and task["resources"]["use_spot"] is True
    assert task["run"].startswith("echo2 worker --coordinator https://learner.example:8765 --name ")
    two = sky_config().workers[0].model_copy(update={"infra": ["vast", "runpod"]})
    assert task_config(two, sky_config(), slot="a-0")["resources"]["any_of"] == [
        {"infra": "vast"},
        {"infra": "runpod"},
    ]


# ---------------------------------------------------------------------------- the protocol (FAKE sky)
def test_launch_sends_the_task_and_the_secret_and_polls_without_waiting(tmp_path):
    client = BridgeClient(sys.executable, env=fake_env(tmp_path, delay=2), timeout=60)
    try:
        assert client.hello()["sky"] == "0.0-FAKE"
        rid = client.launch(_task(), token=TOKEN, slot_secret="s3", cluster_name="echo2-a-0", idle_minutes=7)
        assert client.poll(rid) is None and client.poll(rid) is None  # running: no `get`
        assert client.poll(rid) == Outcome(ok=True)
        sid = client.status(["echo2-a-0", "echo2-b-0"])
        for _ in range(3):
            outcome = client.poll(sid)
        assert outcome == Outcome(ok=True, value={"echo2-a-0": "UP"})
        assert client.poll(client.down("echo2-a-0")) is None
    finally:
        client.close()
    events = journal(tmp_path)
    built = next(e for e in events if e[0] == "from_yaml_config")
    both = sorted([TOKEN_ENV, SLOT_SECRET_ENV])
    assert built[1]["secrets"] == dict.fromkeys(both) and sorted(built[2]) == both  # filled by the bridge
    assert ["validate", "vast-4090-spot-0", True, True] in events
    launch = next(e for e in events if e[0] == "launch")
    assert (
        launch[1:4] == ["echo2-a-0", 7, True] and sorted(launch[4]) == both
    )  # autodown after 7 idle minutes
    assert launch[5] == []  # the bridge imported no echo2, torch nor transformers
    assert ["status", ["echo2-a-0", "echo2-b-0"], "AUTO"] in events
    gets = [e[1] for e in events if e[0] == "get"]
    assert rid in gets and gets.count(rid) == 1  # read once, when finished


def test_failures_are_outcomes_and_a_forgotten_request_is_a_failure(client, tmp_path):
    client.env["FAKE_SKY_FAIL"] = "echo2-a-0"
    rid = client.launch(_task(), token=TOKEN, slot_secret="s3", cluster_name="echo2-a-0", idle_minutes=7)
    outcome = client.poll(rid)
    assert not outcome.ok and outcome.error.startswith("ResourcesUnavailableError: no capacity")
    assert TOKEN not in outcome.error  # the fake put it in its message; the bridge redacts it
    gone = client.poll("fake-req-999")
    assert not gone.ok and "unknown to the SkyPilot API server" in gone.error
    down = client.poll(client.down("echo2-never-launched"))
    assert not down.ok and "ClusterDoesNotExist" in down.error  # the provider reads it as down
    client.cancel(rid)
    assert ["api_cancel", rid] in journal(tmp_path)
    with pytest.raises(BridgeError, match="unknown op"):
        client.call("nonsense")


def test_the_token_reaches_no_command_line_environment_stdout_or_stderr(tmp_path, caplog):
    env = fake_env(tmp_path)
    assert TOKEN_ENV not in bridge_env()  # the learner's own $ECHO2_TOKEN is not passed on
    msg = {"id": 1, "op": "launch", "task": _task(), "secrets": {TOKEN_ENV: TOKEN}}
    msg.update(cluster_name="echo2-a-0", idle_minutes=5)
    out = subprocess.run(
        [sys.executable, str(BRIDGE)], input=json.dumps(msg) + "\n", capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    [reply] = [json.loads(line) for line in out.stdout.splitlines()]  # only the protocol on stdout
    assert reply["id"] == 1 and reply["ok"] and reply["value"].startswith("fake-req-")
    assert "FAKE sky: launching" in out.stderr and "fd 1" in out.stderr  # SkyPilot's output: stderr
    assert TOKEN not in out.stderr and "<redacted>" in out.stderr
    with caplog.at_level("INFO"):  # through the client, the bridge's stderr is logged
        client = BridgeClient(sys.executable, env=env, timeout=60)
        try:
            client.poll(
                client.launch(
                    _task(), token=TOKEN, slot_secret="s3", cluster_name="echo2-a-0", idle_minutes=5
                )
            )
        finally:
            client.close()
    assert "FAKE sky: launching" in caplog.text and TOKEN not in caplog.text


def test_a_bridge_that_dies_is_an_error_then_started_again(client):
    client.hello()
    assert os.getpgid(client._proc.pid) != os.getpgid(0)  # a Ctrl-C to the learner spares it
    client._proc.kill()
    client._proc.wait()
    assert client.hello()["sky"] == "0.0-FAKE"  # a dead bridge is started again on the next call
    stuck = BridgeClient(sys.executable, env={**client.env, "PYTHONPATH": str(FAKE_SKY)}, timeout=0.5)
    stuck.bridge = Path(__file__).with_name("nonexistent_bridge.py")
    with pytest.raises(BridgeError, match="exited"):
        stuck.hello()


# ---------------------------------------------------------------------------- config: the interpreter
def test_the_interpreter_must_be_configured_and_import_sky(tmp_path):
    with pytest.raises(ConfigError, match=r"scheduler\.skypilot\.python: required"):
        check_python(None)
    with pytest.raises(ConfigError, match=r"scheduler\.skypilot\.python: cannot run"):
        check_python(str(tmp_path / "no-such-python"))
    with pytest.raises(ConfigError, match=r"scheduler\.skypilot\.python: .* cannot import sky"):
        check_python(sys.executable, env=bridge_env([str(tmp_path)]))  # echo2's venv: no sky
    assert check_python(sys.executable, env=fake_env(tmp_path))["sky"] == "0.0-FAKE"


def test_make_fleet_checks_the_interpreter_and_starts_no_bridge(monkeypatch, tmp_path):
    run = SimpleNamespace(threads=3)
    missing = SimpleNamespace(scheduler=SimpleNamespace(skypilot=sky_config()), run=run)
    with pytest.raises(ConfigError, match=r"scheduler\.skypilot\.python"):
        make_fleet(missing, initial=1)
    monkeypatch.setenv("PYTHONPATH", "ignored")  # the learner's path is not the bridge's
    monkeypatch.setattr("echo2.fleet.providers.skypilot.provider.check_python", lambda python: {"sky": "x"})
    config = SimpleNamespace(scheduler=SimpleNamespace(skypilot=sky_config(python=sys.executable)), run=run)
    fleet = make_fleet(config, initial=1)
    assert isinstance(fleet, SkyPilotFleet) and fleet.client is None and fleet.learner_threads == 3


def test_the_provider_over_the_bridge_launches_and_tears_everything_down(tmp_path):
    """The provider with its real client, the bridge as a process, and the FAKE sky behind it."""
    client = BridgeClient(sys.executable, env=fake_env(tmp_path), timeout=60)
    fleet = SkyPilotFleet(sky_config(poll_s=0.01, python=sys.executable), initial=2, client=client)
    fleet.start(SimpleNamespace(token=TOKEN, fingerprint="fp"), poll_in_background=False)
    for _ in range(4):
        fleet.tick()
    assert {o.name for o in fleet.running()} == {"vast-4090-spot-0", "runpod-4090-od-0"}
    fleet.stop(grace=30)
    assert client._proc is None  # the bridge ended with the fleet
    events = journal(tmp_path)
    launched = {e[1] for e in events if e[0] == "launch"}
    assert launched == {"echo2-vast-4090-spot-0", "echo2-runpod-4090-od-0"}
    assert {e[1] for e in events if e[0] == "down"} == launched
    assert all(not s.launched for s in fleet.slots.values())
