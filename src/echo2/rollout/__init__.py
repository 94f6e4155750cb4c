"""Rollout plane: engines that sample responses with behaviour log-probs, and the rollout step."""
