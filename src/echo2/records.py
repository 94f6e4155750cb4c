"""The trajectory record every plane exchanges, the snapshot a learner publishes, and the report of
a learner step it hands its rollout source (learning/sources/__init__.py).

Owns the shape and validation of a record; knows nothing of tensors, models or sockets. A record is
immutable and is the one type a trajectory has from the worker to the buffer and the journal: its
fields are written once, here, with their wire bounds (`Annotated` pydantic constraints, which the
push model `wire.protocol.PushRequest` applies when it parses a body straight into `Trajectory`s; a
record made in process is checked only by `__post_init__`). It round-trips through
`to_dict`/`from_dict` (JSON-safe, the same schema), in process or over the network.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any

from pydantic import ConfigDict, Field, TypeAdapter, with_config

TEXT_PATTERN = r"^[^\x00-\x1f\x7f]*$"
"""Free text a peer sends (names, hardware, record ids): no control characters, so no line of a log
is forged."""
MAX_TOKENS = 65536
"""Tokens of a prompt or a response one record may carry on the wire (and log-probs, mask values)."""
RecordKey = Annotated[str, Field(min_length=1, max_length=64, pattern=TEXT_PATTERN)]
"""A record or group id, as workers and tasks make them."""


class InvalidTrajectory(ValueError):
    """A record that breaks the schema; `reason` is the code the coordinator counts it under."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


# NaN and infinities written as JSON's usual NaN/Infinity (as json.dumps does), so a bad value reaches
# the door as what it is, to be refused by name (`problem`), not as a null
@with_config(ConfigDict(extra="forbid", ser_json_inf_nan="constants"))
@dataclass(frozen=True, slots=True, kw_only=True)
class Trajectory:
    """One sampled response to one prompt, scored on the rollout side."""

    group_id: RecordKey
    """All `group_size` samples of one prompt share this id; GRPO normalises within it."""
    prompt_ids: Annotated[tuple[int, ...], Field(min_length=1, max_length=MAX_TOKENS)]
    response_ids: Annotated[tuple[int, ...], Field(max_length=MAX_TOKENS)]
    behaviour_logprobs: Annotated[tuple[float, ...], Field(max_length=MAX_TOKENS)]
    """log pi_behaviour(token) of each response token, at the sampling temperature."""
    loss_mask: Annotated[tuple[int, ...], Field(max_length=MAX_TOKENS)]
    """1 for response tokens that carry loss (the task decides), 0 otherwise."""
    reward: float
    """Checked against the task's reward range by the coordinator (wire/validate.py); a NaN is
    refused here, as `non_finite_reward`."""
    version: Annotated[int, Field(ge=0, le=2**62)]
    """Policy version that generated the response."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Task data (e.g. reference answer, correctness) kept for metrics. From a worker: free data
    of bounded depth and size (wire/validate.py: `metadata_problem`, at the door), and the
    coordinator's own word on who generated it and the lease's sampling seed."""
    record_id: RecordKey = field(default_factory=lambda: uuid.uuid4().hex)

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
        """`to_dict`'s output (or a journal's JSON) back as a record, checked by the wire schema;
        raises pydantic's ValidationError (InvalidTrajectory's problems among its errors)."""
        return _RECORD.validate_python(d)


_RECORD = TypeAdapter(Trajectory)


def invalid_in(errors: list[dict[str, Any]]) -> InvalidTrajectory | None:
    """The first `InvalidTrajectory` among a ValidationError's `errors()` when every error is one
    (a record the schema admits but `problem` refuses: lengths, a NaN reward), else None (a body
    that breaks the schema)."""
    found = [e.get("ctx", {}).get("error") for e in errors]
    if found and all(isinstance(x, InvalidTrajectory) for x in found):
        return found[0]
    return None


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
