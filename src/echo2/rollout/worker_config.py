"""What `echo2 worker`'s flags say (`WorkerConfig`), and the two ways a worker refuses to go on at
start or at a registration (`RelayStartError`, `KeyChanged`). Pure: no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    """What `echo2 worker`'s flags say; the run's own config comes from the coordinator."""

    url: str
    """The coordinator, e.g. http://10.0.0.2:8765."""
    token: str
    name: str
    price_per_hour: float = 0.0
    hardware: str = "cpu"
    inbound: bool = False
    """Accepts inbound connections: runs a relay server on relay_host:relay_port."""
    give_up_after: float = 300.0
    """Seconds of unreachable coordinator after which a call gives up (and the worker stops)."""
    engine: Literal["hf", "vllm"] | None = None
    """The engine this worker generates with (`--engine`); None: the run's rollout.engine."""
    emulate: float | None = None
    """Trajectories/s of an EmulatedEngine instead of a model (capacity experiments only)."""
    throughput: float | None = None
    """Trajectories/s this worker declares at registration; None: the `emulate` rate, else it times a
    calibration generation once its model is loaded."""
    relay_host: str = "0.0.0.0"
    relay_port: int = 0
    relay_advertise: str | None = None
    """Host peers reach the relay at; None: the address the coordinator sees."""
    upload_mbps: float | None = None
    download_mbps: float | None = None
    """Caps in Mbit/s; None takes the run's broadcast.worker_upload_mbps / worker_download_mbps."""
    learner_key: str | None = None
    """Fingerprint of the learner's public key (`echo2 learner` logs it); None: trust the first
    key seen and never accept another."""
    ca_file: str | None = None
    """CA bundle to verify an https coordinator with (default: the system's)."""

    def __post_init__(self) -> None:
        if self.emulate is not None and not self.emulate > 0:
            raise ValueError(f"emulate: must be > 0, got {self.emulate}")
        if self.throughput is not None and not self.throughput > 0:
            raise ValueError(f"throughput: must be > 0, got {self.throughput}")


class RelayStartError(Exception):
    """The relay server could not listen where the flags say."""


class KeyChanged(Exception):
    """The coordinator presented a learner key other than the pinned one: the worker stops."""
