"""The fixed poker baselines (issue 23): what each answers at a decision, as pure rules over the
cards and amounts plus `baseline_reply`, which reads them off a live env. Shared by poker_eval.py
(they play the held-out deals), poker_warmup.py (the `random` baseline's replies are its targets)
and poker_strategy.py (the `hand_strength` rule's preflop split of strong and weak hands).

- `fold_check`: check when free, else fold (the env's rule for a malformed reply);
- `check_call`: always check or call;
- `random`: a uniform legal action kind (fold only facing a bet), a raise to a uniform legal size;
- `hand_strength`: preflop raises with a pair or two cards ten or higher (to 3 BB, or three times
  the bet it faces), else checks or folds; postflop bets half the pot with a pair or better (calls a
  bet with it), else checks or folds.
"""

from __future__ import annotations

import random
from collections import Counter

BASELINES = ("fold_check", "check_call", "random", "hand_strength")
RANKS = "23456789TJQKA"


def strong_preflop(hole: list[str]) -> bool:
    """A pair or both cards ten or higher: the hands the `hand_strength` rule raises preflop."""
    a, b = sorted((RANKS.index(c[0]) for c in hole), reverse=True)
    return a == b or b >= RANKS.index("T")


def made_hand(hole: list[str], board: list[str]) -> bool:
    """A pair or better from hole + board ("Ah", "Td", ...): a repeated rank, a flush or a straight.
    (A pair on the board alone counts, as pokerkit's hand label counts it.)"""
    cards = hole + board
    ranks = [RANKS.index(c[0]) for c in cards]
    if max(Counter(ranks).values()) >= 2 or max(Counter(c[1] for c in cards).values()) >= 5:
        return True
    present = set(ranks) | ({-1} if 12 in ranks else set())  # the ace plays low too
    return any(all(r + k in present for k in range(5)) for r in range(-1, 9))


def hand_strength_action(
    hole: list[str],
    board: list[str],
    *,
    to_call: float,
    pot: float,
    max_bet: float,
    can_raise: bool,
) -> str:
    """The hand-strength rule's reply (amounts in BB; `max_bet` is the largest bet this street, the
    raise is clamped into the legal range by the env's parser)."""
    if not board:
        if strong_preflop(hole) and can_raise:
            return f"raise {max(3.0, 3 * max_bet):g}"
        if strong_preflop(hole):
            return "call" if to_call else "check"
        return "fold" if to_call else "check"
    if made_hand(hole, board):
        if to_call:
            return "call"
        return f"raise {max(1.0, pot / 2):g}" if can_raise else "check"
    return "fold" if to_call else "check"


def baseline_reply(policy: str, env, rng: random.Random) -> str:
    from echo2.data.envs.poker import BB

    s = env.state
    to_call = (s.checking_or_calling_amount or 0) / BB
    can_raise = s.can_complete_bet_or_raise_to()
    if policy == "fold_check":
        word = "fold" if to_call else "check"
    elif policy == "check_call":
        word = "call" if to_call else "check"
    elif policy == "random":
        options = (["fold", "call"] if to_call else ["check"]) + (["raise"] if can_raise else [])
        word = rng.choice(options)
        if word == "raise":
            low = s.min_completion_betting_or_raising_to_amount
            high = s.max_completion_betting_or_raising_to_amount
            word = f"raise {rng.randint(low, high) / BB:g}"
    elif policy == "hand_strength":
        me = env.agent
        word = hand_strength_action(
            [f"{c.rank}{c.suit}" for c in s.hole_cards[me]],
            [f"{c.rank}{c.suit}" for cards in s.board_cards for c in cards],
            to_call=to_call,
            pot=s.total_pot_amount / BB,
            max_bet=max(s.bets) / BB,
            can_raise=can_raise,
        )
    else:
        raise ValueError(f"unknown policy {policy!r} (known: {', '.join(BASELINES)})")
    return f"<answer>{word}</answer>"
