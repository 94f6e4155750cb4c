"""Remote rollout source: the coordinator serves workers; the learner takes what they pushed.

The learner never waits for a particular worker: it takes the first `num_groups` admissible groups
in the buffer, whoever generated them. It measures how long it waited (learner idle time); the
coordinator state measures when each published version ran on a fraction q of the live workers
(T_bcast at q = 0.9 and q = 1, from the workers' install reports). Snapshots are signed with the
learner's key (RUN_DIR/learner_key.pem unless `broadcast.key_file` names another) and disseminated
as `[broadcast]` says (docs/architecture.md). Every accepted batch is journaled in
RUN_DIR/accepted.jsonl (control/journal.py) and a checkpoint records the journal's offset, so a
resumed learner puts back every record accepted since, and trains none twice. Implements the `RolloutSource` seam
(learning/source.py); knows nothing of training.
"""

from __future__ import annotations

import logging
import os
import secrets
import ssl
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from echo2.broadcast.chunks import load_or_create_key
from echo2.config import Config, ConfigError
from echo2.control import capacity, identity, journal
from echo2.control.broadcast import BroadcastPolicy
from echo2.control.coordinator import Coordinator
from echo2.control.scheduler import Scheduler
from echo2.control.state import CoordinatorState, Limits, WorkerStatus
from echo2.data.buffer import ReplayBuffer
from echo2.data.tasks.base import Task
from echo2.envs import response_limit
from echo2.preflight import bind_message
from echo2.records import Snapshot

logger = logging.getLogger(__name__)


def serialise(snapshot: Snapshot) -> bytes:
    """The snapshot as safetensors bytes, each weight once: `snapshot_state` leaves tied aliases
    out (and copies every tensor, so none shares storage, which safetensors' `save` refuses)."""
    from safetensors.torch import save

    return save(dict(snapshot.state))


class RemoteRollout:
    def __init__(
        self,
        *,
        config: Config,
        task: Task,
        buffer: ReplayBuffer,
        vocab_size: int,
        tokenizer=None,
        provider=None,
        run_dir: Path | None = None,
        on_start: Iterable[Callable[[RemoteRollout], None]] = (),
    ) -> None:
        """`on_start` hooks run once the first snapshot is published (start workers, print the URL).
        With `tokenizer`, every pushed record is checked against its leased prompt and re-scored
        with the task (learning/verify.py)."""
        from echo2.control.validate import reward_range
        from echo2.learning.verify import TaskReferee

        self.config = config
        self.on_start = list(on_start)
        self.buffer = buffer
        self.t_train: list[float] = []
        self.t_train_hint: float | None = config.scheduler.t_train
        """T_train for the scheduler's target until a step is timed: `scheduler.t_train`, or the
        learner's calibration step (learning/calibrate.py)."""
        ccfg, bc = config.coordinator, config.broadcast
        key_file = (
            Path(bc.key_file).expanduser()
            if bc.key_file
            else (run_dir or config.run_dir()) / "learner_key.pem"
        )
        budget_mbps = bc.uplink_budget_mbps or bc.uplink_mbps
        self.state = CoordinatorState(
            buffer=buffer,
            limits=Limits(
                vocab_size=vocab_size,
                max_prompt_tokens=config.rollout.max_prompt_tokens,
                max_new_tokens=response_limit(config),
                group_size=config.rollout.group_size,
                reward_range=reward_range(task),
            ),
            referee=TaskReferee(task, tokenizer, max_new_tokens=config.rollout.max_new_tokens)
            if tokenizer is not None
            else None,
            max_leases_per_worker=ccfg.max_leases_per_worker,
            max_groups_per_lease=ccfg.groups_per_lease or config.rollout.prompts_per_step,
            groups_per_step=config.rollout.prompts_per_step,
            quarantine_after=ccfg.quarantine_after,
            purge_after=ccfg.purge_after,
            group_id_of=lambda i: task.train_prompt(i).group_id,
            lease_timeout=ccfg.lease_timeout,
            heartbeat_timeout=ccfg.heartbeat_timeout,
            scheduler=Scheduler(
                sustain_s=config.scheduler.sustain_s, release_margin=config.scheduler.release_margin
            )
            if config.scheduler.enabled
            else None,
            target=self.target_throughput,
            window_s=config.scheduler.window_s,
            provider=provider,
            broadcast=BroadcastPolicy(
                mode=bc.mode,
                chunk_size=bc.chunk_bytes,
                uplink_budget_bps=None if budget_mbps is None else budget_mbps * 1e6 / 8,
                worker_bps=bc.worker_mbps * 1e6 / 8,
                slow_relay_fraction=bc.slow_relay_fraction,
            ),
            signing_key=load_or_create_key(key_file),
        )
        self.token = ccfg.token or os.environ.get("ECHO2_TOKEN") or secrets.token_urlsafe(16)
        self.token_origin = (
            "coordinator.token" if ccfg.token else "$ECHO2_TOKEN" if os.environ.get("ECHO2_TOKEN") else None
        )
        """Where the token came from (never printed then); None: generated, written to
        RUN_DIR/coordinator.token (mode 0600)."""
        worker_view = config.model_dump(
            mode="json", include={"model", "task", "rollout", "coordinator", "broadcast"}
        )
        worker_view["run"] = {"seed": config.run.seed}
        # What workers need of the learner: the dtype snapshots arrive in, and whether they are adapters.
        worker_view["learner"] = config.model_dump(mode="json", include={"learner": {"dtype", "lora"}})[
            "learner"
        ]
        self.idle = 0.0
        self.train = 0.0
        self.journal = journal.Journal(run_dir / journal.NAME, epoch=self.state.epoch) if run_dir else None
        self.state.intake.journal = self.journal.accepted if self.journal is not None else None
        self.held: list = []
        """Replayed records newer than the resumed learner, put in the buffer as it reaches them."""
        self.offpolicy: dict[str, Any] = {}
        self.consumed_staleness: Counter[int] = Counter()
        """Records trained on by staleness, this process's share of the run (GET /status, /ui)."""
        self.coordinator = Coordinator(
            self.state,
            token=self.token,
            run_info=worker_view,
            heartbeat_interval=ccfg.heartbeat_interval,
            status_extra=self.timings,
            uplink_bps=None if bc.uplink_mbps is None else bc.uplink_mbps * 1e6 / 8,
            stream_bps=None if bc.learner_stream_mbps is None else bc.learner_stream_mbps * 1e6 / 8,
            ssl_context=_tls(ccfg.tls_cert, ccfg.tls_key),
            any_relay_host=ccfg.any_relay_host,
        )
        self.fingerprint = identity.fingerprint(self.state.publisher.public_key)
        """What workers pin the learner's key by (`echo2 worker --learner-key`)."""
        logger.info("learner key fingerprint: %s", self.fingerprint)
        self.token_file: Path | None = None
        self.before_close: list = []
        """Callables run by close() before the coordinator stops (e.g. stopping local workers)."""
        try:
            self.url = self.coordinator.start(ccfg.host, ccfg.port)
        except OSError as e:  # the port is taken, the address is not this host's
            raise ConfigError(bind_message(ccfg.host, ccfg.port, e)) from None
        if run_dir is not None:
            # Where workers find the learner when coordinator.port = 0 let the OS pick the port.
            tmp = run_dir / "coordinator.url.tmp"
            tmp.write_text(self.url + "\n")
            tmp.replace(run_dir / "coordinator.url")
            if self.token_origin is None:
                self.token_file = run_dir / "coordinator.token"
                fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(self.token + "\n")

    # ------------------------------------------------------------------ RolloutSource
    def next_groups(self, num_groups: int):
        start = time.perf_counter()
        groups, staleness = self.state.intake.take_groups(
            num_groups, timeout=self.config.coordinator.wait_timeout
        )
        waited = time.perf_counter() - start
        if not groups:
            raise RuntimeError(
                f"no admissible batch within coordinator.wait_timeout = "
                f"{self.config.coordinator.wait_timeout}s "
                f"(active workers: {self.active_workers()})"
            )
        if self.journal is not None:
            self.journal.taken(self.buffer.learner_version, [r.record_id for g in groups for r in g])
        with self.state.shared.lock:  # also read by GET /status, from the coordinator's thread
            self.idle += waited
            self.consumed_staleness.update(staleness)
            stats = {"time/learner_wait": waited, **self._bcast_metrics()}
        return groups, staleness, stats

    def _bcast_metrics(self) -> dict[str, float]:
        """T_bcast of the newest version measured so far (keys absent until one is)."""
        if not self.state.publisher.t_bcast:
            return {}
        v = max(self.state.publisher.t_bcast)
        out = {"bcast/version": float(v), "bcast/t_q90": self.state.publisher.t_bcast[v]}
        if v in self.state.publisher.t_bcast_all:
            out["bcast/t_all"] = self.state.publisher.t_bcast_all[v]
        return out

    def record_train_time(self, seconds: float) -> None:
        with self.state.shared.lock:
            self.t_train.append(seconds)
            self.train += seconds

    def record_metrics(self, row: dict[str, Any]) -> None:
        with self.state.shared.lock:  # GET /status shows the last step's off-policy diagnostics
            self.offpolicy = {
                "step": row["step"],
                **{k: v for k, v in row.items() if k.startswith("offpolicy/")},
            }

    def advance(self, version: int) -> None:
        self.state.intake.set_learner_version(version)
        if self.held:
            with self.state.shared.lock:
                self.held = journal.admit_held(self.buffer, self.held)
                self.state.shared.ready.notify_all()

    def flag(self, records, reason: str) -> list[str]:
        return self.state.intake.flag(records, reason)

    def start(self, snapshot: Snapshot) -> None:
        """Workers start from the learner's current weights; then the hooks (start local workers)."""
        self.publish(snapshot)
        for hook in self.on_start:
            hook(self)

    def publish(self, snapshot: Snapshot) -> None:
        data = serialise(snapshot)
        self.state.publisher.publish(snapshot.version, data, keep=self.config.learner.staleness + 1)
        if self.journal is not None:
            self.journal.published(snapshot.version, self.state.epoch)

    def state_dict(self) -> dict[str, Any]:
        with self.state.shared.lock:
            pending = list(self.state.intake.ingestion.reissue) + [
                i for lease in self.state.intake.ingestion.leases.values() for i in lease.indices
            ]
            out = {
                "next_prompt": self.state.intake.ingestion.next_index,
                "reissue": pending,
                "buffer": self.buffer.state_dict(),
                "buffered": dict(self.state.intake.ingestion.buffered),
                "held": [r.to_dict() for r in self.held],
            }
            if self.journal is not None:
                out["journal_offset"] = self.journal.offset()
        if self.journal is not None:
            self.journal.sync()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from echo2.records import Trajectory

        with self.state.shared.lock:
            self.state.intake.ingestion.next_index = state["next_prompt"]
            self.state.intake.ingestion.reissue.extend(state.get("reissue", []))
            self.buffer.load_state_dict(state["buffer"])
            self.state.intake.ingestion.buffered.update(state.get("buffered", {}))
            self.held = [Trajectory.from_dict(d) for d in state.get("held", [])]
            if self.journal is not None and "journal_offset" in state:
                since = journal.accepted_since(self.journal.path, state["journal_offset"])
                self.held += journal.replay(
                    self.state.intake.ingestion, since, referee=self.state.intake.referee
                )

    def close(self) -> None:
        for hook in self.before_close:
            hook()
        self.state.close()
        self._tell_workers()
        self.coordinator.stop()
        if self.journal is not None:
            self.journal.close()

    def _tell_workers(self) -> None:
        """Keep answering until every live worker has heard `run_finished` (each does at its next
        heartbeat), for at most two heartbeat intervals and a second: then they exit 0 by themselves."""
        deadline = time.monotonic() + 2 * self.config.coordinator.heartbeat_interval + 1.0
        while time.monotonic() < deadline:
            with self.state.shared.lock:
                live = {
                    w.worker_id
                    for w in self.state.registry.workers.values()
                    if w.status is WorkerStatus.ACTIVE
                }
            if live <= self.coordinator.told:
                return
            time.sleep(0.05)

    # ------------------------------------------------------------------ measurements
    @property
    def wants_t_train(self) -> bool:
        """The scheduler needs a T_train before the first step: none configured or timed yet."""
        return self.config.scheduler.enabled and self.t_train_hint is None and not self.t_train

    def target_throughput(self) -> float | None:
        """gamma * mu_min (scheduler.model, continuous by default) from the learner's own T_train
        (the configured or calibrated one until a step is timed) and T_bcast (None while T_train
        is unknown; infinite where no pool is enough). Called under the lock."""
        t_train = statistics.median(self.t_train) if self.t_train else self.t_train_hint
        if t_train is None:
            return None
        t_bcast = (
            statistics.median(self.state.publisher.t_bcast.values()) if self.state.publisher.t_bcast else 0.0
        )
        return capacity.target_throughput(
            kappa=self.config.learner.publish_every,
            staleness=self.config.learner.staleness,
            model=self.config.scheduler.model,
            t_train=t_train,
            t_bcast=t_bcast,
            batch=self.config.rollout.prompts_per_step * self.config.rollout.group_size,
            gamma=self.config.scheduler.gamma,
        )

    def active_workers(self) -> int:
        with self.state.shared.lock:
            return sum(w.status is WorkerStatus.ACTIVE for w in self.state.registry.workers.values())

    def timings(self) -> dict[str, Any]:
        """Learner-side measurements, shown in GET /status and the run summary."""
        with self.state.shared.lock:
            return self._timings()

    def _timings(self) -> dict[str, Any]:
        busy = self.idle + self.train
        return {
            "t_train": statistics.median(self.t_train) if self.t_train else None,
            "t_bcast": statistics.median(self.state.publisher.t_bcast.values())
            if self.state.publisher.t_bcast
            else None,
            "t_bcast_all": (
                statistics.median(self.state.publisher.t_bcast_all.values())
                if self.state.publisher.t_bcast_all
                else None
            ),
            "broadcast_mode": self.config.broadcast.mode,
            "offpolicy": dict(self.offpolicy),
            "learner_idle_s": self.idle,
            "staleness_histogram": {str(k): v for k, v in sorted(self.consumed_staleness.items())},
            "bubble_ratio": self.idle / busy if busy else None,
            "ingest_rejected": dict(self.state.intake.ingestion.rejected),
            "scheduler_decisions": list(self.state.fleet.decisions),
            "workers_cost_per_hour": sum(
                w.price_per_hour
                for w in self.state.registry.workers.values()
                if w.status is WorkerStatus.ACTIVE and not w.standby
            ),
        }


def _tls(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The coordinator's TLS context from coordinator.tls_cert / tls_key (None: plain HTTP)."""
    if cert is None or key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(Path(cert).expanduser(), Path(key).expanduser())
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"coordinator.tls_cert / tls_key: cannot load {cert}, {key}: {e}") from None
    return context
