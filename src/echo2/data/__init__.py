"""Data plane: tasks (prompts, rewards, training tensors) and the replay buffer."""
