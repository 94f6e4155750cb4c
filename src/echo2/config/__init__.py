"""Run configuration: one TOML file, validated by pydantic, overridable by `--section.key=value`.

schema.py owns every section's model and the rules between fields (the model and task sections
in workload.py); files.py reads TOML files and
command-line overrides and writes the resolved config. Imports no torch, so `echo2 run --dry-run`
and `--help` stay instant. A user mistake raises `ConfigError` whose message names the dotted key;
the CLI turns it into exit status 2 before anything starts.
"""

from echo2.config.files import (
    build_config,
    dump_toml,
    load_config,
    parse_overrides,
    read_toml,
    set_dotted,
    validation_message,
)
from echo2.config.schema import (
    ArithmeticTaskConfig,
    BroadcastConfig,
    Config,
    ConfigError,
    CoordinatorConfig,
    CustomTaskConfig,
    EnvTaskConfig,
    GGUFModelConfig,
    HFModelConfig,
    LearnerConfig,
    LoraConfig,
    MathTaskConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    SchedulerConfig,
    TaskConfig,
    TinyModelConfig,
    VLLMConfig,
    check_kappa,
    publish_every,
)

__all__ = [
    "ArithmeticTaskConfig",
    "BroadcastConfig",
    "Config",
    "ConfigError",
    "CoordinatorConfig",
    "CustomTaskConfig",
    "EnvTaskConfig",
    "GGUFModelConfig",
    "HFModelConfig",
    "LearnerConfig",
    "LoraConfig",
    "MathTaskConfig",
    "ModelConfig",
    "RolloutConfig",
    "RunConfig",
    "SchedulerConfig",
    "TaskConfig",
    "TinyModelConfig",
    "VLLMConfig",
    "build_config",
    "check_kappa",
    "dump_toml",
    "load_config",
    "parse_overrides",
    "publish_every",
    "read_toml",
    "set_dotted",
    "validation_message",
]
