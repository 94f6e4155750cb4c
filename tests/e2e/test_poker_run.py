"""Poker end to end: `echo2 run --workers 2` with S = 1 on the tiny model, a multi-turn environment
task chosen by the task section alone. The learner's train step is wrapped to see every record it
trains on: masks, versions and returns are checked against a replay of each episode."""

from __future__ import annotations

import json

from support import TINY

from echo2.cli import main
from echo2.config import load_config
from echo2.data.tasks import make_task
from echo2.learning import loop
from echo2.metrics import read_metrics
from echo2.models import load_tokenizer
from echo2.rollout.replay import replay_problem

POKER = [
    "--task.type=env",
    "--task.env=poker:heads_up?opponent=random&stack_bb=10",
    "--task.max_turns=3",
    "--task.max_tokens=400",
    "--rollout.max_prompt_tokens=400",
]


def test_poker_with_two_workers_and_staleness(tmp_path, monkeypatch):
    seen: list[tuple[int, list]] = []
    train_step = loop.train_step

    def spy(model, optimizer, groups, config, **kw):
        seen.append((kw["check"].learner_version, [list(g) for g in groups]))
        return train_step(model, optimizer, groups, config, **kw)

    monkeypatch.setattr(loop, "train_step", spy)
    run_dir = tmp_path / "run"
    steps = 3
    code = main(
        ["run", TINY, f"--run.dir={run_dir}", "--workers=2", *POKER, "--learner.staleness=1",
         f"--learner.steps={steps}", "--run.eval_size=3", "--coordinator.heartbeat_interval=0.2", "-q"]
    )  # fmt: skip
    assert code == 0
    config = load_config(
        TINY, {"task.type": "env", "task.env": POKER[1].split("=", 1)[1], "task.max_turns": 3}
    )
    task = make_task(config.task, seed=0)
    tokenizer = load_tokenizer(config.model)
    assert len(seen) == steps
    for learner_version, groups in seen:
        assert len(groups) == 2 and all(len(g) == 4 for g in groups)
        for group in groups:
            assert len({r.metadata["env_seed"] for r in group}) == 1, "a group is one initial state"
            for rec in group:
                assert learner_version - 1 <= rec.version <= learner_version  # S = 1
                meta = rec.metadata
                assert meta["episode"] and meta["grouping"] == "state" and 1 <= meta["turns"] <= 3
                mask = rec.loss_mask
                assert len(mask) == len(rec.response_ids) == len(rec.behaviour_logprobs)
                starts = sum(1 for a, b in zip((0, *mask), mask, strict=False) if b and not a)
                assert starts == meta["turns"], "one run of loss tokens per reply"
                assert all(lp == 0.0 for lp, m in zip(rec.behaviour_logprobs, mask, strict=True) if not m)
                prompt = task._prompt(rec.group_id, meta["env_seed"])
                assert replay_problem(task, prompt, rec, tokenizer) is None  # tokens, masks, return
                assert -10 - 3 <= rec.reward <= 10
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) == steps and max(r["staleness/max"] for r in rows) <= 1
    assert all(0 <= r["episode/malformed_frac"] <= 1 for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert not {k: v for k, v in summary["ingest_rejected"].items() if k != "stale"}, (
        "the learner's replay accepted every pushed episode (a push too stale for S = 1 is refused by admission)"
    )
    after = summary["eval_after"]
    assert after["eval/count"] == 3 and "eval/outcome_mean" in after and "eval/malformed_frac" in after
