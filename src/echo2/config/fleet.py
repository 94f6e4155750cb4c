"""The control plane's sections: `[coordinator]` (the HTTP service workers talk to),
`[scheduler]` (how many workers run, and its providers: local processes or SkyPilot) and
`[broadcast]` (how snapshots reach the workers). The learner's and the rollout's sections are in
schema.py, the workload's in workload.py.

Imports only pydantic and the section base, as the rest of the config package.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from echo2.config.base import _Section


# ---------------------------------------------------------------------------- coordinator
class CoordinatorConfig(_Section):
    host: str = "127.0.0.1"
    """Address the coordinator binds (`echo2 learner`); use 0.0.0.0 to accept remote workers."""
    port: int = Field(0, ge=0, le=65535)
    """TCP port; 0 lets the OS choose (printed at start)."""
    token: str | None = None
    """Bearer token workers must present; default: $ECHO2_TOKEN, else a random one printed at start."""
    groups_per_lease: int | None = Field(None, ge=1)
    """Prompts per work lease; default rollout.prompts_per_step."""
    lease_timeout: float = Field(300.0, gt=0)
    """Seconds before an unfinished lease is reissued to another worker."""
    heartbeat_interval: float = Field(2.0, gt=0)
    """Seconds between worker heartbeats."""
    heartbeat_timeout: float = Field(15.0, gt=0)
    """A worker silent this long is marked lost and its leases are reissued."""
    wait_timeout: float = Field(1800.0, gt=0)
    """The learner gives up if no admissible batch arrives for this long (no live workers)."""
    tls_cert: str | None = None
    """PEM certificate (chain) to serve HTTPS with; workers then use an https:// URL (and
    `--ca-file` for a private CA). None: plain HTTP (docs/security.md: what that exposes)."""
    tls_key: str | None = None
    """PEM private key of `tls_cert`."""
    any_relay_host: bool = False
    """Let a worker advertise a relay host (`--relay-advertise`) other than the address its
    registration came from (NAT, proxies). Off: a worker can only point its children at itself."""
    max_leases_per_worker: int = Field(2, ge=1)
    """Open leases one worker may hold (a worker works one at a time)."""
    quarantine_after: int = Field(3, ge=1)
    """Refusals an honest worker never earns (forged rewards, bad log-probs, wrong prompts) after
    which a worker is quarantined: no more leases, pushes refused."""
    purge_after: float = Field(600.0, gt=0)
    """Seconds after which a lost worker's registration is forgotten."""

    @model_validator(mode="after")
    def _timeouts(self) -> CoordinatorConfig:
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError("coordinator.heartbeat_timeout: must exceed coordinator.heartbeat_interval")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("coordinator.tls_key: tls_cert and tls_key go together")
        return self


# ---------------------------------------------------------------------------- scheduler
class SkyPilotWorkerConfig(_Section):
    """One worker type rented through SkyPilot: what the scheduler weighs (count, throughput, price)
    and the SkyPilot resources one worker of it runs on (fleet/providers/skypilot/provider.py builds the task)."""

    name: str = Field(min_length=1, max_length=40, pattern=r"^[a-z][a-z0-9-]*$")
    """Type name; its workers are named NAME-0, NAME-1, ... and so are their clusters (with the
    prefix). Lower case, digits and dashes: it must be a valid cluster name on every cloud."""
    count: int = Field(ge=1)
    """At most this many of the type run at once."""
    throughput: float = Field(gt=0, allow_inf_nan=False)
    """Trajectories per second of one worker (declared or calibrated)."""
    price: float = Field(ge=0, allow_inf_nan=False)
    """USD per hour of one worker (`echo2 plan --catalog skypilot` fills it from the catalog)."""
    accelerator: str = Field(min_length=1)
    """SkyPilot accelerator name, e.g. "RTX4090", "L40S", "H100"."""
    accelerator_count: int = Field(1, ge=1)
    """Accelerators per worker."""
    infra: list[str] = Field(default_factory=list)
    """Where it may run, SkyPilot `infra` strings ("runpod", "vast", "lambda/us-east-1", "k8s");
    several: SkyPilot picks the cheapest that has capacity. Empty: any enabled cloud."""
    spot: bool = False
    """Spot (preemptible) instances; a preempted worker marks its type unavailable for a while."""
    disk_gb: int | None = Field(None, ge=10)
    """OS disk size in GiB (default: SkyPilot's)."""
    image: str | None = None
    """SkyPilot `image_id`, e.g. "docker:vllm/vllm-openai:v0.11.0" (default: the cloud's GPU image)."""


class SkyPilotConfig(_Section):
    """`scheduler.provider = "skypilot"`: rent workers through SkyPilot (docs/fleet.md)."""

    coordinator_url: str = Field(pattern=r"^https?://")
    """The coordinator's public URL, as the rented workers reach it."""
    python: str | None = None
    """The python of a venv with SkyPilot installed (e.g. "~/.venvs/sky/bin/python"): SkyPilot's
    pins conflict with echo2's, so the provider drives it through a bridge process run by this
    interpreter (fleet/providers/skypilot/bridge.py). Required when the provider runs; `echo2 plan` omits it."""
    install: str = "pip install 'echo2[gpu]'"
    """Setup command that installs echo2 on a rented machine (run once per cluster)."""
    workers: list[SkyPilotWorkerConfig] = Field(min_length=1)
    """The worker types to rent from (`echo2 plan --catalog skypilot` prints these tables)."""
    autostop_minutes: int = Field(10, ge=1)
    """Every cluster is torn down after this many idle minutes (autodown): the safety net that
    leaves no machine billing after a learner that died without stopping its fleet."""
    unavailable_s: float = Field(600.0, gt=0)
    """A type whose launch failed (no capacity, quota) or whose worker was preempted or lost is
    not offered again for this long; the scheduler picks the next cheapest meanwhile."""
    poll_s: float = Field(5.0, gt=0)
    """Seconds between polls of SkyPilot's requests and cluster statuses (off the coordinator)."""
    cluster_prefix: str = Field("echo2", min_length=1, max_length=20, pattern=r"^[a-z][a-z0-9-]*$")
    """Clusters are named PREFIX-WORKER (e.g. echo2-rtx4090-runpod-0): `sky status` shows them."""

    @model_validator(mode="after")
    def _unique(self) -> SkyPilotConfig:
        names = [w.name for w in self.workers]
        if len(set(names)) != len(names):
            raise ValueError("scheduler.skypilot.workers: names must be unique")
        return self


class SchedulerConfig(_Section):
    enabled: bool = False
    """Keep pool throughput at gamma * mu_min: newcomers wait in standby, the cheapest per unit of
    throughput are activated, the most expensive released (paper 3.4, 4.3)."""
    gamma: float = Field(1.1, ge=1)
    """Safety factor over mu_min."""
    sustain_s: float = Field(30.0, gt=0)
    """A deviation from the target must last this long before workers are activated or released."""
    release_margin: float = Field(0.15, ge=0)
    """Release only while capacity exceeds the target by more than this share."""
    window_s: float = Field(30.0, gt=0)
    """Sliding window over heartbeat throughput reports."""
    provider: Literal["none", "local", "skypilot"] = "none"
    """"none": standby workers are running processes that get no leases. "local": the scheduler
    starts and stops worker processes on this machine from the offers in `pool` (`echo2 run`).
    "skypilot": it rents and stops cloud workers through SkyPilot (`skypilot`, docs/fleet.md)."""
    skypilot: SkyPilotConfig | None = None
    """The SkyPilot provider's worker types and settings."""
    pool: str | None = None
    """POOL.toml for the local provider, in `echo2 plan --pool` format: [[workers]] with name, count,
    throughput (trajectories/s, expected) and price (USD/hour)."""
    initial_workers: int = Field(1, ge=1)
    """Local provider: workers started with the run (lowest price per unit throughput first)."""
    emulate: bool = False
    """Local provider: EMULATED workers (no model), each producing its pool entry's throughput."""
    model: Literal["continuous", "paper"] = "continuous"
    """Capacity model of the target (planning/capacity.py): "continuous" for echo2's workers, which
    keep generating while a snapshot is in flight; "paper" for the paper's cycle model, in which
    they stop during a broadcast (more workers; for reproducing the paper)."""
    t_train: float | None = Field(None, gt=0)
    """Seconds per learner step used for the target until steps are timed; default: the learner
    times one calibration step (forward and backward on a batch of the run's shape, no update)."""

    @model_validator(mode="after")
    def _provider(self) -> SchedulerConfig:
        if self.provider == "local" and not self.pool:
            raise ValueError("scheduler.pool: the local provider needs a POOL.toml")
        if self.provider == "local" and not self.enabled:
            raise ValueError(
                "scheduler.enabled: the local provider is driven by the scheduler; set it to true"
            )
        if self.provider == "skypilot" and self.skypilot is None:
            raise ValueError(
                "scheduler.skypilot: the skypilot provider needs its [scheduler.skypilot] section"
            )
        if self.provider == "skypilot" and not self.enabled:
            raise ValueError(
                "scheduler.enabled: the skypilot provider is driven by the scheduler; set it to true"
            )
        return self


# ---------------------------------------------------------------------------- broadcast
SLOW_RELAY_FRACTION = 0.75
"""Default of `broadcast.slow_relay_fraction`: a relay delivering chunks to its child below this
fraction of its peers' rate is demoted (it would stretch its chain's broadcast by more than
1 / 0.75 = 1.33x): see `broadcast.plan.relay_floor`."""


class BroadcastConfig(_Section):
    """How snapshots reach the workers (paper 4.2, Appendix C.3; docs/architecture.md). Rates in
    Mbit/s (10^6 bits per second)."""

    mode: Literal["chain", "star"] = "chain"
    """"chain": peer-forwarding chains, N_ch = floor(B0 / Bw_hat) of them, fan-out 1. "star": the
    learner sends every worker the whole snapshot itself (the paper's w/o-P2P ablation)."""
    chunk_mb: float = Field(4.0, gt=0, le=1024)
    """Chunk size in MiB: the unit of hashing, verification and store-and-forward relaying."""
    uplink_mbps: float | None = Field(None, gt=0)
    """Cap on the learner's upload rate, shared by every stream it serves (token bucket); None:
    uncapped. Also B0, the uplink budget that sets the number of chains, unless
    uplink_budget_mbps is given."""
    uplink_budget_mbps: float | None = Field(None, gt=0)
    """B0 for chain planning when it differs from the cap (e.g. the uplink is uncapped but shared);
    default uplink_mbps. With neither set the uplink counts as unlimited: every worker is a seed."""
    learner_stream_mbps: float | None = Field(None, gt=0)
    """Cap on each of the learner's streams (token bucket), e.g. Bw: the paper's learner sends to
    each seed at the worker's rate, so no stream overruns a worker's link; None: only uplink_mbps."""
    worker_mbps: float = Field(100.0, gt=0)
    """Bw_hat, the typical worker bandwidth, until measured transfers replace it (median of the
    last 20 reported transfer rates)."""
    worker_upload_mbps: float | None = Field(None, gt=0)
    """Cap on each worker's relay upload (token bucket); None: uncapped. `echo2 worker
    --upload-mbps` overrides it."""
    worker_download_mbps: float | None = Field(None, gt=0)
    """Cap on each worker's snapshot download; None: uncapped. `echo2 worker --download-mbps`
    overrides it."""
    progress_timeout_s: float = Field(10.0, gt=0)
    """A parent that sends nothing for this long (or only keep-alives for 3x this long) is
    reported failed; the receiver is given a new parent and resumes from its first missing chunk."""
    key_file: str | None = None
    """PEM file of the learner's Ed25519 signing key, created on first start; default
    RUN_DIR/learner_key.pem, so a resumed run keeps its key."""
    min_relay_mbps: float = Field(1.0, ge=0)
    """A relay whose chunks arrive slower than this (over the last progress timeout spent reading
    them) is reported stalled and excised, like one that sends nothing; 0: no floor. Keep it
    below worker_upload_mbps."""
    slow_relay_fraction: float = Field(SLOW_RELAY_FRACTION, ge=0, lt=1)
    """A relay whose chunks reach its child below this fraction of its peers' measured relay rate
    (median of the last 20 credited relay transfers; measured over a progress timeout of reading)
    is reported slow: excised like a failed one and only a tail in the next plan. 0: never."""
    delta: bool = True
    """Publish, beside each full snapshot, a delta from the previous published version
    (broadcast/delta.py; signed and chunked the same way), when it is smaller: a worker that runs
    that version receives the delta down the chains and rebuilds the snapshot bit for bit; a new
    or behind worker, or one whose delta failed, receives the full snapshot from the learner.
    Measured: 0.66% of the full bf16 snapshot per publication at lr 1e-6 (docs/benchmarks.md)."""

    @model_validator(mode="after")
    def _floor(self) -> BroadcastConfig:
        up = self.worker_upload_mbps
        if up is not None and self.min_relay_mbps > up:
            raise ValueError("broadcast.min_relay_mbps: must not exceed broadcast.worker_upload_mbps")
        return self

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.chunk_mb * 2**20))
