"""The typed, strict config schema: TOML in, validated tree out, `--set` overrides.

Every section forbids unknown keys; every error names the key path and what is allowed.
The resolved config (defaults filled in) is what each run writes to its output folder
(`dump_toml`); `config show` prints it with every key's meaning and default
(`annotated_toml`). The tree is `_schema.py`; reading, overriding and writing it is
`_load.py`; the names below are the public ones.
"""

from dflash.config._load import annotated_toml, apply_overrides, dump_toml, load_config, moved_keys_mapped, parse_config
from dflash.config._schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DataFile,
    DistributedConfig,
    DrafterConfig,
    EvalConfig,
    LossConfig,
    OptimizerConfig,
    PipelineConfig,
    ProfileConfig,
    RegenConfig,
    RunConfig,
    ScheduleConfig,
    TargetConfig,
    TinyTargetConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DataFile",
    "DistributedConfig",
    "DrafterConfig",
    "EvalConfig",
    "LossConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "ProfileConfig",
    "RegenConfig",
    "RunConfig",
    "ScheduleConfig",
    "TargetConfig",
    "TinyTargetConfig",
    "TrainConfig",
    "annotated_toml",
    "apply_overrides",
    "dump_toml",
    "load_config",
    "moved_keys_mapped",
    "parse_config",
]
