"""Scenario files for `echo2 simulate`: one TOML file, validated by pydantic, overridable by
`--section.key=value` (list items by index: `--workers.0.count=12`).

Owns the schema of a simulated deployment (learner, broadcast, rollout, worker pool, scheduler,
faults, an optional sweep) and the expansion of a sweep into plain scenarios. A user mistake raises
`ConfigError` naming the dotted key; nothing is simulated before every expanded scenario validates.

Units: seconds; trajectories per second; USD per hour; bandwidths in Mbps (10^6 bit/s); snapshot
size in GB (10^9 bytes); chunk size in MiB.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from echo2.config import (
    SLOW_RELAY_FRACTION,
    ConfigError,
    check_kappa,
    publish_every,
    read_toml,
    set_dotted,
    validation_message,
)
from echo2.planning import capacity

SELECTORS = ("forwarder", "tail")
"""Fault targets chosen at fault time from the current broadcast plan (see `FaultSpec.worker`)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LearnerSpec(_Section):
    t_train: float = Field(gt=0, allow_inf_nan=False)
    """Seconds per learner step (median, jitter-free)."""
    jitter: float = Field(0.0, ge=0, le=2)
    """Spread of each step's training time: a mean-one lognormal factor with this sigma."""
    batch: int = Field(ge=1)
    """R: trajectories consumed per step; a multiple of group_size."""
    group_size: int = Field(16, ge=1)
    """Samples per prompt (one GRPO group is generated, admitted and consumed as a unit)."""
    staleness: int = Field(ge=0)
    """S: the learner consumes only records with version >= v_learner - S."""
    kappa: int | None = Field(None, ge=1)
    """Publish a snapshot every kappa steps; default max(1, S - 1), also its largest value."""
    price: float = Field(0.0, ge=0, allow_inf_nan=False)
    """USD per hour of the learner's machines."""
    snapshot_gb: float = Field(gt=0, allow_inf_nan=False)
    """Snapshot size M in GB (10^9 bytes); an 8B-parameter model in bf16 is 16 GB."""
    colocated: bool = False
    """Rollouts run on the learner's own GPUs within t_train (the centralized baselines): the learner
    never waits, nothing is broadcast, and the scenario needs no workers."""

    @model_validator(mode="after")
    def _rules(self) -> LearnerSpec:
        if self.batch % self.group_size:
            raise ValueError(
                f"learner.batch: {self.batch} is not a multiple of learner.group_size = {self.group_size}"
            )
        check_kappa(self.kappa, self.staleness)
        return self

    @property
    def publish_every(self) -> int:
        return publish_every(self.kappa, self.staleness)

    @property
    def snapshot_bytes(self) -> float:
        return self.snapshot_gb * 1e9


class BroadcastSpec(_Section):
    topology: Literal["chains", "star"] = "chains"
    """"chains": N_ch peer-forwarding chains (ECHO-2); "star": the learner pushes to every worker."""
    uplink_mbps: float = Field(math.inf, gt=0)
    """B0, the learner's upload budget, shared by the flows it feeds; inf = unlimited."""
    chunk_mib: float = Field(64.0, gt=0, allow_inf_nan=False)
    """Chunk size c: a relay forwards a chunk once it has received all of it."""
    hop_delay_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    """One-way latency d added to every chunk on every hop."""
    chains: int | None = Field(None, ge=1)
    """N_ch; default floor(B0 / Bw) from the planner, Bw the median worker download."""
    storage_mbps: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Rate at which a worker activated mid-run (replacement, scale-up) fetches the current
    snapshot from cloud storage (paper C.3, not through the broadcast caps); default its download."""
    slow_relay_fraction: float = Field(SLOW_RELAY_FRACTION, ge=0, lt=1)
    """As the runtime's broadcast.slow_relay_fraction: a relay delivering below this fraction of
    the peers' measured relay rate is reported slow by its child, excised and demoted to a tail for
    the next plan; 0: never (slow relays are then only ranked down by their scores)."""
    progress_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    """The receiver's measurement window (broadcast.progress_timeout_s): a slow relay is reported
    once its child's last window of reading averaged below the floor."""
    delta: bool = False
    """As the runtime's broadcast.delta (off here, so the paper scenarios send full snapshots): a
    worker holding the previous published version receives delta_ratio x the snapshot down the
    chains; a new or further-behind one downloads the full snapshot directly, as an activated worker
    does (`planning.capacity.publication_bytes`)."""
    delta_ratio: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    """Delta bytes / full snapshot bytes; default the measured bf16 median for kappa
    (`planning.capacity.delta_ratio`: a 135M model's, extrapolated)."""

    @property
    def chunk_bytes(self) -> float:
        return self.chunk_mib * 2**20


class RolloutSpec(_Section):
    keep_generating: bool = True
    """true (ECHO-2): a worker keeps generating under its installed version while the next snapshot
    streams in and switches at install. false: it stops generating when a snapshot is published and
    resumes once it has installed it, the conservative assumption behind the capacity model
    (paper Appendix B.1) and how systems that pause rollouts for a weight sync behave."""
    lease_groups: int = Field(1, ge=1)
    """Groups a worker generates together in one round, all under the version installed when the
    round starts and delivered when it ends (larger rounds deliver older records)."""


class WorkerSpec(_Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.]+$")
    """Worker type; the workers are named NAME-0, NAME-1, ..."""
    count: int = Field(ge=1)
    """Workers of this type in the pool."""
    throughput: float = Field(gt=0, allow_inf_nan=False)
    """mu: trajectories per second of one worker."""
    price: float = Field(0.0, ge=0, allow_inf_nan=False)
    """USD per hour of one worker while it is active."""
    jitter: float = Field(0.0, ge=0, le=2)
    """Spread of each round's generation rate: a mean-one lognormal factor with this sigma."""
    download_mbps: float = Field(100.0, gt=0)
    """Download cap of one worker."""
    upload_mbps: float | None = Field(None, gt=0)
    """Upload cap (what it can forward to its child); default download_mbps."""
    inbound: bool = True
    """Accepts inbound connections, so it can relay to a child; otherwise it is only a chain tail."""

    @property
    def down_bps(self) -> float:
        return self.download_mbps * 1e6 / 8

    @property
    def up_bps(self) -> float:
        return (self.upload_mbps if self.upload_mbps is not None else self.download_mbps) * 1e6 / 8


class SchedulerSpec(_Section):
    enabled: bool = False
    """false: every worker is active from the start and nobody replaces a lost one. true: the run
    starts with the cheapest pool that reaches gamma * mu_min (what `echo2 plan` picks) and the
    online scheduler keeps it there (paper 3.4, 4.3, C.2.1)."""
    policy: Literal["cost", "random"] = "cost"
    """"cost": lowest price per unit throughput first (ECHO-2). "random": activate uniformly at
    random until the target is reached, and never release (the paper's w/o-Cost ablation)."""
    gamma: float = Field(1.1, ge=1, allow_inf_nan=False)
    """Safety factor over mu_min."""
    sustain_s: float = Field(30.0, gt=0)
    """A deviation from the target must last this long before workers are activated or released."""
    release_margin: float = Field(0.15, ge=0)
    """Release only while capacity exceeds the target by more than this share."""
    window_s: float = Field(30.0, gt=0)
    """Sliding window over the throughput workers report."""
    interval_s: float = Field(2.0, gt=0)
    """How often the coordinator samples throughput and runs the scheduler (heartbeat period)."""
    heartbeat_timeout_s: float = Field(15.0, gt=0)
    """A worker silent this long is marked lost (and excised from the chain it relays for)."""
    startup_s: float = Field(0.0, ge=0)
    """Boot time of an activated worker before it fetches the current snapshot."""
    model: Literal["continuous", "paper"] | None = None
    """Capacity model of the target and the initial pool (planning/capacity.py); default follows
    rollout.keep_generating: "continuous" when workers keep generating (echo2), "paper" when they
    stop during a broadcast (the paper's assumption)."""


class FaultSpec(_Section):
    worker: str
    """A worker id (NAME-i), "forwarder" (the seed of the first chain that has a child) or "tail"
    (the last worker of the longest chain), chosen from the broadcast plan at fault time."""
    kind: Literal["drop", "slow"]
    """"drop": the worker disappears; "slow": it keeps running at `factor` of its speed."""
    stage: Literal["link", "rollout"] = "rollout"
    """For "slow": what slows, its upload (it forwards chunks slower) or its rollouts."""
    factor: float = Field(0.5, gt=0, le=1)
    """For "slow": the remaining share of speed."""
    at_s: float | None = Field(None, ge=0)
    """Fault time in seconds from the start; or give `publication`."""
    publication: int | None = Field(None, ge=1)
    """Fault `offset_s` seconds after the k-th snapshot publication (1 = the first)."""
    offset_s: float = Field(0.0, ge=0)
    duration_s: float | None = Field(None, gt=0)
    """For "slow": the worker is back at full speed after this long; default never."""

    @model_validator(mode="after")
    def _when(self) -> FaultSpec:
        if (self.at_s is None) == (self.publication is None):
            raise ValueError("at_s: give exactly one of at_s and publication")
        if self.duration_s is not None and self.kind == "drop":
            raise ValueError("duration_s: a dropped worker does not come back")
        return self


class SeriesSpec(_Section):
    label: str = ""
    """Legend label of this series."""
    set: dict[str, Any] = {}
    """Dotted keys (as on the command line) and their values for this series."""
    paper: dict[str, float] = {}
    """Published values of some metrics, shown beside the simulated ones (sweeps without x)."""


class SweepSpec(_Section):
    x: str | None = None
    """Dotted key swept over `values` (e.g. "workers.0.count"); omit to run each series once."""
    values: list[float] = []
    """Values of x."""
    series: list[SeriesSpec] = Field(default_factory=lambda: [SeriesSpec()], min_length=1)
    """One line (or one table row) per series."""
    metrics: list[str] = ["bubble_ratio"]
    """Metrics plotted against x (one panel each) and shown in the table."""
    plan_threshold: bool = False
    """Mark, for each series, the smallest x that `echo2 plan` (gamma = 1) finds sufficient, using
    the simulated T_bcast (x must be a worker count)."""
    lower_bound: bool = False
    """Draw the fluid lower bound M / Bw on T_bcast panels."""
    log_y: bool = False
    """Logarithmic y axes."""

    @model_validator(mode="after")
    def _rules(self) -> SweepSpec:
        if self.x is not None and not self.values:
            raise ValueError("sweep.values: give the values of sweep.x")
        if self.x is None and self.values:
            raise ValueError("sweep.x: values without a key to sweep")
        return self


class Scenario(_Section):
    name: str = ""
    """Title shown in reports."""
    seed: int = 0
    """Seeds every random draw; the same seed gives the same run."""
    steps: int = Field(40, ge=1)
    """Learner steps to simulate."""
    warmup_steps: int | None = Field(None, ge=0)
    """Steps excluded from steady-state metrics; default 2 * kappa. Whole publication cycles of
    kappa steps after it are measured."""
    learner: LearnerSpec
    broadcast: BroadcastSpec = Field(default_factory=BroadcastSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    workers: list[WorkerSpec] = []
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    faults: list[FaultSpec] = []
    sweep: SweepSpec | None = None

    @model_validator(mode="after")
    def _rules(self) -> Scenario:
        if not self.workers and not self.learner.colocated:
            raise ValueError("workers: at least one [[workers]] table (or learner.colocated = true)")
        if self.workers and self.learner.colocated:
            raise ValueError("workers: a colocated learner generates its own rollouts; remove [[workers]]")
        names = [w.name for w in self.workers]
        if len(set(names)) != len(names):
            raise ValueError("workers: names must be unique")
        ids = set(self.worker_ids())
        for i, f in enumerate(self.faults):
            if f.worker not in ids and f.worker not in SELECTORS:
                raise ValueError(
                    f"faults.{i}.worker: {f.worker!r} is neither a worker id ({min(ids, default='none')}, ...) "
                    f"nor one of {', '.join(SELECTORS)}"
                )
            if f.worker == "forwarder" and self.broadcast.topology == "star":
                raise ValueError(f"faults.{i}.worker: a star has no forwarders")
        if self.warmup_steps is not None and self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps: {self.warmup_steps} leaves no step of {self.steps} to measure")
        return self

    @property
    def capacity_model(self) -> Literal["continuous", "paper"]:
        """The capacity model the scheduler and `echo2 plan` use for this scenario."""
        if self.scheduler.model is not None:
            return self.scheduler.model
        return "continuous" if self.rollout.keep_generating else "paper"

    def publication_bytes(self, behind: int | None) -> float:
        """Bytes a worker `behind` publications behind receives (None: nothing installed), with
        broadcast.delta and its ratio (`planning.capacity.publication_bytes`)."""
        b = self.broadcast
        ratio = (
            b.delta_ratio if b.delta_ratio is not None else capacity.delta_ratio(self.learner.publish_every)
        )
        return capacity.publication_bytes(
            self.learner.snapshot_bytes, behind=behind, delta=b.delta, ratio=ratio
        )

    def worker_ids(self) -> list[str]:
        return [f"{w.name}-{i}" for w in self.workers for i in range(w.count)]

    @property
    def warmup(self) -> int:
        kappa = self.learner.publish_every
        return self.warmup_steps if self.warmup_steps is not None else min(2 * kappa, self.steps - 1)


# ---------------------------------------------------------------------------- loading
def validate(tree: dict[str, Any], where: str = "") -> Scenario:
    try:
        return Scenario.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(f"{where}{validation_message(e)}") from None


def load_tree(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The raw TOML tree of a scenario file with the overrides applied (not yet validated)."""
    tree = copy.deepcopy(read_toml(path))
    for key, value in (overrides or {}).items():
        set_dotted(tree, key, value)
    return tree


def expand(tree: dict[str, Any], where: str = "") -> list[tuple[str, float | None, Scenario]]:
    """(series label, x, scenario) for every point of the sweep, each validated; one point without
    a sweep. Errors name the series and the key."""
    base = validate(tree, where)
    if base.sweep is None:
        return [("", None, base)]
    sweep = base.sweep
    plain = {k: v for k, v in tree.items() if k != "sweep"}
    out = []
    for si, series in enumerate(sweep.series):
        for x in sweep.values or [None]:
            point = copy.deepcopy(plain)
            here = f"{where}sweep.series.{si}"
            for key, value in series.set.items():
                if key.startswith("sweep"):
                    raise ConfigError(f"{here}.set: {key!r} cannot change the sweep")
                set_dotted(point, key, copy.deepcopy(value))
            if x is not None:
                assert sweep.x is not None
                set_dotted(point, sweep.x, int(x) if float(x).is_integer() else x)
                here += f" at {sweep.x} = {x:g}"
            out.append((series.label, x, validate(point, f"{here}: ")))
    return out
