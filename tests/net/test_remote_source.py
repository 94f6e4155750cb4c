"""The remote source keeps behind the `RolloutSource` seam what only a coordinator needs: it binds
nothing before `start`, times a calibration step there when the scheduler has no T_train, publishes
every `learner.publish_every` versions and strikes the makers of records the learner refused
(coordinator on 127.0.0.1 port 0)."""

from __future__ import annotations

from support import TINY

from echo2.config import load_config
from echo2.data.buffer import ReplayBuffer
from echo2.data.tasks import make_task
from echo2.learning.sources.remote import RemoteRollout
from echo2.records import Snapshot, StepReport, Trajectory


def remote(tmp_path, overrides: dict, timer=None) -> RemoteRollout:
    config = load_config(TINY, {"coordinator.token": "t", **overrides})
    return RemoteRollout(
        config,
        task=make_task(config.task, seed=0),
        buffer=ReplayBuffer(staleness=config.learner.staleness, group_size=config.rollout.group_size),
        vocab_size=100,
        run_dir=tmp_path,
        time_train_step=timer,
    )


def report(version: int, made: list[int], refused: list[Trajectory] = ()) -> StepReport:
    def snapshot() -> Snapshot:
        made.append(version)
        return Snapshot(version=version, state={})

    return StepReport(
        step=version - 1,
        version=version,
        snapshot=snapshot,
        train_s=0.25,
        stats={},
        staleness={0: 8 * version},
        refused={"logprob_mismatch": list(refused)},
    )


def test_start_binds_calibrates_and_publishes_then_every_kappa(tmp_path):
    timed: list[str] = []
    source = remote(
        tmp_path,
        {"scheduler.enabled": True, "learner.staleness": 3, "learner.kappa": 2},
        timer=lambda: timed.append("step") or 2.5,
    )
    assert source.url is None and not (tmp_path / "coordinator.url").exists(), "nothing bound yet"
    made: list[int] = []
    try:
        source.start(Snapshot(version=0, state={}))
        assert timed == ["step"] and source.t_train_hint == 2.5, "T_train before the first step"
        assert (tmp_path / "coordinator.url").read_text().strip() == source.url
        assert source.token_origin == "coordinator.token" and not (tmp_path / "coordinator.token").exists()
        for version in range(1, 5):
            source.advance(report(version, made))
        assert made == [2, 4] and source.state.shared.published_version == 4
    finally:
        measured = source.close()
    assert measured["t_train"] == 0.25 and measured["staleness_histogram"] == {"0": 32}


def test_a_configured_t_train_needs_no_calibration_and_refusals_are_counted(tmp_path):
    source = remote(tmp_path, {"scheduler.enabled": True, "scheduler.t_train": 7.0}, timer=lambda: 1 / 0)
    record = Trajectory(
        group_id="g0",
        prompt_ids=(1,),
        response_ids=(2,),
        behaviour_logprobs=(-1.0,),
        loss_mask=(1,),
        reward=0.0,
        version=0,
    )
    try:
        source.start(Snapshot(version=0, state={}))
        assert source.t_train_hint == 7.0
        source.advance(report(1, [], refused=[record]))
        assert source.state.intake.integrity.flagged["logprob_mismatch"] == 1
    finally:
        source.close()
