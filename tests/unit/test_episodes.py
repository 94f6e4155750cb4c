"""Multi-turn episodes: turn-aware masks checked by hand on a three-turn episode (and against the
causal shift the learner applies), returns, grouping by state and by batch, limits, and the
learner's replay of a pushed episode."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from support import TINY

from echo2.config import EnvTaskConfig, load_config
from echo2.data.envs.base import EnvTask, StepResult, to_messages
from echo2.data.tasks.base import to_tensors
from echo2.learning.grpo import batch_advantages, group_advantages
from echo2.models import load_tokenizer
from echo2.rollout.engine import Sample
from echo2.rollout.episodes import collect_episodes, episode_stats
from echo2.rollout.replay import replay_problem


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(load_config(TINY).model)


class Scripted:
    """Three turns whatever the replies: rewards -1 (a malformed first reply), 0, then 2.5 + seed."""

    system_prompt = "Play."
    reply_prefix = ""

    def reset(self, seed: int) -> str:
        self.seed, self.t = seed, 0
        return f"start {seed}"

    def step(self, action_text: str) -> StepResult:
        self.t += 1
        done = self.t == 3
        reward = {1: -1.0, 2: 0.0, 3: 2.5 + self.seed}[self.t]
        return StepResult(observation=f"obs {self.t + 1}", reward=reward, done=done, malformed=self.t == 1)

    def finish(self) -> float:
        return 10.0  # what the default actions win when the episode is cut


class FakeEngine:
    """Replies "a", "bb", "ccc" (text + EOS) with log-prob -0.5 per token, in turn order."""

    def __init__(self, tokenizer, config) -> None:
        self.tokenizer, self.config, self.version = tokenizer, config, 7
        self.calls: list[list[list[int]]] = []

    def generate_ids(self, encoded, *, n, greedy=False):
        assert n == 1
        self.calls.append([list(c) for c in encoded])
        text = ["a", "bb", "ccc"][len(self.calls) - 1]
        ids = tuple(self.tokenizer(text, add_special_tokens=False).input_ids) + (self.tokenizer.eos_token_id,)
        return [
            [Sample(prompt_ids=(), response_ids=ids, logprobs=(-0.5,) * len(ids), text=text)] for _ in encoded
        ]


def _task(**kw) -> EnvTask:
    return EnvTask(Scripted, EnvTaskConfig(env="scripted:x", **kw), seed=0)


def _rollout(tokenizer, task, *, n=1, max_new_tokens=8, max_prompt_tokens=512):
    config = load_config(TINY).rollout.model_copy(
        update={"max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens}
    )
    engine = FakeEngine(tokenizer, config)
    prompt = task._prompt("g", 1)  # the initial state of seed 1
    return engine, prompt, collect_episodes(engine, task, [prompt], n=n, config=config)


def test_three_turn_masks_by_hand(tokenizer):
    task = _task()
    engine, prompt, [[rec]] = _rollout(tokenizer, task)
    eos = tokenizer.eos_token_id
    # The whole episode is exactly the chat template of its messages, tokenized (ending at the last
    # reply's EOS): nothing is re-tokenized across turns, nothing is lost or doubled.
    messages = to_messages("Play.", ["start 1", "obs 2", "obs 3"], ["a", "bb", "ccc"], [-1.0, 0.0, 2.5])
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.endswith(tokenizer.eos_token + "\n")
    full = tokenizer(text[: -len("\n")], add_special_tokens=False).input_ids
    assert list(rec.prompt_ids + rec.response_ids) == full
    first = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert list(rec.prompt_ids) == tokenizer(first, add_special_tokens=False).input_ids
    # The mask, by hand: reply tokens (and their EOS) 1, the env's tokens between them 0.
    reply = {t: tokenizer(t, add_special_tokens=False).input_ids + [eos] for t in ("a", "bb", "ccc")}
    between = len(engine.calls[1][0]) - len(engine.calls[0][0]) - len(reply["a"])
    between2 = len(engine.calls[2][0]) - len(engine.calls[1][0]) - len(reply["bb"])
    expected = [1] * len(reply["a"]) + [0] * between + [1] * len(reply["bb"]) + [0] * between2
    expected += [1] * len(reply["ccc"])
    assert list(rec.loss_mask) == expected
    sampled = [t for t, m in zip(rec.response_ids, rec.loss_mask, strict=True) if m]
    assert sampled == reply["a"] + reply["bb"] + reply["ccc"]
    assert [lp for lp, m in zip(rec.behaviour_logprobs, rec.loss_mask, strict=True) if m] == [-0.5] * len(
        sampled
    )
    assert all(lp == 0.0 for lp, m in zip(rec.behaviour_logprobs, rec.loss_mask, strict=True) if not m)
    # Each turn was generated from the whole conversation so far.
    assert engine.calls[0][0] == list(rec.prompt_ids)
    assert engine.calls[2][0] == list(rec.prompt_ids + rec.response_ids)[: -len(reply["ccc"])]


def test_masks_align_with_the_causal_shift(tokenizer):
    """In the learner's tensors, a loss-carrying target is a sampled token, and the logits that
    predict it are those of the token just before it in the sequence."""
    _, _, [[rec]] = _rollout(tokenizer, _task())
    batch = to_tensors([rec], pad_id=tokenizer.pad_token_id, advantages=[1.0])
    seq = list(rec.prompt_ids + rec.response_ids)
    k, width = batch.targets.shape[1], batch.input_ids.shape[1]
    for j in range(k):
        pos = width - k + j  # the target's position; logits at pos - 1 predict it
        assert batch.targets[0, j] == batch.input_ids[0, pos] == seq[len(seq) - k + j]
        in_reply = rec.loss_mask[j - (k - len(rec.response_ids))] if j >= k - len(rec.response_ids) else 0
        assert batch.loss_mask[0, j] == in_reply
    assert batch.loss_mask.sum() == sum(rec.loss_mask)


def test_returns_and_metadata(tokenizer):
    _, _, groups = _rollout(tokenizer, _task(), n=3)
    assert len(groups) == 1 and len(groups[0]) == 3
    for rec in groups[0]:
        assert rec.reward == pytest.approx(-1.0 + 0.0 + 3.5)  # R = sum of the step rewards (F.5.2)
        assert rec.version == 7 and rec.group_id == groups[0][0].group_id
        meta = rec.metadata
        assert (meta["turns"], meta["malformed"], meta["truncated"], meta["grouping"]) == (
            3,
            1,
            False,
            "state",
        )
    stats = episode_stats(groups[0])
    assert stats["episode/malformed_frac"] == pytest.approx(1 / 3) and stats["episode/turns_mean"] == 3


def test_turn_and_token_limits_truncate(tokenizer):
    _, _, [[rec]] = _rollout(tokenizer, _task(max_turns=2))
    assert rec.metadata["truncated"] and rec.metadata["turns"] == 2
    assert rec.reward == pytest.approx(-1.0 + 0.0 + 10.0)  # finish() adds the default actions' result
    assert sum(1 for a, b in zip((0, *rec.loss_mask), rec.loss_mask, strict=False) if b and not a) == 2
    _, _, [[short]] = _rollout(tokenizer, _task(max_tokens=60), max_prompt_tokens=512)
    assert short.metadata["turns"] == 1 and short.metadata["truncated"]


def test_group_normalisation_by_state_and_by_batch():
    """Two initial states, two episodes each: by state each pair is normalised on its own (a pair
    of equal returns gets 0), by batch all four share one mean and std (F.5.2)."""
    rewards = torch.tensor([[1.0, 3.0], [10.0, 10.0]])
    by_state = group_advantages(rewards, eps=1e-9).flatten().tolist()
    s = 1 / math.sqrt(2)  # (1 - 2) / std(1, 3) with the unbiased std sqrt(2)
    assert by_state == pytest.approx([-s, s, 0.0, 0.0])
    by_batch = batch_advantages(rewards, eps=1e-9).flatten().tolist()
    mean = 6.0
    std = math.sqrt(((1 - mean) ** 2 + (3 - mean) ** 2 + 2 * (10 - mean) ** 2) / 3)
    assert by_batch == pytest.approx([(1 - mean) / std, (3 - mean) / std, 4 / std, 4 / std])


def test_replay_accepts_the_episode_and_refuses_tampering(tokenizer):
    task = _task()
    _, prompt, [[rec]] = _rollout(tokenizer, task)
    assert replay_problem(task, prompt, rec, tokenizer) is None
    forged = dataclasses.replace(rec, reward=rec.reward + 1)
    assert replay_problem(task, prompt, forged, tokenizer)[0] == "reward_mismatch"
    first_zero = rec.loss_mask.index(0)
    mask = list(rec.loss_mask)
    mask[first_zero] = 1  # an env token claimed as sampled
    assert (
        replay_problem(task, prompt, dataclasses.replace(rec, loss_mask=tuple(mask)), tokenizer)[0]
        == "bad_mask"
    )
    ids = list(rec.response_ids)
    ids[first_zero + 3] = ids[first_zero + 3] + 1  # a changed observation
    assert (
        replay_problem(task, prompt, dataclasses.replace(rec, response_ids=tuple(ids)), tokenizer)[0]
        == "bad_mask"
    )
    claims = dataclasses.replace(rec, metadata={**rec.metadata, "malformed": 0})
    assert replay_problem(task, prompt, claims, tokenizer)[0] == "reward_mismatch"


def test_the_coordinators_referee_replays_episodes(tokenizer):
    """`TaskReferee` (run at ingestion) checks an episode against the leased prompt and its replay."""
    from echo2.learning.verify import TaskReferee

    task = _task()
    config = load_config(TINY).rollout
    engine = FakeEngine(tokenizer, config)
    [[rec]] = collect_episodes(engine, task, [task.train_prompt(5)], n=1, config=config)
    referee = TaskReferee(task, tokenizer)
    assert referee.check(rec, 5) is None
    assert referee.check(rec, 6).reason == "wrong_prompt"
    assert referee.check(dataclasses.replace(rec, reward=99.0), 5).reason == "reward_mismatch"
