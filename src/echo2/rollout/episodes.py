"""Multi-turn rollouts: play whole episodes of an environment task, one record per episode.

Owns the token-level view of an episode (paper F.4-F.5). The context starts as the chat template of
[system, first observation] with the assistant header; each turn the engine samples a reply from the
context so far (`Engine.generate_ids`: the HF engine prefills the whole context again, vLLM reuses
earlier turns through prefix caching), the env steps on the reply's text, and the tokens of the next
user message (with the chat template's turn markers) are appended. The sampled tokens are kept as
sampled, never re-tokenized, so the record holds exactly the sequence the policy saw.

The record: `prompt_ids` = the first context, `response_ids` = everything after it (replies and
observations interleaved); `loss_mask` is 1 exactly on sampled tokens (turn-aware masking, F.5.1:
the learner's targets are the response tokens, so position t's logits are trained to predict a
token only where the policy generated it); `behaviour_logprobs` are the sampled tokens' log-probs
and 0 elsewhere; `reward` is the episode return (F.5.2); the metadata carries the grouping tags.
Under rollout.sampling = "gumbel" every reply is sampled by keyed Gumbel-max (rollout/sampling.py)
with the record's key (its group id and index in the group) and each token's position in the
record's response (env tokens included), the positions the learner checks it at.
Knows nothing of training or the network; the in-process source and the workers call it through
`rollout.collect`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from echo2.data.envs.base import Environment, EnvTask, user_turn
from echo2.data.tasks.base import Prompt
from echo2.models import chat_template_kwargs
from echo2.records import Trajectory
from echo2.rollout.engine import Engine, encode_prompts
from echo2.rollout.sampling import SAMPLE_KEY, SEED_KEY, SamplingKeys

_SENTINEL = "\u2063ECHO2\u2063"


class ChatTokens:
    """Token ids of the pieces of a conversation, as the tokenizer's chat template renders them."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_text = tokenizer.eos_token or ""
        if tokenizer.chat_template:
            probe = [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": _SENTINEL},
            ]
            text = tokenizer.apply_chat_template(probe, tokenize=False, **chat_template_kwargs(tokenizer))
            self._probe, self._probe_text = probe, text
            self.close = text[text.index(_SENTINEL) + len(_SENTINEL) :]
            """What ends an assistant message, e.g. "<|im_end|>\\n"."""
        else:
            self._probe = None
            self.close = "\n"
        self.prefix_text, self.prefix = "", []

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids if text else []

    def first(self, prompt: Prompt, *, max_tokens: int) -> list[int]:
        """The initial context; ValueError naming rollout.max_prompt_tokens if it is too long."""
        return encode_prompts(self.tokenizer, [prompt], max_tokens=max_tokens)[0]

    def next_user(self, message: dict[str, str], *, ended_with_eos: bool) -> list[int]:
        """Tokens after a reply up to the next reply: the end of the assistant message (less the
        EOS the reply already ends with), the user message and the assistant header."""
        if self._probe is None:
            text = self.close + message["content"] + "\n"
        else:
            full = self.tokenizer.apply_chat_template(
                [*self._probe, message],
                tokenize=False,
                add_generation_prompt=True,
                **chat_template_kwargs(self.tokenizer),
            )
            assert full.startswith(self._probe_text), "chat template is not prefix-stable"
            text = self.close + full[len(self._probe_text) :]
        if ended_with_eos and self.eos_text and text.startswith(self.eos_text):
            text = text[len(self.eos_text) :]
        return self.ids(text)

    def after_reply(self, observation: str, *, turn: int, reward: float, ended_with_eos: bool) -> list[int]:
        """The env's tokens between a reply and the next: `next_user` of the F.4 user message for
        `turn`, then the env's reply prefix."""
        message = user_turn(observation, turn=turn, reward=reward)
        return self.next_user(message, ended_with_eos=ended_with_eos) + self.prefix

    def for_env(self, env: Environment) -> ChatTokens:
        self.prefix_text = getattr(env, "reply_prefix", "")
        """Opens every reply (e.g. "<answer>"): an env token, not sampled; the env reads it back."""
        self.prefix = self.ids(self.prefix_text)
        return self


@dataclass(slots=True, kw_only=True)
class Episode:
    prompt: Prompt
    env: Environment
    tokens: list[int]
    num_prompt: int
    sample: int = 0
    """The episode's index in its group (with the group id, its record key)."""
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turns: int = 0
    malformed: int = 0
    truncated: bool = False
    done: bool = False
    pending: list[int] = field(default_factory=list)
    """Tokens of the next user message, appended when (and only if) another turn is played."""

    def add(self, ids, *, sampled: bool, logprobs=None) -> None:
        self.tokens.extend(ids)
        self.mask.extend([1 if sampled else 0] * len(ids))
        self.logprobs.extend(logprobs if sampled else [0.0] * len(ids))

    @property
    def ret(self) -> float:
        """The episode return R = sum of the step rewards (F.5.2)."""
        return math.fsum(self.rewards)


def play(
    engine: Engine,
    task: EnvTask,
    prompts: list[Prompt],
    *,
    n: int,
    greedy: bool,
    max_new_tokens: int,
    max_prompt_tokens: int,
    sampling_seed: int | None = None,
) -> list[list[Episode]]:
    """n episodes from each prompt's initial state, all stepped together turn by turn.
    `sampling_seed`: keys every reply's noise (rollout.sampling = "gumbel"; None: the engine's)."""
    cfg = task.config
    chat = ChatTokens(engine.tokenizer).for_env(task.make_env())
    eos = engine.tokenizer.eos_token_id
    groups = []
    for prompt in prompts:
        first = chat.first(prompt, max_tokens=max_prompt_tokens)
        group = []
        for j in range(n):
            env = task.make_env()
            env.reset(prompt.metadata["env_seed"])
            e = Episode(prompt=prompt, env=env, tokens=list(first), num_prompt=len(first), sample=j)
            e.pending = list(chat.prefix)
            group.append(e)
        groups.append(group)
    episodes = [e for g in groups for e in g]
    for turn in range(1, cfg.max_turns + 1):
        active = []
        for e in episodes:
            if e.done:
                continue
            context = len(e.tokens) + len(e.pending)
            if turn > 1 and (context > max_prompt_tokens or context + max_new_tokens > cfg.max_tokens):
                _truncate(e)
                continue
            e.add(e.pending, sampled=False)
            e.pending = []
            active.append(e)
        if not active:
            break
        keyed = {}
        if sampling_seed is not None and not greedy:  # each reply at its positions in its record
            keyed["keys"] = SamplingKeys(
                seed=sampling_seed,
                groups=tuple(e.prompt.group_id for e in active),
                samples=tuple(e.sample for e in active),
                offsets=tuple(len(e.tokens) - e.num_prompt for e in active),
            )
        samples = engine.generate_ids([e.tokens for e in active], n=1, greedy=greedy, **keyed)
        for e, (s,) in zip(active, samples, strict=True):
            e.add(s.response_ids, sampled=True, logprobs=s.logprobs)
            e.turns += 1
            result = e.env.step(chat.prefix_text + s.text)
            e.rewards.append(result.reward)
            e.malformed += result.malformed
            if result.done:
                e.done = True
            else:
                ended = bool(s.response_ids) and s.response_ids[-1] == eos
                e.pending = chat.after_reply(
                    result.observation, turn=turn + 1, reward=result.reward, ended_with_eos=ended
                )
    for e in episodes:
        if not e.done:
            _truncate(e)
    return groups


def _truncate(e: Episode) -> None:
    e.rewards.append(e.env.finish())
    e.truncated, e.done, e.pending = True, True, []


def to_record(e: Episode, *, version: int, grouping: str, sampling_seed: int | None = None) -> Trajectory:
    chips = getattr(e.env, "result", None)
    sampled = {} if sampling_seed is None else {SEED_KEY: sampling_seed}  # a coordinator overwrites it
    return Trajectory(
        group_id=e.prompt.group_id,
        prompt_ids=tuple(e.tokens[: e.num_prompt]),
        response_ids=tuple(e.tokens[e.num_prompt :]),
        behaviour_logprobs=tuple(e.logprobs),
        loss_mask=tuple(e.mask),
        reward=e.ret,
        version=version,
        metadata={
            "episode": True,
            "grouping": grouping,
            "state_id": e.prompt.group_id,
            "env_seed": e.prompt.metadata["env_seed"],
            "turns": e.turns,
            "malformed": e.malformed,
            "truncated": e.truncated,
            "outcome": chips() if callable(chips) else e.ret,
            "correct": (chips() if callable(chips) else e.ret) > 0,
            SAMPLE_KEY: e.sample,
            **sampled,
        },
    )


def collect_episodes(
    engine: Engine, task: EnvTask, prompts: list[Prompt], *, n: int, config, sampling_seed: int | None = None
) -> list[list[Trajectory]]:
    """One group of n episode records per prompt (initial state), tagged with the engine's version.
    `sampling_seed`: the lease's, keying the noise under rollout.sampling = "gumbel"."""
    if getattr(config, "sampling", None) != "gumbel":
        sampling_seed = None
    version = engine.version
    groups = play(
        engine,
        task,
        prompts,
        n=n,
        greedy=False,
        max_new_tokens=config.max_new_tokens,
        max_prompt_tokens=config.max_prompt_tokens,
        sampling_seed=sampling_seed,
    )
    grouping = task.config.grouping
    return [
        [to_record(e, version=version, grouping=grouping, sampling_seed=sampling_seed) for e in g]
        for g in groups
    ]


def evaluate_episodes(
    engine: Engine, task: EnvTask, prompts: list[Prompt], *, batch_size: int, config
) -> dict[str, float]:
    """Greedy play of one episode per held-out initial state: mean return and mean outcome (for
    poker, chips in BB; without the malformed penalties) with the half-width of their 95%
    confidence intervals (normal approximation, 1.96 standard errors), the share of malformed
    actions, of won episodes (`eval/accuracy`) and of truncated ones."""
    episodes: list[Episode] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        groups = play(
            engine,
            task,
            chunk,
            n=1,
            greedy=True,
            max_new_tokens=config.max_new_tokens,
            max_prompt_tokens=config.max_prompt_tokens,
        )
        episodes.extend(g[0] for g in groups)
    records = [to_record(e, version=engine.version, grouping="state") for e in episodes]
    returns = [r.reward for r in records]
    outcomes = [r.metadata["outcome"] for r in records]
    return {
        "eval/accuracy": statistics.fmean(float(r.metadata["correct"]) for r in records) if records else 0.0,
        "eval/return_mean": _mean(returns),
        "eval/return_ci95": ci95(returns),
        "eval/outcome_mean": _mean(outcomes),
        "eval/outcome_ci95": ci95(outcomes),
        **{"eval/" + k.removeprefix("episode/"): v for k, v in episode_stats(records).items()},
        "eval/count": float(len(records)),
    }


def episode_stats(records: list[Trajectory]) -> dict[str, float]:
    """Episode figures of a batch of records (empty if none is an episode): malformed actions per
    action, turns, truncated share, mean outcome."""
    eps = [r.metadata for r in records if r.metadata.get("episode")]
    if not eps:
        return {}
    actions = sum(m["turns"] for m in eps)
    return {
        "episode/malformed_frac": sum(m["malformed"] for m in eps) / max(1, actions),
        "episode/turns_mean": actions / len(eps),
        "episode/truncated_frac": statistics.fmean(float(m["truncated"]) for m in eps),
        "episode/outcome_mean": statistics.fmean(m["outcome"] for m in eps),
    }


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def ci95(xs: list[float]) -> float:
    """Half-width of the 95% confidence interval of the mean (normal approximation)."""
    return 1.96 * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")
