"""How far one worker's forged behaviour log-probs can steer a learner step (issue 41 item 1).

The attack: in each wrong answer (negative advantage) of its group the worker lowers one token's
behaviour log-prob by `shift` nats (its ratio pi/mu becomes e^shift) and raises the record's other
loss tokens by shift / (n - 1), so the record's mean log-ratio stays 0 and every token stays inside
the learner's per-token bound (4 nats x (1 + staleness)). The learner's own check passes it.

Measured for the forged group and, as the control, the same group with its honest log-probs:
- `cosine`: between the step's (clipped) gradient and the gradient of that group alone;
- `target_change`: the first-order change of log pi(target token) the step makes, per unit of
  learning rate (-<grad log pi(target), g>), summed over the targets;
- `refused`: records the learner's check left out.
`ratio` = forged / honest target change (the issue's "moves 39 times more"), `displacement` =
|forged - honest| / |honest|: how far the forgery moves its targets from where the honest step
takes them, in units of the honest step's own change. What bounds them: a fresh record is trained
on the learner's own log-probs, a stale one's ratio is capped at `learner.ratio_cap`
(learning/grpo.py).

    cd bench && python steering.py --json ../docs/bench/steering.json

SmolLM2-135M-Instruct (fp32), the quickstart's arithmetic task, 4 prompts x 8 samples, the attacker
holding one of the 4 groups; at S = 4 the records come from the weights 4 AdamW steps (lr 1e-5,
honest batches) before the learner's. The adversarial test (tests/adversarial/test_steering.py)
runs the same functions on the suite's tiny model.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math

import torch

from echo2.config import LearnerConfig
from echo2.data.tasks.base import to_tensors
from echo2.learning.grpo import group_advantages
from echo2.learning.step import make_optimizer, response_logprobs, train_step
from echo2.learning.verify import StepCheck
from echo2.records import Trajectory

SHIFT = 3.9
"""Nats the target token's behaviour log-prob is lowered, for a fresh record (times 1 + s)."""


def own_logprobs(model, records: list[Trajectory], *, temperature: float) -> list[list[float]]:
    """The model's log-probs of each record's response tokens (no gradient)."""
    batch = to_tensors(records, pad_id=0, advantages=[0.0] * len(records))
    with torch.no_grad():
        logp = response_logprobs(model.eval(), batch, temperature=temperature)
    k = logp.shape[1]
    return [logp[i, k - len(r.response_ids) :].tolist() for i, r in enumerate(records)]


def forge(
    group: list[Trajectory], behaviour: list[list[float]], shift: float
) -> tuple[list[Trajectory], list[tuple[int, int]]]:
    """`group` with each negative-advantage record's first loss token lowered by `shift` and its
    other loss tokens raised by shift / (n - 1); and the (record, position) of each target."""
    adv = group_advantages(torch.tensor([[r.reward for r in group]]))[0].tolist()
    out, targets = [], []
    for i, (r, lp) in enumerate(zip(group, behaviour, strict=True)):
        live = [k for k, m in enumerate(r.loss_mask) if m]
        lp = list(lp)
        if adv[i] < 0 and len(live) >= 2:
            target, rest = live[0], live[1:]
            lp[target] -= shift
            for k in rest:
                lp[k] += shift / len(rest)
            targets.append((i, target))
        out.append(dataclasses.replace(r, behaviour_logprobs=tuple(lp)))
    return out, targets


def step_gradient(
    model,
    groups,
    config: LearnerConfig,
    *,
    temperature: float,
    check: StepCheck | None,
    staleness: int | None = 0,
):
    """The clipped gradient one `train_step` on `groups` applies (flat), weights left as they were;
    every record `staleness` versions behind the learner (None: not said, as before issue 41)."""
    probe = copy.deepcopy(model)
    sgd = torch.optim.SGD([p for p in probe.parameters() if p.requires_grad], lr=0.0)
    per_record = None if staleness is None else [staleness] * sum(len(g) for g in groups)
    stats = train_step(
        probe, sgd, groups, config, pad_id=0, temperature=temperature, check=check, staleness=per_record
    )
    grads = [p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in probe.parameters()]
    return torch.cat(grads), stats


def target_gradient(model, group: list[Trajectory], targets, *, temperature: float) -> torch.Tensor:
    """grad of sum over targets of log pi(target token) (flat)."""
    probe = copy.deepcopy(model).train()
    rows = sorted({i for i, _ in targets})
    recs = [group[i] for i in rows]
    batch = to_tensors(recs, pad_id=0, advantages=[0.0] * len(recs))
    logp = response_logprobs(probe, batch, temperature=temperature)
    k = logp.shape[1]
    total = sum(logp[rows.index(i), k - len(group[i].response_ids) + pos] for i, pos in targets)
    total.backward()
    return torch.cat(
        [p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in probe.parameters()]
    )


def influence(
    model,
    groups,
    attacker: int,
    config: LearnerConfig,
    *,
    temperature: float,
    staleness: int,
    learner_version: int,
    targets,
    legacy: bool,
) -> dict:
    """The step on `groups` measured against group `attacker`: cosine of the step with that group
    alone, the first-order change of its targets' log-probs, and the records refused. `legacy`:
    the step is not told the records' staleness (train_step as before issue 41)."""

    def check():
        return StepCheck(
            max_logratio=config.max_logratio, learner_version=learner_version, staleness=staleness
        )

    c = check()
    said = None if legacy else staleness
    g_step, _ = step_gradient(model, groups, config, temperature=temperature, check=c, staleness=said)
    g_alone, _ = step_gradient(
        model, [groups[attacker]], config, temperature=temperature, check=check(), staleness=said
    )
    g_target = target_gradient(model, groups[attacker], targets, temperature=temperature)
    cos = torch.nn.functional.cosine_similarity(g_step.double(), g_alone.double(), dim=0).item()
    return {
        "cosine": cos if math.isfinite(cos) else 0.0,
        "target_change": -(g_target @ g_step).item(),
        "refused": len(c.refused),
    }


def attack(
    model,
    behaviour_model,
    groups,
    attacker: int,
    config: LearnerConfig,
    *,
    temperature: float,
    staleness: int,
    legacy: bool = False,
) -> dict:
    """Forged against honest, for `groups` generated by `behaviour_model` (`staleness` versions
    before `model`); the records carry version 0, the learner is at `staleness`. `legacy`: the
    learner as before issue 41 (pass `config.ratio_cap = None` too)."""
    groups = [[dataclasses.replace(r, version=0) for r in g] for g in groups]
    honest = [list(g) for g in groups]
    for gi, g in enumerate(groups):
        lps = own_logprobs(behaviour_model, g, temperature=temperature)
        honest[gi] = [
            dataclasses.replace(r, behaviour_logprobs=tuple(lp)) for r, lp in zip(g, lps, strict=True)
        ]
    lps = [list(r.behaviour_logprobs) for r in honest[attacker]]
    forged_group, targets = forge(honest[attacker], lps, SHIFT * (1 + staleness))
    forged = [*honest[:attacker], forged_group, *honest[attacker + 1 :]]
    kw = dict(
        temperature=temperature,
        staleness=staleness,
        learner_version=staleness,
        targets=targets,
        legacy=legacy,
    )
    out = {
        "targets": len(targets),
        "honest": influence(model, honest, attacker, config, **kw),
        "forged": influence(model, forged, attacker, config, **kw),
    }
    h, f = out["honest"]["target_change"], out["forged"]["target_change"]
    out["ratio"] = f / h if h else math.inf
    out["displacement"] = abs(f - h) / abs(h) if h else math.inf
    return out


def drift(model, batches, config: LearnerConfig, *, temperature: float):
    """`model` after one honest AdamW step per batch (the learner `len(batches)` versions on)."""
    later = copy.deepcopy(model)
    opt = make_optimizer(later, config)
    for groups in batches:
        train_step(later, opt, groups, config, pad_id=0, temperature=temperature)
    return later


def main() -> None:
    from common import smollm2, write_json

    from echo2.config import ArithmeticTaskConfig, RolloutConfig
    from echo2.data.tasks import make_task
    from echo2.rollout.collect import collect
    from echo2.rollout.engine import HFEngine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok, model = smollm2()
    task = make_task(ArithmeticTaskConfig(difficulty=1, operations=["+", "-", "*"]), seed=0)
    rcfg = RolloutConfig(prompts_per_step=args.prompts, group_size=args.n, temperature=0.8, max_new_tokens=16)
    engine = HFEngine(model, tok, rcfg)

    def batch(start: int):
        prompts = [task.train_prompt(i) for i in range(start, start + args.prompts)]
        groups = collect(engine, task, prompts, n=args.n)
        mixed = [g for g in groups if len({r.reward for r in g}) > 1]
        return mixed or groups

    groups = batch(0)
    attacker = max(range(len(groups)), key=lambda i: sum(r.reward <= 0 for r in groups[i]))
    results = {}
    for s in (0, 4):
        later = (
            drift(model, [batch(100 + 10 * j) for j in range(s)], LearnerConfig(lr=1e-5), temperature=0.8)
            if s
            else model
        )
        for legacy in (True, False):
            config = LearnerConfig(lr=1e-5, staleness=s, **({"ratio_cap": None} if legacy else {}))
            key = f"{'before' if legacy else 'after'} S={s}"
            results[key] = attack(
                later, model, groups, attacker, config, temperature=0.8, staleness=s, legacy=legacy
            )
            print(key, results[key], flush=True)
    write_json(
        args.json, {"groups": len(groups), "group_size": args.n, "attacker": attacker, "results": results}
    )


if __name__ == "__main__":
    main()
