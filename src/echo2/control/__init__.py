"""Control plane: the coordinator and its client, and the capacity planning and scheduling policies.

The coordinator (coordinator.py: HTTP; state.py: the parts under one lock,
intake.py and publisher.py, over the pure registry.py, leases.py, broadcast.py and fleet.py; errors.py: refusals; protocol.py: wire schemas; remote.py: the learner's
`RemoteRollout`), its one client (client.py: `CoordinatorClient`), and the pure policies it and
`echo2 plan` share (capacity.py, selection.py, scheduler.py, plan.py) with the provider seam
(provider.py). Knows no tensors: the learner hands it snapshot bytes.
"""
