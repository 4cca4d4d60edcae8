"""One exception base class with a few specific subclasses.

Messages name the bad value and what would be valid, so a user can fix the command line
without reading code.
"""


class DeadpoolError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(DeadpoolError):
    """An invalid flag value or combination, detected before any work starts."""

    exit_code = 2


class LaunchError(DeadpoolError):
    """The launcher could not start or keep the job running."""


class CheckpointError(DeadpoolError):
    """A persistent checkpoint is missing, incomplete or does not match the job."""
