"""Planning: how much rollout throughput keeps the learner busy, what it costs, and what fits in
GPU memory.

capacity.py (the paper's overlap condition, mu_min, staleness bounds, bubble ratio; pure), plan.py
(`echo2 plan`; pure), catalog.py (rentable worker types from a GPU price catalog; pure), memory.py
(the GPU memory plan of a config; pure) and memory_cli.py (`echo2 plan --memory`).
"""
