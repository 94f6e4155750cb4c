"""The learner's HTTP service and its state: workers register, heartbeat, lease prompts, push
records and fetch snapshots here.

The service: server.py (`Coordinator`: authentication, size caps, timeouts, the workers' routes,
/status), http.py (its guard middleware and body reading), pushparse.py, snapshot_routes.py,
longpoll.py, status_page.py (GET /ui) and prom.py (GET /metrics). The state: state.py (the parts
under one lock, shared.py), intake.py (leases out and takes in), publisher.py (signs and keeps
snapshots), over the pure registry.py, leases.py, integrity.py and activation.py (the scheduler's
decisions turned into provider calls); journal.py keeps accepted records durable. Knows no tensors:
never imports torch, rollout or learning; the learner hands it snapshot bytes.
"""
