"""echo2: cost-efficient RL post-training of LLMs with a centralized GRPO learner (ECHO-2)."""

__version__ = "0.1.0"


def setup_logging(quiet: bool) -> None:
    """Logging for an entry point (`echo2 run | learner | worker`), set up once: INFO, or WARNING
    with --quiet. Here because every entry point imports the root package anyway."""
    import logging

    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
