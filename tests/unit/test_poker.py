"""The poker adapter: deterministic deals, the action parser, malformed actions, the opponents'
legality, results in big blinds, and `task.env` parsing."""

from __future__ import annotations

import random
import warnings

import pytest

from echo2.config import ConfigError, EnvTaskConfig
from echo2.data.envs import make_env_task, parse_env_spec
from echo2.data.envs.base import extract_answer, to_messages
from echo2.data.envs.poker import BB, OPPONENTS, Action, PokerEnv, legal, parse_action


def _deal(env: PokerEnv):
    s = env.state
    return env.agent, [list(map(repr, h)) for h in s.hole_cards], env.deck[-5:]


def test_a_seed_fixes_the_deal_seat_and_opponent():
    for opponent in OPPONENTS:
        a, b = PokerEnv(opponent=opponent), PokerEnv(opponent=opponent)
        assert a.reset(7) == b.reset(7)
        assert _deal(a) == _deal(b)
        for reply in ("<answer>raise 3</answer>", "<answer>call</answer>", "<answer>call</answer>"):
            if a.state.status:
                assert a.step(reply) == b.step(reply)
    seats, hands = set(), set()
    for seed in range(40):
        env = PokerEnv()
        env.reset(seed)
        seats.add(env.agent)
        hands.add(tuple(map(repr, env.state.hole_cards[env.agent])))
    assert seats == {0, 1} and len(hands) == 40, "different seeds deal differently"


def test_parser_reads_the_first_word_of_the_answer():
    env = PokerEnv(stack_bb=20)
    env.reset(1)  # the agent is the big blind, the call-station limped: nothing to call
    assert env.state.checking_or_calling_amount == 0
    cases = {
        "<answer>check</answer>": Action("check_call"),
        "<answer> call (2 to 20)": Action("check_call"),  # call with nothing to call checks
        "<answer>fold</answer>": Action("check_call"),  # so does fold
        "<answer>raise 3</answer>": Action("raise", 3 * BB),
        "<answer>raise to 2.5bb</answer>": Action("raise", 5),
        "<answer>bet 4": Action("raise", 4 * BB),
        "<answer>raise</answer>": Action("raise", 2 * BB),  # minimum raise
        "<answer>raise 500</answer>": Action("raise", 20 * BB),  # clamped to the stack
        "<answer>all-in</answer>": Action("raise", 20 * BB),
        "call": None,  # no answer tag
        "<answer> ... </answer>": None,
        "<answer>calling</answer>": None,
    }
    for text, expected in cases.items():
        assert parse_action(text, env.state) == expected, text
    assert extract_answer("x <answer> fold </answer> y") == "fold"
    assert extract_answer("no tag") is None


def test_malformed_actions_pay_the_penalty_and_play_the_default():
    env = PokerEnv(stack_bb=20, malformed_penalty=1.0)
    env.reset(1)  # big blind, nothing to call: the default is a check
    r = env.step("<answer>I think so</answer>")
    assert r.malformed and r.reward == -1.0 and r.action == "you check" and not r.done
    # a seed where the agent is the small blind and faces the big blind's 0.5 BB
    seed = next(s for s in range(100) if _sb(s))
    env = PokerEnv(stack_bb=20)
    env.reset(seed)
    r = env.step("<answer>check</answer>")  # illegal facing a bet: malformed, default fold
    assert r.malformed and r.done and r.action == "you fold"
    assert r.reward == pytest.approx(-0.5 - 1.0)  # the small blind lost, plus the penalty
    env.reset(seed)
    r = env.step("<answer>fold</answer>")  # the same fold, well-formed: only the blind is lost
    assert not r.malformed and r.reward == pytest.approx(-0.5)


def _sb(seed: int) -> bool:
    env = PokerEnv()
    env.reset(seed)
    return env.agent == 1


def test_results_are_chips_in_big_blinds_and_sum_to_zero():
    for seed in range(30):
        env = PokerEnv(opponent="call_station", stack_bb=10)
        env.reset(seed)
        r = env.step("<answer>all-in</answer>")
        while not r.done:
            r = env.step("<answer>call</answer>")
        payoffs = env.state.payoffs
        assert sum(payoffs) == 0 and r.reward == payoffs[env.agent] / BB
        assert abs(r.reward) <= 10


@pytest.mark.parametrize("opponent", sorted(OPPONENTS))
def test_opponents_only_take_legal_actions(opponent):
    """Whole hands against random agent replies: every opponent action is among pokerkit's legal
    ones (a raise inside the legal range), and pokerkit never warns or raises."""
    rng = random.Random(0)
    replies = ["<answer>fold</answer>", "<answer>call</answer>", "<answer>check</answer>", "<answer>raise 3</answer>",
               "<answer>all-in</answer>", "garbage"]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in range(150):
            env = PokerEnv(opponent=opponent, stack_bb=rng.choice([5, 20, 100]))
            seen = []
            original = env.opponent.act

            def act(state, me, r, *, agent_acted, original=original, seen=seen):
                action = original(state, me, r, agent_acted=agent_acted)
                kinds = {a.kind for a in legal(state)}
                assert action.kind in kinds, (action, kinds)
                if action.kind == "raise":
                    low = state.min_completion_betting_or_raising_to_amount
                    assert low <= action.to <= state.max_completion_betting_or_raising_to_amount
                if not agent_acted:
                    assert action.kind != "fold", "no fold before the agent has had a decision"
                seen.append(action)
                return action

            env.opponent.act = act
            env.reset(seed)
            for _ in range(20):
                if env.step(rng.choice(replies)).done:
                    break
            assert not env.state.status, "the hand ended"


def test_serializer_follows_f4():
    msgs = to_messages("rules", ["obs 1", "obs 2"], ["<answer>call</answer>"], [-1.0])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[1]["content"].startswith("Turn 1:\nState:\nobs 1\nAlways output: <answer>")
    assert msgs[3]["content"].startswith("Reward:\n-1\nTurn 2:\nState:\nobs 2\n")


def test_env_spec_and_config_errors():
    assert parse_env_spec("poker:heads_up?opponent=random&stack_bb=20") == (
        "poker",
        "heads_up",
        {"opponent": "random", "stack_bb": 20},
    )
    task = make_env_task(EnvTaskConfig(env="poker:heads_up?opponent=rule_based"), seed=0)
    assert task.train_prompt(3) == task.train_prompt(3) and task.train_prompt(3) != task.train_prompt(4)
    assert {p.group_id for p in task.eval_prompts(5)}.isdisjoint(
        task.train_prompt(i).group_id for i in range(50)
    )
    for bad in ("poker:heads_up?opponent=shark", "poker:six_max", "chess:x", "poker:heads_up?stack_bb=1",
                "poker:heads_up?colour=red"):  # fmt: skip
        with pytest.raises(ConfigError, match=r"^task\.env: "):
            make_env_task(EnvTaskConfig(env=bad), seed=0)
