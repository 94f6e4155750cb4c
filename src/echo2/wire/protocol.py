"""Wire schemas of the coordinator's HTTP API (pydantic, `extra="forbid"`). See docs/protocol.md.

Imports no torch and no aiohttp: the coordinator validates requests with these models, and
`CoordinatorClient` (wire/client.py) sends them and parses the answers; the tests use both.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from echo2.config import (
    ArithmeticTaskConfig,
    BroadcastConfig,
    Config,
    ConfigError,
    CoordinatorConfig,
    GGUFModelConfig,
    LearnerConfig,
    LoraConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    TaskConfig,
)
from echo2.records import TEXT_PATTERN, Trajectory

API = "/v1"


HOST_PATTERN = r"^[A-Za-z0-9.:\[\]-]+$"
"""A host name or an IPv4/IPv6 address, as a relay advertises it."""


Id = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
"""A worker or lease id, as the coordinator issues them."""
MAX_RATE = 1e12
"""Bytes per second no transfer report may claim (8 Tbit/s: far above any real link)."""


class _Wire(BaseModel):
    # NaN and infinities written as JSON's usual NaN/Infinity (as json.dumps does), so a bad value
    # reaches the door as what it is, to be refused by name, not as a null
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


class RegisterRequest(_Wire):
    name: str = Field(min_length=1, max_length=128, pattern=TEXT_PATTERN)
    hardware: str = Field("cpu", max_length=256, pattern=TEXT_PATTERN)
    price_per_hour: float = Field(0.0, ge=0, allow_inf_nan=False)
    inbound: bool = False
    """Whether the worker accepts inbound connections (it may then relay snapshots to a child)."""
    relay_port: int | None = Field(None, ge=1, le=65535)
    """Port of the worker's relay server; without it the worker is never anyone's parent."""
    relay_host: str | None = Field(None, min_length=1, max_length=255, pattern=HOST_PATTERN)
    """Host peers reach the relay at; default: the address the registration came from."""
    throughput: float = Field(0.0, ge=0, le=1e9, allow_inf_nan=False)
    """Expected trajectories/s, used by the scheduler until heartbeats report a measured rate."""
    slot_proof: str | None = Field(None, min_length=1, max_length=256)
    """The secret of the provider slot the worker was started in ($ECHO2_SLOT_SECRET): a
    registration under a slot's name without it is refused (`slot_unproven`)."""


class RunSeed(_Wire):
    seed: int = 0


class LearnerView(_Wire):
    """Of the learner, what a worker installs by: the dtype snapshots arrive in, and whether they
    are LoRA adapters."""

    dtype: Literal["auto", "fp32", "bf16"] = LearnerConfig.model_fields["dtype"].default
    lora: LoraConfig | None = None


class RunView(_Wire):
    """The run as workers are told it at registration (`of`, from the learner's config), in the
    learner's own config types: the worker builds its `Config` from it (`config()`), and a reply
    that does not parse as them is refused like any other malformed answer. A section left out
    takes the config's defaults."""

    model: ModelConfig = Field(default_factory=GGUFModelConfig)
    task: TaskConfig = Field(default_factory=ArithmeticTaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)
    broadcast: BroadcastConfig = Field(default_factory=BroadcastConfig)
    run: RunSeed = Field(default_factory=RunSeed)
    learner: LearnerView = Field(default_factory=LearnerView)

    @classmethod
    def of(cls, config: Config) -> RunView:
        """What workers are told of `config`: its model, task, rollout, coordinator and broadcast
        sections, the seed, and the learner's snapshot dtype and LoRA. Not the run token
        (`coordinator.token`): the worker registered with it already, and echoing it tells nothing
        a token holder needs (issue 41 item 6)."""
        return cls(
            model=config.model,
            task=config.task,
            rollout=config.rollout,
            coordinator=config.coordinator.model_copy(update={"token": None}),
            broadcast=config.broadcast,
            run=RunSeed(seed=config.run.seed),
            learner=LearnerView(dtype=config.learner.dtype, lora=config.learner.lora),
        )

    def config(self) -> Config:
        """The worker's run config: these sections, the seed, the learner's dtype and LoRA; the
        rest at their defaults. A run whose sections do not agree is a ConfigError."""
        try:
            return Config(
                model=self.model,
                task=self.task,
                rollout=self.rollout,
                coordinator=self.coordinator,
                broadcast=self.broadcast,
                run=RunConfig(seed=self.run.seed),
                learner=LearnerConfig(dtype=self.learner.dtype, lora=self.learner.lora),
            )
        except ValueError as e:  # pydantic's ValidationError is one
            raise ConfigError(f"the run the coordinator sent: {e}") from None


class RegisterResponse(_Wire):
    worker_id: str
    run: RunView
    """The sections a worker needs: model, task, rollout, coordinator, broadcast, run.seed and the
    learner's snapshot dtype and LoRA."""
    heartbeat_interval: float
    published_version: int
    public_key: str
    """The learner's Ed25519 public key (hex): every snapshot manifest must carry its signature.
    A worker pins it for the run (docs/security.md): a different key later stops the worker."""
    credential: str
    """This worker's own secret, given once: every later call made as this worker carries it as
    its bearer token (the run token only admits new workers)."""
    epoch: str
    """Which start of the learner this is: a resumed learner is a new epoch, and a worker that
    holds versions newer than `published_version` from an earlier epoch drops them."""


class HeartbeatRequest(_Wire):
    worker_id: Id
    version: int = Field(ge=-1)
    throughput: float = Field(0.0, ge=0, le=1e9, allow_inf_nan=False)
    """Trajectories per second measured by the worker."""


class HeartbeatResponse(_Wire):
    published_version: int
    """The newest version the learner published."""
    epoch: str
    """Which start of the learner answers (see `RegisterResponse.epoch`)."""


class LeaseRequest(_Wire):
    worker_id: Id
    version: int = Field(ge=-1)
    """The worker's installed version; no lease is granted while it is older than v_learner - S."""
    max_groups: int = Field(ge=1, le=1024)


class LeaseResponse(_Wire):
    lease_id: str
    indices: list[int]
    """Training prompt indices; the worker builds prompts with the task, as the learner would."""
    deadline_s: float
    """Seconds from now until the lease is reissued to another worker."""
    sampling_seed: int = Field(0, ge=0, lt=2**63)
    """Seeds this lease's sampling noise under rollout.sampling = "gumbel" (rollout/sampling.py).
    Drawn by the coordinator, which writes it into every record it accepts on this lease."""


class ReturnRequest(_Wire):
    worker_id: Id
    lease_id: Id


class PushRequest(_Wire):
    worker_id: Id
    lease_id: Id
    records: list[Trajectory] = Field(min_length=1, max_length=4096)
    """Parsed straight into the one record type (records.py holds its fields and bounds); metadata's
    depth and size are checked by the door (pushparse.outcome: `metadata_problem`)."""


class PushResponse(_Wire):
    """A batch stored whole (`accepted` records), or acknowledged again (`duplicates`: records
    already stored by an earlier push of the same batch)."""

    accepted: int = Field(ge=0)
    duplicates: int = Field(ge=0)


class SnapshotInfo(_Wire):
    """`GET /v1/snapshot`: the newest published snapshot as a whole."""

    version: int
    size: int
    sha256: str


# ---------------------------------------------------------------------------- snapshot broadcast
class Published(_Wire):
    """`GET /v1/published`: the newest published version (-1: none yet)."""

    version: int


class RouteRequest(_Wire):
    worker_id: Id
    version: int = Field(ge=0)
    base: int | None = Field(None, ge=0)
    """The version whose bytes the worker holds (its installed one): a delta from it may do."""
    full: bool = False
    """Ask for the full snapshot (a delta failed to apply or verify)."""


FailureReason = Literal["unreachable", "stalled", "slow", "bad_chunk", "refused", "incomplete", "gone"]
"""Why a receiver left its parent; "gone": the parent no longer holds the version (no penalty);
"slow": its chunks arrived below the route's `min_rate_bps` (the parent is demoted)."""


class FailureRequest(_Wire):
    """A receiver's parent failed while sending `version`."""

    worker_id: Id
    version: int = Field(ge=0)
    parent_id: Id | None
    """The parent that failed (null: the learner itself)."""
    reason: FailureReason
    detail: str = Field("", max_length=1000)


class Route(_Wire):
    """Where a worker receives `version` from: the parent's relay, or the learner when null."""

    version: int
    parent_id: str | None
    url: str | None
    min_rate_bps: float | None = None
    """The relay floor: chunks from this parent arriving slower (bytes/s, over a progress timeout
    of reading) are reported "slow"; null: no floor (the learner, or not measured yet)."""
    form: Literal["full", "delta"] = "full"
    """What to receive: the full snapshot, or the delta from the worker's `base` (chunks and
    manifest with `?form=delta`)."""


class Transfer(_Wire):
    """One stream segment that ended cleanly: what came from one parent, and how fast."""

    parent_id: Id | None
    bytes: int = Field(ge=0, le=2**40)
    seconds: float = Field(ge=1e-6, le=1e6, allow_inf_nan=False)

    @model_validator(mode="after")
    def _plausible(self) -> Transfer:
        if self.bytes / self.seconds > MAX_RATE:
            raise ValueError(f"{self.bytes} bytes in {self.seconds}s is over {MAX_RATE:g} bytes/s")
        return self


class SentRequest(_Wire):
    """A relay's own account of one stream it served to a child (cross-checked against the
    child's install report before the transfer counts for the relay's score)."""

    worker_id: str
    version: int = Field(ge=0)
    child_id: str = Field(min_length=1, max_length=64)
    bytes: int = Field(ge=0, le=2**40)
    seconds: float = Field(gt=0, le=86400, allow_inf_nan=False)


class InstalledRequest(_Wire):
    worker_id: Id
    version: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """Of the installed snapshot's bytes; must equal the published one's."""
    transfers: list[Transfer] = Field([], max_length=256)
