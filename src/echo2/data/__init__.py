"""Data plane: tasks (prompts, rewards, training tensors), multi-turn environments (data/envs/) and the replay buffer."""
