"""echo2: cost-efficient RL post-training of LLMs with a centralized GRPO learner (ECHO-2)."""

__version__ = "0.1.0"
