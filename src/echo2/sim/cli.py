"""`echo2 simulate SCENARIO.toml [--json] [--plot OUT.png] [--key=value ...]`.

Thin: parse, validate every point of the scenario (exit 2 naming the key on a mistake), then
import SimPy and matplotlib, run, print the report.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

DESCRIPTION = (
    "Simulate a deployment (ECHO-2 paper sections 3-5): learner, chunked broadcast over chains or a "
    "star, workers, staleness-bounded buffer, scheduler and faults. Reports learner wait, bubble ratio, "
    "T_bcast at q = 0.9 and 1.0, staleness, throughput and cost. Any scenario key can be overridden: "
    "--learner.staleness=4, --workers.0.count=12. A [sweep] table runs a list of points instead."
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="what a deployment will cost and how busy the learner will be (discrete-event model)",
        description=DESCRIPTION,
        epilog="example: echo2 simulate scenarios/paper/table2-ablation.toml --series Full --plot full.png",
    )
    p.add_argument("scenario", metavar="SCENARIO.toml", help="scenario file (see docs/reproduction.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="OUT.png", help="timeline of one run, or the sweep's metrics against x")
    p.add_argument(
        "--series",
        metavar="LABEL",
        help="run only this series of the [sweep] (without sweep.x: one run, with its timeline)",
    )


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_json_safe(x) for x in v]
    return v


def run(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    from echo2.config import ConfigError, parse_overrides
    from echo2.sim.scenario import expand, load_tree, validate

    where = f"{args.scenario}: "
    tree = load_tree(args.scenario, parse_overrides(extra or []))
    base = validate(tree, where)
    points = expand(tree, where)
    if args.series is not None:
        labels = [s.label for s in base.sweep.series] if base.sweep else []
        if args.series not in labels:
            raise ConfigError(f"--series: {args.series!r} is not one of {labels}")
        points = [p for p in points if p[0] == args.series]
        if base.sweep is not None and base.sweep.x is None:
            base = points[0][2]  # one run: reported as such, with a timeline

    from echo2.sim import report, sweep

    if base.sweep is None:
        from echo2.sim.model import simulate

        sim = simulate(base)
        result = report.metrics(sim)
        if base.faults:
            result = report.with_baseline(result, report.metrics(simulate(base, faults=False)))
        if args.plot:
            report.plot_timeline(sim, args.plot)
        print(json.dumps(_json_safe(result), indent=2) if args.json else report.render(result))
        return 0
    result = sweep.run_sweep(points, base.sweep)
    result["name"] = base.name
    if args.plot:
        sweep.plot_sweep(result, base.sweep, args.plot, title=base.name)
    print(json.dumps(_json_safe(result), indent=2) if args.json else sweep.render_sweep(result))
    return 0
