"""One logging format for every process: one line per event."""

from __future__ import annotations

import logging
import sys
import warnings

# megatron-core warnings that say nothing actionable about a job (fallbacks we chose on purpose).
_KNOWN_NOISE = (
    r".*Transformer Engine and Apex are not installed.*",
    r".*Apex is not installed.*",
    r".*full scope is deprecated.*",
    r".*CUDA_DEVICE_MAX_CONNECTIONS.*",
    r".*\.grad attribute of a Tensor that is not a leaf.*",
)


def setup_logging(prefix: str = "", level: int = logging.INFO) -> None:
    """`prefix` names the process (e.g. 'rank 3') when no launcher prefixes its lines."""
    fmt = "%(asctime)s " + (f"{prefix} " if prefix else "") + "%(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", stream=sys.stdout, force=True)
    for noisy in ("megatron", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for message in _KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=message)
    # torch deprecates the collective names megatron-core still calls; once per process is noise.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
