"""deadpool-megatron: hot-swap fault tolerance for Megatron-LM training."""

from .config import JobConfig
from .errors import CheckpointError, ConfigError, DeadpoolError, LaunchError
from .topology import Coordinates, Topology

__version__ = "0.1.0"
__all__ = [
    "CheckpointError",
    "ConfigError",
    "Coordinates",
    "DeadpoolError",
    "JobConfig",
    "LaunchError",
    "Topology",
]
