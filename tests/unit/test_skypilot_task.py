"""The SkyPilot task of every worker type, built and validated by SkyPilot itself, through the bridge.

The real bridge (skypilot_bridge.py, run by path) under SkyPilot's own interpreter, with SkyPilot's
own `Task.from_yaml_config`, `Task.validate` and `Resources`, no cloud and no network: SkyPilot reads
its catalog from a copy of tests/fixtures/skypilot_catalog (SKY_RUNTIME_DIR of the bridge).
The interpreter is $ECHO2_TEST_SKY_PYTHON (scripts/test_skypilot.sh makes .venv-sky and sets it):
skipped without it, since SkyPilot cannot be installed in echo2's own venv.
"""

from __future__ import annotations

import os
import re
import shutil
import tomllib
from pathlib import Path

import pytest

from echo2.config import build_config
from echo2.fleet.providers.skypilot.client import BridgeClient, bridge_env, check_python
from echo2.fleet.providers.skypilot.provider import SkyPilotFleet, make_fleet
from echo2.fleet.providers.skypilot.task import SLOT_SECRET_ENV, TOKEN_ENV, task_config

ROOT = Path(__file__).resolve().parents[2]
CATALOG = ROOT / "tests" / "fixtures" / "skypilot_catalog"
SKY_PYTHON = os.environ.get("ECHO2_TEST_SKY_PYTHON")
TOKEN = "tok-3f9c-not-for-logs"

pytestmark = pytest.mark.skipif(
    not SKY_PYTHON, reason="$ECHO2_TEST_SKY_PYTHON: a python with SkyPilot (scripts/test_skypilot.sh)"
)


@pytest.fixture(scope="module")
def sky(tmp_path_factory):
    """The bridge under SkyPilot's interpreter, its catalog the shipped one, its home a temp dir."""
    home = tmp_path_factory.mktemp("sky-home")
    shutil.copytree(CATALOG, home / ".sky" / "catalogs" / "v8")
    env = {**bridge_env(), "HOME": str(home), "SKY_RUNTIME_DIR": str(home)}
    client = BridgeClient(SKY_PYTHON, env=env, timeout=120)
    yield client
    client.close()


def fleet_config():
    """The config of docs/fleet.md (its first ```toml block), validated as a whole run config."""
    block = re.search(r"```toml\n(.*?)```", (ROOT / "docs" / "fleet.md").read_text(), re.S).group(1)
    return build_config(tomllib.loads(block), [])


def test_the_bridge_runs_skypilot_0_14(sky):
    assert sky.hello()["sky"].startswith("0.14.")
    assert check_python(SKY_PYTHON)["sky"] == sky.version["sky"]


def test_every_worker_type_of_the_docs_config_builds_a_valid_skypilot_task(sky):
    config = fleet_config()
    sp = config.scheduler.skypilot
    assert config.scheduler.provider == "skypilot" and len({i for w in sp.workers for i in w.infra}) >= 2
    for worker in sp.workers:
        slot = f"{worker.name}-0"
        task = sky.validate(task_config(worker, sp, slot=slot, learner_key="fp"), token=TOKEN)
        assert task["name"] == slot
        assert task["setup"] == sp.install
        assert task["run"].startswith(f"echo2 worker --coordinator {sp.coordinator_url} --name {slot} ")
        assert task["secrets"] == sorted([SLOT_SECRET_ENV, TOKEN_ENV]) and TOKEN_ENV not in task["envs"]
        assert len(task["resources"]) == len(worker.infra)
        for r in task["resources"]:
            assert r["accelerators"] == {worker.accelerator: worker.accelerator_count}
            assert r["use_spot"] is worker.spot
            assert r["cloud"].lower() in worker.infra
            assert r["autostop"] == {"enabled": True, "idle_minutes": sp.autostop_minutes, "down": True}
            if worker.disk_gb:
                assert r["disk_size"] == worker.disk_gb


def test_the_token_is_a_secret_never_in_the_task_nor_in_what_skypilot_prints(sky):
    sp = fleet_config().scheduler.skypilot
    config = task_config(sp.workers[0], sp, slot="w-0")
    assert TOKEN not in str(config)
    task = sky.validate(config, token=TOKEN)
    assert task["secrets"] == sorted([SLOT_SECRET_ENV, TOKEN_ENV])
    assert TOKEN not in str(task)  # the run line, the setup, SkyPilot's YAML form of the task
    assert task["yaml"]["secrets"] == {TOKEN_ENV: None, SLOT_SECRET_ENV: None}


def test_several_infra_entries_let_skypilot_choose_and_none_means_any_cloud(sky):
    sp = fleet_config().scheduler.skypilot
    two = sp.workers[0].model_copy(update={"infra": ["runpod", "vast"]})
    task = sky.validate(task_config(two, sp, slot="w-0"), token=TOKEN)
    assert [r["cloud"] for r in task["resources"]] == ["RunPod", "Vast"]
    anywhere = sky.validate(task_config(two.model_copy(update={"infra": []}), sp, slot="w-0"), token=TOKEN)
    [r] = anywhere["resources"]
    assert r["cloud"] is None and r["accelerators"] == {two.accelerator: 1}


def test_a_request_the_api_server_does_not_know_is_a_failed_outcome(sky):
    outcome = sky.poll("no-such-request")  # offline: no API server runs, and none is started
    assert not outcome.ok and "unknown to the SkyPilot API server" in outcome.error


def test_make_fleet_builds_the_provider_api_py_runs_from_the_run_config():
    config = fleet_config()
    config = config.model_copy(
        update={
            "scheduler": config.scheduler.model_copy(
                update={"skypilot": config.scheduler.skypilot.model_copy(update={"python": SKY_PYTHON})}
            )
        }
    )
    fleet = make_fleet(config, initial=config.scheduler.initial_workers)
    assert isinstance(fleet, SkyPilotFleet) and fleet.client is None  # no bridge before start()
    assert fleet.initial == 4 and fleet.learner_threads == config.run.threads
    assert sorted(fleet.slots)[:2] == ["rtx4090-spot-0", "rtx4090-spot-1"]
