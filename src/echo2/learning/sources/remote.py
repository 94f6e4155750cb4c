"""Remote rollout source: the coordinator serves workers; the learner takes what they pushed.

The learner never waits for a particular worker: it takes the first `num_groups` admissible groups
in the buffer, whoever generated them. It measures how long it waited (learner idle time); the
coordinator state measures when each published version ran on a fraction q of the live workers
(T_bcast at q = 0.9 and q = 1, from the workers' install reports). Snapshots are signed with the
learner's key (RUN_DIR/learner_key.pem unless `broadcast.key_file` names another) and disseminated
as `[broadcast]` says (docs/architecture.md). Every accepted batch is journaled in
RUN_DIR/accepted.jsonl (coordinator/journal.py) and a checkpoint records the journal's offset, so a
resumed learner puts back every record accepted since, and trains none twice.

Implements the `RolloutSource` seam (learning/sources/__init__.py) and keeps behind it what only a coordinator
needs: the scheduler's T_train (a calibration step before the first, then the learner's step
times), strikes against the workers whose records the learner refused, the status page's figures
and the run summary's measurements. Built from the run's config with no side effect; `start` opens
the journal, binds the port, writes RUN_DIR/coordinator.url (and .token), publishes the first
snapshot and runs the `on_start` hooks; `close` undoes them. Knows nothing of training.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from echo2.broadcast.chunks import load_or_create_key
from echo2.config import Config, ConfigError
from echo2.coordinator import journal
from echo2.coordinator.registry import WorkerStatus
from echo2.data.buffer import ReplayBuffer
from echo2.data.tasks.base import Task
from echo2.learning.sources import assembly
from echo2.planning import capacity
from echo2.preflight import bind_message
from echo2.records import Snapshot, StepReport, Trajectory
from echo2.wire import identity

logger = logging.getLogger(__name__)


def serialise(snapshot: Snapshot) -> bytes:
    """The snapshot as safetensors bytes, each weight once: `snapshot_state` leaves tied aliases
    out (and copies every tensor, so none shares storage, which safetensors' `save` refuses)."""
    from safetensors.torch import save

    return save(dict(snapshot.state))


class RemoteRollout:
    """The learner's `RolloutSource` over a coordinator. Construction builds the parts from the
    config and reads the learner's signing key (creating it on a first run: it is the state's
    identity); nothing binds, starts or is written before `start` (or `listen`)."""

    def __init__(
        self,
        config: Config,
        *,
        task: Task,
        buffer: ReplayBuffer,
        vocab_size: int,
        run_dir: Path | None = None,
        tokenizer=None,
        provider=None,
        on_start: Iterable[Callable[[RemoteRollout], None]] = (),
        time_train_step: Callable[[], float] | None = None,
    ) -> None:
        """`on_start` hooks run once the first snapshot is published (start workers, print the URL).
        With `tokenizer`, every pushed record is checked against its leased prompt and re-scored
        with the task (learning/verify.py). `time_train_step` times one learner step, for a
        scheduler with no `scheduler.t_train` (learning/calibrate.py)."""
        self.config = config
        self.buffer = buffer
        self.run_dir = run_dir
        self.on_start = list(on_start)
        self.before_close: list[Callable[[], None]] = []
        """Callables run by close() before the coordinator stops (e.g. stopping local workers)."""
        self.time_train_step = time_train_step
        self.checks_logprobs = not config.scheduler.emulate
        """Emulated workers' log-probs are not a policy's: the learner has nothing to compare."""
        self.t_train: list[float] = []
        self.t_train_hint: float | None = config.scheduler.t_train
        """T_train for the scheduler's target until a step is timed: `scheduler.t_train`, or the
        calibration step `start` times."""
        self.idle = 0.0
        self.train = 0.0
        self.held: list[Trajectory] = []
        """Replayed records newer than the resumed learner, put in the buffer as it reaches them."""
        self.offpolicy: dict[str, Any] = {}
        self.staleness_histogram: dict[int, int] = {}
        """The learner's records trained on by staleness, whole run (GET /status, /ui)."""
        self.journal: journal.Journal | None = None
        """RUN_DIR/accepted.jsonl, opened by `start` (no journal without a run directory)."""
        key_file = (
            Path(config.broadcast.key_file).expanduser()
            if config.broadcast.key_file
            else (run_dir or config.run_dir()) / "learner_key.pem"
        )
        self.state = assembly.coordinator_state(
            config,
            task=task,
            buffer=buffer,
            vocab_size=vocab_size,
            tokenizer=tokenizer,
            provider=provider,
            target=self.target_throughput,
            journal=self._journal_accepted if run_dir is not None else None,
            signing_key=load_or_create_key(key_file),
        )
        self.token, self.token_origin = assembly.token(config.coordinator)
        """`token_origin`: where the token came from (never printed then); None: generated, written
        to RUN_DIR/coordinator.token (mode 0600) by `start`."""
        self.token_file: Path | None = None
        self.coordinator = assembly.coordinator(
            config, self.state, token=self.token, status_extra=self.timings
        )
        self.fingerprint = identity.fingerprint(self.state.publisher.public_key)
        """What workers pin the learner's key by (`echo2 worker --learner-key`)."""
        self.url: str | None = None
        """Where the coordinator listens, once `start` (or `listen`) bound its port."""

    # ------------------------------------------------------------------ RolloutSource
    def start(self, snapshot: Snapshot) -> None:
        """Listen; time a calibration step if the scheduler needs T_train before the first step;
        workers start from the learner's current weights; then the hooks (start local workers)."""
        self.listen()
        try:
            if self.config.scheduler.enabled and self.t_train_hint is None and self.time_train_step:
                self.t_train_hint = self.time_train_step()
                logger.info("calibration step: T_train about %.2fs", self.t_train_hint)
            self._publish(snapshot)
            for hook in self.on_start:
                hook(self)
        except BaseException:
            self.close()
            raise

    def listen(self) -> str:
        """Open the journal, bind the coordinator's port (`ConfigError` if it cannot) and write
        where workers find it; returns the URL."""
        ccfg = self.config.coordinator
        if self.run_dir is not None:
            self.journal = journal.Journal(self.run_dir / journal.NAME, epoch=self.state.epoch)
        try:
            self.url = self.coordinator.start(ccfg.host, ccfg.port)
        except OSError as e:  # the port is taken, the address is not this host's
            self.close()
            raise ConfigError(bind_message(ccfg.host, ccfg.port, e)) from None
        logger.info("learner key fingerprint: %s", self.fingerprint)
        if self.run_dir is not None:
            # Where workers find the learner when coordinator.port = 0 let the OS pick the port.
            tmp = self.run_dir / "coordinator.url.tmp"
            tmp.write_text(self.url + "\n")
            tmp.replace(self.run_dir / "coordinator.url")
            if self.token_origin is None:
                self.token_file = self.run_dir / "coordinator.token"
                fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(self.token + "\n")
        return self.url

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
            stats = {"time/learner_wait": waited, **self._bcast_metrics()}
        return groups, staleness, stats

    def advance(self, report: StepReport) -> None:
        """Strike the makers of what the learner refused; move the buffer to the learner's version
        (admitting held records it now reaches); publish every `learner.publish_every` versions;
        keep the step's time and figures for the scheduler, GET /status and the summary."""
        for reason, records in report.refused.items():
            if records:
                makers = self.state.intake.flag(records, reason)
                logger.warning(
                    "%d records refused by the learner (%s); made by workers %s", len(records), reason, makers
                )
        self.state.intake.set_learner_version(report.version)
        if self.held:
            with self.state.shared.lock:
                self.held = journal.admit_held(self.buffer, self.held)
                self.state.shared.ready.notify_all()
        if report.version % self.config.learner.publish_every == 0:
            self._publish(report.snapshot())
        with self.state.shared.lock:
            self.t_train.append(report.train_s)
            self.train += report.train_s
            self.offpolicy = {
                "step": report.step,
                **{k: v for k, v in report.stats.items() if k.startswith("offpolicy/")},
            }
            self.staleness_histogram = dict(report.staleness)

    def state_dict(self) -> dict[str, Any]:
        ingestion = self.state.intake.ingestion
        with self.state.shared.lock:
            pending = list(ingestion.reissue) + [
                i for lease in ingestion.leases.values() for i in lease.indices
            ]
            out = {
                "next_prompt": ingestion.next_index,
                "reissue": pending,
                "buffer": self.buffer.state_dict(),
                "buffered": dict(ingestion.buffered),
                "held": [r.to_dict() for r in self.held],
            }
            if self.journal is not None:
                out["journal_offset"] = self.journal.offset()
        if self.journal is not None:
            self.journal.sync()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Before `start`: the records the journal accepted after the checkpoint are put back too."""
        ingestion = self.state.intake.ingestion
        with self.state.shared.lock:
            ingestion.next_index = state["next_prompt"]
            ingestion.reissue.extend(state.get("reissue", []))
            self.buffer.load_state_dict(state["buffer"])
            ingestion.buffered.update(state.get("buffered", {}))
            self.held = [Trajectory.from_dict(d) for d in state.get("held", [])]
            if self.run_dir is not None and "journal_offset" in state:
                since = journal.accepted_since(self.run_dir / journal.NAME, state["journal_offset"])
                self.held += journal.replay(ingestion, since, referee=self.state.intake.referee)

    def close(self) -> dict[str, Any]:
        """Idempotent. Returns the run summary's measurements (taken before anything stops)."""
        measured = self.timings()
        for hook in self.before_close:
            hook()
        self.before_close = []
        self.state.close()
        if self.url is not None:
            self._tell_workers()
            self.coordinator.stop()
        if self.journal is not None:
            self.journal.close()
        return measured

    # ------------------------------------------------------------------ behind the seam
    def _journal_accepted(self, records: list[Trajectory], prompts: dict[str, int]) -> None:
        """The state's journal: pushes arrive only once `start` opened it."""
        assert self.journal is not None, "a push before the coordinator listened"
        self.journal.accepted(records, prompts)

    def _publish(self, snapshot: Snapshot) -> None:
        data = serialise(snapshot)
        self.state.publisher.publish(snapshot.version, data, keep=self.config.learner.staleness + 1)
        if self.journal is not None:
            self.journal.published(snapshot.version, self.state.epoch)

    def _bcast_metrics(self) -> dict[str, float]:
        """T_bcast of the newest version measured so far (keys absent until one is)."""
        t_bcast, t_bcast_all = self.state.publisher.t_bcast, self.state.publisher.t_bcast_all
        if not t_bcast:
            return {}
        v = max(t_bcast)
        out = {"bcast/version": float(v), "bcast/t_q90": t_bcast[v]}
        if v in t_bcast_all:
            out["bcast/t_all"] = t_bcast_all[v]
        return out

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
    def target_throughput(self) -> float | None:
        """gamma * mu_min (scheduler.model, continuous by default) from the learner's own T_train
        (the configured or calibrated one until a step is timed) and T_bcast (None while T_train
        is unknown; infinite where no pool is enough). Called under the lock."""
        t_train = statistics.median(self.t_train) if self.t_train else self.t_train_hint
        if t_train is None:
            return None
        t_bcast = self.state.publisher.t_bcast
        return capacity.target_throughput(
            kappa=self.config.learner.publish_every,
            staleness=self.config.learner.staleness,
            model=self.config.scheduler.model,
            t_train=t_train,
            t_bcast=statistics.median(t_bcast.values()) if t_bcast else 0.0,
            batch=self.config.rollout.prompts_per_step * self.config.rollout.group_size,
            gamma=self.config.scheduler.gamma,
        )

    def active_workers(self) -> int:
        with self.state.shared.lock:
            return sum(w.status is WorkerStatus.ACTIVE for w in self.state.registry.workers.values())

    def timings(self) -> dict[str, Any]:
        """Learner-side measurements, shown in GET /status and the run summary. The staleness
        histogram is the learner's (whole run, across resumes), as its last step reported it."""
        with self.state.shared.lock:
            busy = self.idle + self.train
            t_bcast, t_bcast_all = self.state.publisher.t_bcast, self.state.publisher.t_bcast_all
            return {
                "t_train": statistics.median(self.t_train) if self.t_train else None,
                "t_bcast": statistics.median(t_bcast.values()) if t_bcast else None,
                "t_bcast_all": statistics.median(t_bcast_all.values()) if t_bcast_all else None,
                "broadcast_mode": self.config.broadcast.mode,
                "offpolicy": dict(self.offpolicy),
                "learner_idle_s": self.idle,
                "staleness_histogram": {str(k): v for k, v in sorted(self.staleness_histogram.items())},
                "bubble_ratio": self.idle / busy if busy else None,
                "ingest_rejected": dict(self.state.intake.ingestion.rejected),
                "scheduler_decisions": list(self.state.fleet.decisions),
                "workers_cost_per_hour": sum(
                    w.price_per_hour
                    for w in self.state.registry.workers.values()
                    if w.status is WorkerStatus.ACTIVE and not w.standby
                ),
            }
