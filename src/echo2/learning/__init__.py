"""Learning plane: the learner loop, the rollout-source seam, GRPO math, the optimizer step,
device, precision and FSDP2 sharding, checkpoints.

The loop (loop.py) takes its data through `RolloutSource` (sources/) and never touches a socket
itself; which source it drives (in process, or a coordinator fed by workers) is `make_source`'s
choice.
"""
