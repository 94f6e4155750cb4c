"""`echo2 simulate`: a SimPy model of a deployment, driven by the same pure policies as the system.

scenario.py (the TOML schema), broadcast.py (chunk-level store-and-forward schedules), model.py (the
learner, workers, buffer, broadcast and scheduler as SimPy processes), state.py (what a run
records), report.py (metrics, text, timeline plot), sweep.py (a scenario over a parameter list),
cli.py (the subcommand). docs/reproduction.md shows it against the paper.
"""
