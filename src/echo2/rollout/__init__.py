"""Rollout plane: engines that sample responses with behaviour log-probs, the rollout step, the
in-process source, the worker process and local worker fleets. Knows nothing of training."""
