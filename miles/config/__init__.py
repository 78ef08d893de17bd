"""Config schemas, validation and the allowlisted builder."""

from miles.config.build import build, check_allowed, locate
from miles.config.rank import RankConfig
from miles.config.schema import GROUP_SCHEMAS, MilesConfig, TargetConfig
from miles.config.validate import ConfigError, DataError, check_overrides, validate

__all__ = [
    "GROUP_SCHEMAS",
    "ConfigError",
    "DataError",
    "MilesConfig",
    "RankConfig",
    "TargetConfig",
    "build",
    "check_allowed",
    "check_overrides",
    "locate",
    "validate",
]
