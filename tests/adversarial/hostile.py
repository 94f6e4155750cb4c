"""A hostile worker and the learner it attacks, on real loopback (port 0), for the adversarial suite.

`Door` is a coordinator as a learner serves it (the arithmetic task, a referee with the task's reward,
the door's validation) plus the learner's side: a tiny random model, its optimizer, and an honest
engine that generates real records for leased prompts. `HostileWorker` sends whatever a test wants,
as raw JSON if need be. After every attack a test calls `door.invariant(before, reason)`: nothing
but the refusal counter of `reason` changed, and the learner still trains on honest records with
finite weights.

The tokenizer is a character-level stand-in (`CharTokenizer`), so the suite needs no tokenizer file
and starts in a second.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from echo2.config import (
    ArithmeticTaskConfig,
    CoordinatorConfig,
    LearnerConfig,
    RolloutConfig,
    TinyModelConfig,
)
from echo2.coordinator.leases import Limits, Work
from echo2.coordinator.server import Coordinator
from echo2.coordinator.state import CoordinatorState
from echo2.data.buffer import ReplayBuffer
from echo2.data.tasks.arithmetic import ArithmeticTask
from echo2.learning.step import make_optimizer, train_step
from echo2.learning.verify import StepCheck, TaskReferee
from echo2.models import load_model
from echo2.records import Trajectory
from echo2.rollout.collect import collect
from echo2.rollout.engine import HFEngine
from echo2.wire.validate import reward_range

TOKEN = "hostile-test-token"
_SAMPLES: dict[tuple[tuple[int, ...], int], list[list[Trajectory]]] = {}
_MODEL: list[torch.nn.Module] = []
"""The tiny model as loaded (seed 0), kept for the whole session; each door trains a copy."""
GROUP_SIZE = 2
PROMPTS = 2


class CharTokenizer:
    """One token per character (ids 2..127); 0 pads, 1 ends. Enough for the arithmetic task."""

    chat_template = None
    pad_token_id = 0
    eos_token_id = 1

    def __len__(self) -> int:
        return 128

    def __call__(self, text: str, add_special_tokens: bool = False) -> SimpleNamespace:
        return SimpleNamespace(input_ids=[min(max(ord(c), 2), 127) for c in text])

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if i >= 2 or not skip_special_tokens)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class HostileWorker:
    """Speaks the coordinator's protocol, and anything else it likes."""

    def __init__(self, url: str, name: str = "mallory") -> None:
        self.url = url
        self.worker_id = ""
        self.secret = TOKEN
        """What its calls carry: the run token until it registers, then its own credential."""
        if name:
            status, body = self.call("POST", "/v1/register", {"name": name})
            assert status == 200, body
            self.worker_id, self.secret = body["worker_id"], body["credential"]

    def call(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None) -> tuple[int, Any]:
        """(status, parsed JSON body); a body that is not JSON comes back as the string it is."""
        data = (
            raw
            if raw is not None
            else (json.dumps(body, allow_nan=True).encode() if body is not None else None)
        )
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {TOKEN if path == '/v1/register' else self.secret}")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                status, payload = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, payload = e.code, e.read()
        try:
            return status, json.loads(payload) if payload else None
        except ValueError:
            return status, payload.decode(errors="replace")

    def lease(self, *, version: int = 0, max_groups: int = PROMPTS) -> tuple[int, Any]:
        return self.call(
            "POST", "/v1/lease", {"worker_id": self.worker_id, "version": version, "max_groups": max_groups}
        )

    def push(self, lease_id: str, records: list[dict]) -> tuple[int, Any]:
        return self.call(
            "POST",
            "/v1/trajectories",
            {"worker_id": self.worker_id, "lease_id": lease_id, "records": records},
        )


@dataclass
class Door:
    state: CoordinatorState
    server: Coordinator
    clock: FakeClock
    task: ArithmeticTask
    tokenizer: CharTokenizer
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    engine: HFEngine
    config: LearnerConfig

    @property
    def url(self) -> str:
        return self.server.url

    # ------------------------------------------------------------------ honest records
    def generate(self, indices: list[int], *, version: int = 0) -> list[list[Trajectory]]:
        """What an honest worker pushes for these prompts: real samples of the engine (whose weights
        never change, so the samples are kept for the next test), scored, with fresh record ids."""
        key = (tuple(indices), version)
        if key not in _SAMPLES:
            self.engine.version = version
            torch.manual_seed(indices[0])
            prompts = [self.task.train_prompt(i) for i in indices]
            _SAMPLES[key] = collect(self.engine, self.task, prompts, n=GROUP_SIZE)
        return [[dataclasses.replace(r, record_id=uuid.uuid4().hex) for r in g] for g in _SAMPLES[key]]

    def honest_lease(self, worker: HostileWorker) -> tuple[str, list[dict]]:
        """A lease for `worker` and the honest wire records for it (not pushed)."""
        status, lease = worker.lease()
        assert status == 200, lease
        groups = self.generate(lease["indices"])
        return lease["lease_id"], [json.loads(json.dumps(r.to_dict())) for g in groups for r in g]

    # ------------------------------------------------------------------ the invariant
    def snapshot(self) -> dict[str, Any]:
        """Everything a refused input must leave as it was (the refusal counters aside)."""
        s = self.state
        with s.shared.lock:
            return {
                "accepted": s.intake.ingestion.accepted,
                "buffer": s.intake.buffer.contents_by_version(),
                "seen": sorted(s.intake.buffer._seen),
                "leases": {
                    k: (v.worker_id, v.indices, set(v.done_groups))
                    for k, v in s.intake.ingestion.leases.items()
                },
                "next_index": s.intake.ingestion.next_index,
                "reissue": list(s.intake.ingestion.reissue),
                "workers": {k: (w.version, w.throughput, w.status) for k, w in s.registry.workers.items()},
                "published": s.shared.published_version,
                "rates": list(s.publisher.bcast.credits.rates),
                "rejected": dict(s.intake.ingestion.rejected),
            }

    def invariant(self, before: dict[str, Any], reason: str | None, *, count: int | None = None) -> None:
        """Nothing changed but the refusal counter of `reason` (by `count` if given), and the
        learner still trains on honest records: the step is applied and every weight is finite."""
        after = self.snapshot()
        rejected_before, rejected_after = before.pop("rejected"), after.pop("rejected")
        assert after == before, "a refused input changed the state"
        changed = {
            k
            for k in rejected_after.keys() | rejected_before.keys()
            if rejected_after.get(k) != rejected_before.get(k)
        }
        assert changed <= ({reason} if reason else set()), f"counters changed: {changed}"
        if count is not None and reason:
            assert rejected_after.get(reason, 0) - rejected_before.get(reason, 0) == count
        self.learner_trains()

    def learner_trains(self) -> dict[str, float]:
        """An honest worker fills a batch; the learner takes it and trains one step."""
        honest = HostileWorker(self.url, "honest")
        lease_id, records = self.honest_lease(honest)
        status, body = honest.push(lease_id, records)
        assert status == 200 and body["accepted"] == len(records), body
        stats = self.train(PROMPTS)
        assert stats["train/skipped_step"] == 0.0
        return stats

    def train(self, num_groups: int, check: StepCheck | None = None) -> dict[str, float]:
        groups, _ = self.state.intake.take_groups(num_groups, timeout=5.0)
        assert len(groups) == num_groups, "the learner found no batch"
        check = check or StepCheck(max_logratio=self.config.max_logratio, learner_version=0)
        stats = train_step(
            self.model, self.optimizer, groups, self.config, pad_id=0, temperature=1.0, check=check
        )
        assert all(torch.isfinite(p).all() for p in self.model.parameters()), "a weight is not finite"
        return stats

    def close(self) -> None:
        self.server.stop()


def open_door(**section: Any) -> Door:
    """A coordinator with the door's checks and the task's referee, version 0 published."""
    torch.manual_seed(0)
    tokenizer = CharTokenizer()
    task = ArithmeticTask(ArithmeticTaskConfig(), seed=0)
    clock = FakeClock()
    state = CoordinatorState(
        CoordinatorConfig(
            **{
                "lease_timeout": 30.0,
                "heartbeat_timeout": 10.0,
                "groups_per_lease": PROMPTS,
                "max_leases_per_worker": 4,
            }
            | section
        ),
        work=Work(
            buffer=ReplayBuffer(staleness=1, group_size=GROUP_SIZE),
            limits=Limits(
                vocab_size=len(tokenizer),
                max_prompt_tokens=256,
                max_new_tokens=4,
                group_size=GROUP_SIZE,
                reward_range=reward_range(task),
            ),
            group_id_of=lambda i: task.train_prompt(i).group_id,
            groups_per_step=PROMPTS,
        ),
        clock=clock,
        referee=TaskReferee(task, tokenizer),
    )
    server = Coordinator(state, token=TOKEN, run_info={}, heartbeat_interval=1.0, max_body=4 * 2**20)
    server.start()
    state.publisher.publish(0, b"weights-v0", keep=2)
    if not _MODEL:
        _MODEL.append(load_model(TinyModelConfig(), vocab_size=len(tokenizer), seed=0))
    model = copy.deepcopy(_MODEL[0])
    config = LearnerConfig(lr=1e-4, micro_batch_tokens=4096)
    engine = HFEngine(
        copy.deepcopy(model),
        tokenizer,
        RolloutConfig(max_new_tokens=4, group_size=GROUP_SIZE, temperature=1.0),
    )
    return Door(
        state=state,
        server=server,
        clock=clock,
        task=task,
        tokenizer=tokenizer,
        model=model,
        optimizer=make_optimizer(model, config),
        engine=engine,
        config=config,
    )
