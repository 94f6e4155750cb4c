"""The environment seam: multi-turn tasks played in whole episodes (paper Appendix F).

An `Environment` owns the rules of one game or sandbox: `reset(seed)` starts a deterministic
episode and returns the first observation (text), `step(action_text)` applies the model's reply
and returns the next observation, the reward of that step and whether the episode is over. The
env parses the reply itself (`extract_answer` reads the `<answer>...</answer>` part); a reply it
cannot use is *malformed*: it is charged `malformed_penalty`, replaced by the env's default action
and reported in `StepResult.malformed`, which the episode runner counts.

This module also owns the serializer from an episode's history to chat messages (F.4: system,
user observation, assistant action, user reward and next observation, ...) and `EnvTask`, which
makes any environment a task the rollout plane can lease: problem i is an initial state (a seed),
played `group_size` times. It knows nothing of tokens, engines or training: the episode runner
(rollout/episodes.py) turns an episode into one record.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from echo2.config import EnvTaskConfig
from echo2.data.tasks.base import Prompt, Score, full_loss_mask, stable_id

ANSWER_FORMAT = "<answer> ... </answer>"
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL | re.IGNORECASE)


def extract_answer(text: str) -> str | None:
    """The content of the first `<answer>...</answer>` in a reply, stripped (an `<answer>` left open
    runs to the end of the reply, as when generation stops at EOS); None without one."""
    found = _ANSWER.search(text)
    return found.group(1).strip() if found else None


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    observation: str
    """What the agent sees next (ignored once `done`)."""
    reward: float
    """Reward of this step, penalty for a malformed action included."""
    done: bool
    malformed: bool = False
    """The reply could not be used as given; the env played its default action instead."""
    action: str = ""
    """The action the env applied, in its own words (for logs and tests)."""


class Environment(Protocol):
    """Implemented by every environment (`echo2.data.envs.poker.PokerEnv`, ...). One instance plays one
    episode at a time; `reset` may be called again to start another."""

    system_prompt: str
    """The rules and the answer format, sent as the system message."""
    reply_prefix: str
    """Text that opens every reply, written by the env rather than sampled (e.g. "<answer>", so a
    small model only has to name its action); "" for none. `step` receives it back in front of the
    sampled text."""

    def reset(self, seed: int) -> str:
        """Start the episode `seed` names (the same seed gives the same initial state and the same
        opponent behaviour for the same actions); returns the first observation."""
        ...

    def step(self, action_text: str) -> StepResult:
        """Apply the model's reply (the whole reply text: the env extracts its action)."""
        ...

    def finish(self) -> float:
        """End the episode now (turn or token limit) with the env's default actions; returns the
        reward of what remained."""
        ...


# ---------------------------------------------------------------------------- serializer (F.4)
def user_turn(observation: str, *, turn: int, reward: float | None = None) -> dict[str, str]:
    """The user message that opens assistant turn `turn` (1-based): the previous step's reward,
    if there was one to report, then the state and the answer format."""
    head = f"Reward:\n{reward:g}\n" if reward else ""
    return {
        "role": "user",
        "content": f"{head}Turn {turn}:\nState:\n{observation}\nAlways output: {ANSWER_FORMAT}",
    }


def to_messages(system: str, observations: list[str], actions: list[str], rewards: list[float]) -> list[dict]:
    """The chat messages of an episode so far: [system, user 1, assistant 1, user 2, ...].

    observations[k] opens turn k + 1, actions[k] is the reply to it and rewards[k] the reward of
    that reply (reported at the head of the next user message). With one more observation than
    actions the list ends on a user message, ready for the next reply."""
    assert len(actions) <= len(observations) and len(rewards) == len(actions)
    messages = [{"role": "system", "content": system}]
    for k, obs in enumerate(observations):
        messages.append(user_turn(obs, turn=k + 1, reward=rewards[k - 1] if k else None))
        if k < len(actions):
            messages.append({"role": "assistant", "content": actions[k]})
    return messages


# ---------------------------------------------------------------------------- the task adapter
class EnvTask:
    """An environment as a task: problem i is the initial state of seed `train_seed(i)`, played
    `group_size` times (grouping by state, F.5.2). Held-out problems come from another seed space.

    `is_env` tells the rollout plane to play episodes (rollout/episodes.py) instead of sampling
    one response per prompt; `score` is therefore never called."""

    is_env = True

    def __init__(self, make_env: Callable[[], Environment], config: EnvTaskConfig, *, seed: int) -> None:
        self.make_env = make_env
        self.config = config
        self.seed = seed
        self.reward_range = getattr(make_env(), "reward_range", (-1e6, 1e6))
        """(low, high) of an episode's return as the env declares it; the coordinator refuses others."""

    def _prompt(self, group_id: str, env_seed: int) -> Prompt:
        env = self.make_env()
        first = env.reset(env_seed)
        return Prompt(
            group_id=group_id,
            messages=tuple(to_messages(env.system_prompt, [first], [], [])),
            answer="",
            metadata={"env_seed": env_seed},
        )

    def train_prompt(self, index: int) -> Prompt:
        env_seed = int(stable_id("env-train", self.seed, index), 16)
        return self._prompt(stable_id("env", self.seed, index), env_seed)

    def eval_prompts(self, count: int) -> list[Prompt]:
        """`count` held-out initial states, the same for every run seed."""
        seeds = [int(stable_id("env-eval", i), 16) for i in range(count)]
        return [self._prompt(stable_id("env-eval", s), s) for s in seeds]

    def score(self, prompt: Prompt, response_text: str) -> Score:
        raise TypeError("an environment task is played in episodes (rollout/episodes.py), not scored")

    loss_mask = staticmethod(full_loss_mask)  # unused: the episode runner builds turn-aware masks


def is_env_task(task: object) -> bool:
    return bool(getattr(task, "is_env", False))
