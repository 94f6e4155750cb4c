"""`echo2 simulate`: a SimPy model of a deployment, driven by the same pure policies as the system.

scenario.py (the TOML schema), broadcast.py (chunk-level store-and-forward schedules), one module
per process group as SimPy processes: learner.py, rollout.py (workers), dissemination.py (broadcast
and storage downloads), fleet.py (initial pool, scheduler loop and policy, billing), faults.py;
model.py (`Simulation`: composes them), state.py (what they share and a run records), report.py
(metrics, text, timeline plot), sweep.py (a scenario over a parameter list), cli.py (the
subcommand). docs/reproduction.md shows it against the paper.
"""
