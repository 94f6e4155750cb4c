"""The SkyPilot task of every worker type, built and validated by SkyPilot's own `Task` and
`Resources` classes, with no cloud and no network: SkyPilot reads its catalog from a copy of
tests/fixtures/skypilot_catalog (SKY_RUNTIME_DIR, set before sky is imported). Skipped when the
`skypilot` extra is not installed.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CATALOG = ROOT / "tests" / "fixtures" / "skypilot_catalog"

if "sky" not in sys.modules:  # SkyPilot fixes its catalog directory when it is imported
    _home = Path(tempfile.mkdtemp(prefix="echo2-sky-"))
    shutil.copytree(CATALOG, _home / ".sky" / "catalogs" / "v8", copy_function=shutil.copy)
    os.environ["SKY_RUNTIME_DIR"] = str(_home)
    atexit.register(shutil.rmtree, _home, True)

sky = pytest.importorskip("sky")

from echo2.config import build_config  # noqa: E402
from echo2.control.skypilot import TOKEN_ENV, build_task  # noqa: E402

TOKEN = "tok-3f9c-not-for-logs"


def fleet_config():
    """The config of docs/fleet.md (its first ```toml block), validated as a whole run config."""
    text = (ROOT / "docs" / "fleet.md").read_text()
    block = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    import tomllib

    return build_config(tomllib.loads(block), [])


def test_every_worker_type_of_the_docs_config_builds_a_valid_skypilot_task():
    config = fleet_config()
    sp = config.scheduler.skypilot
    assert config.scheduler.provider == "skypilot" and len({i for w in sp.workers for i in w.infra}) >= 2
    for worker in sp.workers:
        slot = f"{worker.name}-0"
        task = build_task(worker, sp, slot=slot, token=TOKEN, learner_key="fp")
        task.validate(skip_file_mounts=True, skip_workdir=True)
        assert task.name == slot
        assert task.setup == sp.install
        assert task.run.startswith(f"echo2 worker --coordinator {sp.coordinator_url} --name {slot} ")
        assert len(task.resources) == len(worker.infra)
        for r in task.resources:
            assert r.accelerators == {worker.accelerator: worker.accelerator_count}
            assert r.use_spot is worker.spot
            assert str(r.cloud).lower() in worker.infra
            assert r.autostop_config.enabled and r.autostop_config.down
            assert r.autostop_config.idle_minutes == sp.autostop_minutes
            if worker.disk_gb:
                assert r.disk_size == worker.disk_gb
        # SkyPilot takes the task back from its own YAML form (what `sky launch task.yaml` reads)
        again = sky.Task.from_yaml_config(task.to_yaml_config())
        again.validate(skip_file_mounts=True, skip_workdir=True)
        assert again.run == task.run


def test_the_token_is_a_secret_never_on_the_command_line_nor_in_printed_forms():
    sp = fleet_config().scheduler.skypilot
    task = build_task(sp.workers[0], sp, slot="w-0", token=TOKEN)
    assert {k: v.get_secret_value() for k, v in task.secrets.items()} == {TOKEN_ENV: TOKEN}
    assert TOKEN not in task.run and TOKEN not in task.setup and TOKEN_ENV not in task.envs
    assert TOKEN not in repr(task)
    assert TOKEN not in str(task.to_yaml_config(use_user_specified_yaml=True))  # SkyPilot's redacted form


def test_several_infra_entries_let_skypilot_choose_and_none_means_any_cloud():
    sp = fleet_config().scheduler.skypilot
    two = sp.workers[0].model_copy(update={"infra": ["runpod", "vast"]})
    task = build_task(two, sp, slot="w-0", token=TOKEN)
    assert {str(r.cloud) for r in task.resources} == {"RunPod", "Vast"}
    anywhere = build_task(two.model_copy(update={"infra": []}), sp, slot="w-0", token=TOKEN)
    [r] = anywhere.resources
    assert r.cloud is None and r.accelerators == {two.accelerator: 1}


def test_make_fleet_builds_the_provider_api_py_runs_from_the_run_config():
    from echo2.control.skypilot import SkyPilotFleet, make_fleet

    config = fleet_config()
    fleet = make_fleet(config, initial=config.scheduler.initial_workers)
    assert isinstance(fleet, SkyPilotFleet) and fleet.client is None  # no SDK call before start()
    assert fleet.initial == 4 and fleet.learner_threads == config.run.threads
    assert sorted(fleet.slots)[:2] == ["rtx4090-spot-0", "rtx4090-spot-1"]
