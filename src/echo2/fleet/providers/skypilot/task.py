"""The SkyPilot task of one rented worker, as the YAML-style dict `sky launch task.yaml` reads.

Pure: echo2 never imports sky in the learner's process. The bridge (bridge.py, run by
SkyPilot's own interpreter) turns this dict into a `sky.Task` with `sky.Task.from_yaml_config`,
validates it and launches it. The worker's bearer token and its slot's secret are not in the dict:
the task declares the secrets `ECHO2_TOKEN` and `ECHO2_SLOT_SECRET` without a value and the bridge
fills them in from the launch request
(`secrets_overrides`, as `sky launch --secret` does), so it is on no command line, in no YAML
SkyPilot prints and in nothing this module returns.
"""

from __future__ import annotations

from typing import Any

from echo2.config import SkyPilotConfig, SkyPilotWorkerConfig
from echo2.wire import identity

TOKEN_ENV = "ECHO2_TOKEN"
"""The secret the worker reads its bearer token from (`echo2 worker --token` defaults to it)."""
SLOT_SECRET_ENV = identity.SLOT_SECRET_ENV
"""The secret the worker proves its slot with when it registers (a fresh one per launch)."""


def worker_command(worker: SkyPilotWorkerConfig, *, slot: str, url: str, learner_key: str | None) -> str:
    """The task's run command: no secret in it (the token is in $ECHO2_TOKEN)."""
    acc = f"{worker.accelerator}:{worker.accelerator_count}"
    cmd = (
        f"echo2 worker --coordinator {url} --name {slot} --price-per-hour {worker.price} --hardware {acc} -q"
    )
    if learner_key:
        cmd += f" --learner-key {learner_key}"
    return cmd


def resources_config(worker: SkyPilotWorkerConfig, config: SkyPilotConfig) -> dict[str, Any]:
    """The task's `resources`: one candidate per `infra` entry under `any_of` (an unordered set:
    SkyPilot's optimizer takes the cheapest with capacity; none: any enabled cloud), each with
    autodown after `autostop_minutes` idle."""
    common: dict[str, Any] = {
        "accelerators": {worker.accelerator: worker.accelerator_count},
        "use_spot": worker.spot,
        "autostop": {"idle_minutes": config.autostop_minutes, "down": True},
        "labels": {"echo2-worker-type": worker.name},
    }
    if worker.disk_gb is not None:
        common["disk_size"] = worker.disk_gb
    if worker.image is not None:
        common["image_id"] = worker.image
    if not worker.infra:
        return common
    if len(worker.infra) == 1:
        return {**common, "infra": worker.infra[0]}
    return {**common, "any_of": [{"infra": i} for i in worker.infra]}


def task_config(
    worker: SkyPilotWorkerConfig,
    config: SkyPilotConfig,
    *,
    slot: str,
    learner_key: str | None = None,
) -> dict[str, Any]:
    """The YAML-style task of one worker of `worker`'s type (slot NAME-i); JSON-serialisable.
    The secrets `ECHO2_TOKEN` and `ECHO2_SLOT_SECRET` are declared with no value: the bridge sets
    them at launch."""
    return {
        "name": slot,
        "resources": resources_config(worker, config),
        "setup": config.install,
        "run": worker_command(worker, slot=slot, url=config.coordinator_url, learner_key=learner_key),
        "secrets": {TOKEN_ENV: None, SLOT_SECRET_ENV: None},
    }
