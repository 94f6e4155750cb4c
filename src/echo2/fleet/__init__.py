"""The rollout fleet: which workers run, and who starts and stops them.

selection.py (`WorkerOffer`; the cheapest set of workers whose throughput reaches a target, exact
and greedy; pure), scheduler.py (the online activation and release policy; pure), provider.py (what
the scheduler needs from a provider) and providers/: local.py (worker processes on this machine)
and skypilot/ (cloud workers rented through SkyPilot).
"""
