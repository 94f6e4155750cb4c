"""The learner's coordinator assembled from the run's config: each part gets its section.

`coordinator_state` builds the state (`[coordinator]`'s limits and timeouts, `[scheduler]`,
`[broadcast]`'s policy, the task's referee), `coordinator` the HTTP service over it (not started,
telling workers the run as `protocol.RunView.of` has it), `token` the workers' bearer token. Pure
construction: nothing here binds, starts a thread or writes a file (learning/sources/remote.py's `start`
does). Knows nothing of training.
"""

from __future__ import annotations

import os
import secrets
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from echo2.broadcast.tracker import BroadcastPolicy
from echo2.config import Config, ConfigError, CoordinatorConfig
from echo2.coordinator.leases import Limits, Work
from echo2.coordinator.server import Coordinator
from echo2.coordinator.state import CoordinatorState
from echo2.data.buffer import ReplayBuffer
from echo2.data.envs import response_limit
from echo2.data.tasks.base import Task
from echo2.fleet.scheduler import Scheduler
from echo2.records import Trajectory
from echo2.wire.protocol import RunView


def coordinator_state(
    config: Config,
    *,
    task: Task,
    buffer: ReplayBuffer,
    vocab_size: int,
    tokenizer,
    provider,
    target: Callable[[], float | None],
    journal: Callable[[list[Trajectory], dict[str, int]], None] | None,
    signing_key: Ed25519PrivateKey,
) -> CoordinatorState:
    """The coordinator's state for this run: `[coordinator]`'s limits and timeouts, `[scheduler]`,
    `[broadcast]`'s policy, the task's referee (with `tokenizer`) and the learner's signing key."""
    from echo2.learning.verify import TaskReferee
    from echo2.wire.validate import reward_range

    ccfg, scfg, bc = config.coordinator, config.scheduler, config.broadcast
    return CoordinatorState(
        ccfg,
        work=Work(
            buffer=buffer,
            limits=Limits(
                vocab_size=vocab_size,
                max_prompt_tokens=config.rollout.max_prompt_tokens,
                max_new_tokens=response_limit(config),
                group_size=config.rollout.group_size,
                reward_range=reward_range(task),
            ),
            groups_per_step=config.rollout.prompts_per_step,
            group_id_of=lambda i: task.train_prompt(i).group_id,
        ),
        referee=TaskReferee(task, tokenizer, max_new_tokens=config.rollout.max_new_tokens)
        if tokenizer is not None
        else None,
        scheduler=Scheduler(sustain_s=scfg.sustain_s, release_margin=scfg.release_margin)
        if scfg.enabled
        else None,
        target=target,
        window_s=scfg.window_s,
        provider=provider,
        broadcast=BroadcastPolicy(
            mode=bc.mode,
            chunk_size=bc.chunk_bytes,
            uplink_budget_bps=bytes_per_s(bc.uplink_budget_mbps or bc.uplink_mbps),
            worker_bps=bc.worker_mbps * 1e6 / 8,
            slow_relay_fraction=bc.slow_relay_fraction,
            delta=bc.delta,
        ),
        signing_key=signing_key,
        journal=journal,
    )


def coordinator(
    config: Config, state: CoordinatorState, *, token: str, status_extra: Callable[[], dict[str, Any]]
) -> Coordinator:
    """The HTTP service over `state` (not started): `[coordinator]`'s heartbeat interval, TLS and
    relay rule, `[broadcast]`'s uplink caps; `status_extra` adds the learner's figures to GET /status."""
    ccfg, bc = config.coordinator, config.broadcast
    return Coordinator(
        state,
        token=token,
        run_info=RunView.of(config),
        heartbeat_interval=ccfg.heartbeat_interval,
        status_extra=status_extra,
        uplink_bps=bytes_per_s(bc.uplink_mbps),
        stream_bps=bytes_per_s(bc.learner_stream_mbps),
        ssl_context=tls(ccfg.tls_cert, ccfg.tls_key),
        any_relay_host=ccfg.any_relay_host,
    )


def token(ccfg: CoordinatorConfig) -> tuple[str, str | None]:
    """The workers' bearer token and where it came from (None: generated here)."""
    if ccfg.token:
        return ccfg.token, "coordinator.token"
    if os.environ.get("ECHO2_TOKEN"):
        return os.environ["ECHO2_TOKEN"], "$ECHO2_TOKEN"
    return secrets.token_urlsafe(16), None


def bytes_per_s(mbps: float | None) -> float | None:
    """Mbit/s (a `[broadcast]` figure) as bytes/s; None stays None."""
    return None if mbps is None else mbps * 1e6 / 8


def tls(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The coordinator's TLS context from coordinator.tls_cert / tls_key (None: plain HTTP)."""
    if cert is None or key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(Path(cert).expanduser(), Path(key).expanduser())
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"coordinator.tls_cert / tls_key: cannot load {cert}, {key}: {e}") from None
    return context
