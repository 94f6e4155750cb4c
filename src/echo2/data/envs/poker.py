"""Heads-up no-limit Texas hold'em on pokerkit: the agent against a fixed opponent (paper F.2-F.3).

Owns the game: deals from a seed (the deck is shuffled by `random.Random(seed)` and cards are dealt
by hand, so a seed fixes both hands, the board, the agent's seat and the opponent's random draws),
the observation text, the action parser and the opponents. pokerkit keeps the rules (blinds, betting
order, minimum raises, side pots, showdown). Knows nothing of models or tokens.

Units: blinds are 1 and 2 chips, so one big blind (BB) is 2 chips; every amount the agent sees or
names is in BB. Actions, inside `<answer>...</answer>`: `fold`, `check`, `call`, `raise N` (raise to
a total bet of N BB on this street; `bet N` and `all-in` are read too). The agent's reward is its
chip result in BB when the hand ends, minus `malformed_penalty` for each reply that is

- unparseable (no `<answer>` or no known action in it), or
- illegal here: `check` facing a bet, `raise` when no raise is possible;

such a reply is replaced by the default action: check if possible, else fold. Lenient readings are
not malformed: `call` with nothing to call checks, `fold` with nothing to call checks, a raise size
outside the legal range is clamped into it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from pokerkit import Automation, Deck, NoLimitTexasHoldem, StandardHighHand

from echo2.data.envs.base import StepResult, extract_answer

BB = 2  # chips per big blind
AUTOMATIONS = (
    Automation.ANTE_POSTING,
    Automation.BET_COLLECTION,
    Automation.BLIND_OR_STRADDLE_POSTING,
    Automation.HOLE_CARDS_SHOWING_OR_MUCKING,
    Automation.HAND_KILLING,
    Automation.CHIPS_PUSHING,
    Automation.CHIPS_PULLING,
    Automation.RUNOUT_COUNT_SELECTION,
)
STREETS = ("preflop", "flop", "turn", "river")
SYSTEM = (
    "Heads-up no-limit Texas hold'em. Amounts in big blinds (BB). Cards: rank (2-9, T, J, Q, K, A) "
    "and suit (c, d, h, s). Answer with one action: fold, check, call, or raise N (raise to N BB). "
    "Example: <answer>call</answer>"
)
_ACTION = re.compile(r"\s*(fold|check|call|raise|bet|all[- ]?in)\b(?:\s+to)?\s*([0-9]+(?:\.[0-9]+)?)?")


@dataclass(frozen=True, slots=True)
class Action:
    kind: str
    """"fold", "check_call" or "raise"."""
    to: int = 0
    """Chips: the total bet this street after a raise."""


def legal(state) -> list[Action]:
    """The legal action kinds of the player to act (a raise at its minimum size)."""
    out = []
    if state.can_fold():
        out.append(Action("fold"))
    if state.can_check_or_call():
        out.append(Action("check_call"))
    if state.can_complete_bet_or_raise_to():
        out.append(Action("raise", state.min_completion_betting_or_raising_to_amount))
    return out


def apply(state, action: Action) -> None:
    if action.kind == "fold":
        state.fold()
    elif action.kind == "check_call":
        state.check_or_call()
    else:
        state.complete_bet_or_raise_to(action.to)


def _raise_range(state) -> tuple[int, int]:
    return (
        state.min_completion_betting_or_raising_to_amount,
        state.max_completion_betting_or_raising_to_amount,
    )


# ---------------------------------------------------------------------------- opponents
class RandomOpponent:
    """Uniform over the legal action kinds; a raise to a uniform size in the legal range. Never folds
    before the agent has acted, so every episode has at least one decision of the agent's."""

    def act(self, state, me: int, rng: random.Random, *, agent_acted: bool) -> Action:
        options = [a for a in legal(state) if agent_acted or a.kind != "fold"]
        choice = rng.choice(options)
        if choice.kind == "raise":
            low, high = _raise_range(state)
            return Action("raise", rng.randint(low, high))
        return choice


class CallStation:
    """Always checks or calls."""

    def act(self, state, me: int, rng: random.Random, *, agent_acted: bool) -> Action:
        return Action("check_call")


class RuleBased:
    """A simple tight player. Preflop: raises to 3 BB (or re-raises to three times the bet) with a
    pair or two cards ten or higher, calls up to 2 BB more with an ace or suited cards, else folds
    to a bet. Postflop: with a pair or better bets half the pot, calls otherwise only bets of up to
    a quarter of the pot, checks when it can."""

    def act(self, state, me: int, rng: random.Random, *, agent_acted: bool) -> Action:
        hole = list(state.hole_cards[me])
        board = [c for cards in state.board_cards for c in cards]
        to_call = state.checking_or_calling_amount or 0
        can_raise = state.can_complete_bet_or_raise_to()
        if not board:
            ranks = sorted(("23456789TJQKA".index(c.rank) for c in hole), reverse=True)
            strong = ranks[0] == ranks[1] or ranks[1] >= "23456789TJQKA".index("T")
            playable = ranks[0] == 12 or hole[0].suit == hole[1].suit
            if strong and can_raise:
                return self._raise_to(state, max(3 * BB, 3 * max(state.bets)))
            if strong or (playable and to_call <= 2 * BB) or to_call == 0 or not agent_acted:
                return Action("check_call")
            return Action("fold")
        made = StandardHighHand.from_game(hole, board).entry.label.value != "High card"
        pot = state.total_pot_amount
        if made and can_raise:
            return self._raise_to(state, max(state.bets) + max(BB, pot // 2))
        if made or to_call == 0 or to_call * 4 <= pot:
            return Action("check_call")
        return Action("fold")

    @staticmethod
    def _raise_to(state, chips: int) -> Action:
        low, high = _raise_range(state)
        return Action("raise", min(max(chips, low), high))


OPPONENTS = {"random": RandomOpponent, "call_station": CallStation, "rule_based": RuleBased}


# ---------------------------------------------------------------------------- the parser
def parse_action(text: str, state) -> Action | None:
    """The action a reply names, made legal where that is a lenient reading; None if malformed.

    The action is the first word of the answer (anything after it is ignored), with the amount of
    a raise the number right after it (`raise 6`, `raise to 6bb`, `bet 6`; `all-in` raises to the
    whole stack; `raise` alone is a minimum raise)."""
    answer = extract_answer(text)
    if answer is None:
        return None
    found = _ACTION.match(answer.lower())
    if not found:
        return None
    word, number = found.group(1).replace(" ", "").replace("-", ""), found.group(2)
    to_call = state.checking_or_calling_amount or 0
    if word == "bet":
        word = "raise"
    if word in ("fold", "check", "call"):
        if word == "check" and to_call > 0:
            return None  # facing a bet: a check is illegal
        if word == "fold" and state.can_fold():
            return Action("fold")
        return Action("check_call")
    if not state.can_complete_bet_or_raise_to():
        return None
    low, high = _raise_range(state)
    if word == "allin":
        return Action("raise", high)
    if number is None:
        return Action("raise", low)
    return Action("raise", min(max(round(float(number) * BB), low), high))


def default_action(state) -> Action:
    return Action("check_call") if (state.checking_or_calling_amount or 0) == 0 else Action("fold")


# ---------------------------------------------------------------------------- the environment
class PokerEnv:
    """One heads-up hand per episode; implements `echo2.data.envs.base.Environment`."""

    system_prompt = SYSTEM

    def __init__(
        self,
        *,
        opponent: str = "call_station",
        stack_bb: int = 100,
        malformed_penalty: float = 1.0,
        prefix: bool = True,
    ) -> None:
        """`prefix`: every reply opens with "<answer>" written by the env (a small model then only
        names its action); False: the model writes the whole tag itself."""
        self.reply_prefix = "<answer>" if prefix else ""
        if opponent not in OPPONENTS:
            raise ValueError(f"opponent: one of {', '.join(OPPONENTS)} (got {opponent!r})")
        if stack_bb < 2:
            raise ValueError(f"stack_bb: at least 2 (got {stack_bb})")
        self.opponent = OPPONENTS[opponent]()
        self.stack_bb = stack_bb
        self.penalty = malformed_penalty
        self.reward_range = (-stack_bb - 100 * malformed_penalty, float(stack_bb))
        """Bounds of an episode's return (at most 100 penalties: far more turns than any limit)."""
        self.state = None
        self.log: list[str] = []

    # -- episode
    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        deck = list(Deck.STANDARD)
        rng.shuffle(deck)
        self.deck, self.rng = deck, rng
        self.agent = rng.randrange(2)  # seat 0: big blind, seat 1: small blind (acts first preflop)
        self.agent_acted = False
        self.log = []
        self.state = NoLimitTexasHoldem.create_state(
            AUTOMATIONS, True, 0, (1, BB), BB, (self.stack_bb * BB,) * 2, 2
        )
        self._advance()
        return self.observation()

    def step(self, action_text: str) -> StepResult:
        assert self.state is not None and self.state.actor_index == self.agent, "reset first; hand over"
        action = parse_action(action_text, self.state)
        malformed = action is None
        if action is None:
            action = default_action(self.state)
        self._play(self.agent, action)
        applied = self.log[-1]
        self.agent_acted = True
        self._advance()
        done = not self.state.status
        reward = (self.result() if done else 0.0) - (self.penalty if malformed else 0.0)
        return StepResult(
            observation="" if done else self.observation(),
            reward=reward,
            done=done,
            malformed=malformed,
            action=applied,
        )

    def finish(self) -> float:
        while self.state.status:
            self._play(self.agent, default_action(self.state))
            self._advance()
        return self.result()

    def result(self) -> float:
        """The agent's chip result in BB (the hand is over)."""
        return self.state.payoffs[self.agent] / BB

    # -- internals
    def _advance(self) -> None:
        """Deal and let the opponent act until the agent must act or the hand is over."""
        s = self.state
        while s.status:
            if s.can_burn_card():  # by hand: pokerkit's automatic burn draws from its own deck
                s.burn_card(self.deck.pop())
            elif s.can_deal_hole():
                s.deal_hole(self.deck.pop())
            elif s.can_deal_board():
                street = len([c for cards in s.board_cards for c in cards])
                if street in (0, 3, 4):
                    self.log.append({0: "flop:", 3: "turn:", 4: "river:"}[street])
                s.deal_board(self.deck.pop())
            elif s.actor_index == 1 - self.agent:
                act = self.opponent.act(s, 1 - self.agent, self.rng, agent_acted=self.agent_acted)
                self._play(1 - self.agent, act)
            elif s.actor_index == self.agent:
                return
            else:  # nothing left to do by hand: pokerkit's automations finish the hand
                raise AssertionError(f"poker state stuck: {s}")

    def _play(self, player: int, action: Action) -> None:
        who = "you" if player == self.agent else "opponent"
        to_call = self.state.checking_or_calling_amount or 0
        apply(self.state, action)
        if action.kind == "fold":
            self.log.append(f"{who} fold")
        elif action.kind == "check_call":
            self.log.append(f"{who} {'call' if to_call else 'check'}")
        else:
            self.log.append(f"{who} raise to {action.to / BB:g}")

    def observation(self) -> str:
        s, me = self.state, self.agent
        board = [c for cards in s.board_cards for c in cards]
        to_call = (s.checking_or_calling_amount or 0) / BB
        moves = ["fold", "call"] if to_call else ["check"]
        if s.can_complete_bet_or_raise_to():
            low, high = _raise_range(s)
            moves.append(f"raise N ({low / BB:g} to {high / BB:g})")
        seat = "small blind, first to act preflop" if me == 1 else "big blind"
        return "\n".join(
            [
                f"You: {seat}. Cards: {_cards(s.hole_cards[me])}. "
                f"Board: {_cards(board) or 'none'} ({STREETS[s.street_index or 0]}).",
                f"Pot {s.total_pot_amount / BB:g}. Stacks: you {s.stacks[me] / BB:g}, "
                f"opponent {s.stacks[1 - me] / BB:g}. To call: {to_call:g}.",
                f"History: {'; '.join(self.log).replace(':;', ':') or 'blinds posted'}.",
                f"Legal: {', '.join(moves)}.",
            ]
        )


def _cards(cards) -> str:
    return " ".join(f"{c.rank}{c.suit}" for c in cards)


def make_poker(variant: str, options: dict, *, malformed_penalty: float):
    """The env factory for `task.env = "poker:VARIANT?opt=value"` (ValueError names a bad option)."""
    if variant != "heads_up":
        raise ValueError(f"poker variant: only heads_up (got {variant!r})")
    unknown = set(options) - {"opponent", "stack_bb", "prefix"}
    if unknown:
        raise ValueError(
            f"unknown poker option(s) {', '.join(sorted(unknown))} (known: opponent, stack_bb, prefix)"
        )
    kwargs = {
        "opponent": str(options.get("opponent", "call_station")),
        "stack_bb": options.get("stack_bb", 100),
        "prefix": options.get("prefix", True),
        "malformed_penalty": malformed_penalty,
    }
    if not isinstance(kwargs["stack_bb"], int) or not isinstance(kwargs["prefix"], bool):
        raise ValueError("stack_bb must be an integer, prefix true or false")
    PokerEnv(**kwargs)  # validate now, not in the first episode

    def make() -> PokerEnv:
        return PokerEnv(**kwargs)

    return make


__all__ = ["PokerEnv", "make_poker", "parse_action", "legal", "OPPONENTS"]
