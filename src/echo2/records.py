"""The trajectory record every plane exchanges, the snapshot a learner publishes, and the report of
a learner step it hands its rollout source (learning/sources/__init__.py).

Owns the shape and validation of a record; knows nothing of tensors, models or sockets. A record is
immutable and round-trips through `to_dict`/`from_dict` (JSON-safe), so the same object travels from
the rollout plane to the buffer and the learner, in process or over the network.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any


class InvalidTrajectory(ValueError):
    """A record that breaks the schema; `reason` is the code the coordinator counts it under."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True, kw_only=True)
class Trajectory:
    """One sampled response to one prompt, scored on the rollout side."""

    group_id: str
    """All `group_size` samples of one prompt share this id; GRPO normalises within it."""
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    behaviour_logprobs: tuple[float, ...]
    """log pi_behaviour(token) of each response token, at the sampling temperature."""
    loss_mask: tuple[int, ...]
    """1 for response tokens that carry loss (the task decides), 0 otherwise."""
    reward: float
    version: int
    """Policy version that generated the response."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Task data (e.g. reference answer, correctness) kept for metrics."""
    record_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            reason, detail = problem
            raise InvalidTrajectory(reason, f"invalid trajectory {self.record_id}: {detail}")

    def problem(self) -> tuple[str, str] | None:
        """(reason code, detail) if this record is malformed, else None."""
        n = len(self.response_ids)
        if not self.prompt_ids:
            return "malformed", "empty prompt"
        if len(self.behaviour_logprobs) != n or len(self.loss_mask) != n:
            return "malformed", "response_ids, behaviour_logprobs and loss_mask differ in length"
        if not math.isfinite(self.reward):
            return "non_finite_reward", f"reward {self.reward}"
        if self.version < 0:
            return "malformed", "negative version"
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        return cls(
            group_id=str(d["group_id"]),
            prompt_ids=tuple(int(t) for t in d["prompt_ids"]),
            response_ids=tuple(int(t) for t in d["response_ids"]),
            behaviour_logprobs=tuple(float(x) for x in d["behaviour_logprobs"]),
            loss_mask=tuple(int(x) for x in d["loss_mask"]),
            reward=float(d["reward"]),
            version=int(d["version"]),
            metadata=dict(d.get("metadata", {})),
            record_id=str(d["record_id"]),
        )


LORA_A, LORA_B = ".lora_A", ".lora_B"
"""Key suffixes of an adapter snapshot: `LAYER.lora_A` [r, in], `LAYER.lora_B` [out, r] (scale folded
in), LAYER a module name of the base model; the layer's weight is base + lora_B @ lora_A."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """An immutable copy of the policy weights at one version, as published by the learner: the
    whole state dict, or (LoRA) only the adapter, which applies to the base weights every engine
    loaded at start. Both travel as the same bytes (a safetensors file of `state`)."""

    version: int
    state: Mapping[str, Any]
    """Parameter name -> tensor, detached copies never written again: a dict, or (a received
    snapshot) a lazy mapping that reads each tensor when it is looked up
    (rollout/safetensors_view.py). A full state leaves out tied aliases (`lm_head.weight` under
    tie_word_embeddings): each weight travels once, and the engines load the weight it shares."""

    @property
    def is_adapter(self) -> bool:
        """True when `state` holds only a LoRA adapter; read from its keys, so it survives the wire."""
        return bool(self.state) and all(k.endswith((LORA_A, LORA_B)) for k in self.state)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepReport:
    """What the learner tells its source after each step (`RolloutSource.advance`)."""

    step: int
    version: int
    """The learner's version after the step."""
    snapshot: Callable[[], Snapshot]
    """Makes the weights of `version`, for a source that publishes them now (under torchrun a
    gather every rank takes part in)."""
    train_s: float
    """Seconds the step trained (T_train)."""
    stats: dict[str, float]
    """`train_step`'s metrics (the `offpolicy/*` diagnostics among them)."""
    staleness: dict[int, int]
    """Records trained on so far in the run, by staleness: the learner's histogram (kept across a
    resume by its checkpoint)."""
    refused: dict[str, list[Trajectory]]
    """Records the learner took and then refused, by reason: "logprob_mismatch" (left out of the
    step, learning/verify.py) and "non_finite_step" (every record of a step not applied)."""
