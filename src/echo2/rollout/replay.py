"""Verify an episode record by replaying it: the learner's check of what an untrusted worker pushed
for an environment task (called by `learning.verify.TaskReferee`).

An environment is deterministic given its seed and the agent's replies, so the learner can replay
a record without a model: every run of mask-1 tokens is a reply (decoded as the runner decoded it),
every run of mask-0 tokens must be exactly the tokens the runner puts there (the end of the reply,
the next user message, the reply prefix), and the return must be the sum of the env's rewards
(with the env's default actions finishing a truncated episode). A worker therefore cannot change
the observations, the masks, the reward or the outcome it reports. What the replay cannot tell is
why an episode ended early: a record whose last reply leaves the hand running is taken as truncated
by the turn or token limit (the env's default actions finish it).

A reply is what one generation can give: no token after its EOS (the engine stops there, so later
"sampled" tokens were chosen, not sampled) and at most `max_new_tokens` tokens (the per-turn limit
the runner generates with), so a worker cannot hide a long or hand-written answer in one turn.
"""

from __future__ import annotations

import math

from echo2.data.envs.base import EnvTask
from echo2.data.tasks.base import Prompt
from echo2.records import Trajectory
from echo2.rollout.episodes import ChatTokens

TOLERANCE = 1e-6


def replay_problem(
    task: EnvTask, prompt: Prompt, record: Trajectory, tokenizer, *, max_new_tokens: int | None = None
) -> tuple[str, str] | None:
    """(reason, detail) of the first disagreement between `record` and a replay of its episode from
    `prompt` (the leased initial state), or None. `max_new_tokens`: the per-reply limit
    (`rollout.max_new_tokens`; None: no limit but the record's own length)."""
    env = task.make_env()
    env.reset(prompt.metadata["env_seed"])
    chat = ChatTokens(tokenizer).for_env(env)
    eos = tokenizer.eos_token_id
    ids, mask = record.response_ids, record.loss_mask
    expect, pos, turns, rewards, malformed = list(chat.prefix), 0, 0, [], 0
    while True:
        if list(ids[pos : pos + len(expect)]) != expect or any(mask[pos : pos + len(expect)]):
            return "bad_mask", f"the env's tokens after reply {turns} are not the replayed ones"
        pos += len(expect)
        end = pos
        while end < len(ids) and mask[end]:
            end += 1
        if end == pos:
            return "bad_mask", f"no reply tokens at turn {turns + 1}"
        reply = ids[pos:end]
        turns += 1
        if max_new_tokens is not None and len(reply) > max_new_tokens:
            return (
                "too_long",
                f"reply {turns} has {len(reply)} tokens > rollout.max_new_tokens = {max_new_tokens}",
            )
        if eos is not None and eos in reply[:-1]:
            return "bad_mask", f"reply {turns} has {len(reply) - 1 - reply.index(eos)} tokens after its EOS"
        result = env.step(chat.prefix_text + tokenizer.decode(reply, skip_special_tokens=True))
        rewards.append(result.reward)
        malformed += result.malformed
        pos = end
        if result.done:
            break
        if pos == len(ids) or turns == task.config.max_turns:
            rewards.append(env.finish())
            break
        expect = chat.after_reply(
            result.observation, turn=turns + 1, reward=result.reward, ended_with_eos=reply[-1] == eos
        )
    if pos != len(ids):
        return "bad_mask", f"{len(ids) - pos} tokens after the end of the episode"
    if turns > task.config.max_turns:
        return "bad_mask", f"{turns} turns > task.max_turns = {task.config.max_turns}"
    ret = math.fsum(rewards)
    if not math.isclose(ret, record.reward, rel_tol=TOLERANCE, abs_tol=TOLERANCE):
        return "reward_mismatch", f"return {record.reward:g}, the replay gives {ret:g}"
    meta = record.metadata
    if meta.get("malformed", malformed) != malformed or meta.get("turns", turns) != turns:
        return "reward_mismatch", "turn or malformed-action counts differ from the replay"
    outcome = env.result() if hasattr(env, "result") else ret
    claimed = meta.get("outcome", outcome)
    if not isinstance(claimed, int | float) or not math.isclose(claimed, outcome, abs_tol=TOLERANCE):
        return "reward_mismatch", f"outcome {claimed!r}, the replay gives {outcome:g}"
    if meta.get("correct", outcome > 0) != (outcome > 0):
        return "reward_mismatch", "correct flag differs from the replay"
    return None
