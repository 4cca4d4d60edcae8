"""One exception base class with a few specific subclasses.

Messages name the bad value and what would be valid, so a user can fix the command line
without reading code.
"""

# A process that refuses its input exits with this status (argparse's), and deadpool-launch
# ends the job when a worker does: a spare given the same input would refuse it too.
BAD_INPUT_EXIT = 2


class DeadpoolError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(DeadpoolError):
    """An invalid flag value or combination, detected before any work starts."""

    exit_code = BAD_INPUT_EXIT


class LaunchError(DeadpoolError):
    """The launcher could not start or keep the job running."""


class CheckpointError(DeadpoolError):
    """A persistent checkpoint is missing, incomplete or does not match the job."""

    exit_code = BAD_INPUT_EXIT
