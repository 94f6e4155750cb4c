"""Providers: turn the scheduler's decisions into running or stopped workers (fleet/provider.py).

local.py starts `echo2 worker` processes on this machine; skypilot/ rents cloud workers.
"""
