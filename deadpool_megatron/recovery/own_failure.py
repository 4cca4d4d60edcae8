"""Which errors are a rank's own failure, and when a recovery attempt meets the same one again.

A rank's own error (a bug, a flag combination Megatron-LM asserts on, memory) is what a user
must see with its traceback; a survivor's error from a failure elsewhere (a peer gone, a
collective aborted by the recovery, an order) is not. A recovery attempt that fails with the
very error that started the recovery failed deterministically: trying again in place would
fail the same way, and until a newer order no process would say so (the agent hears nothing
from a recovery under way), so the job waited for the recovery's timeout (300 s). The rank
gives up instead: its exit is evidence the agent acts on at once (a spare, or the end of the
job with that error).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..failure.evidence import is_peer_loss_message
from ..failure.injector import InjectedFault
from ..megatron.gloo_ops import AbortedByRecovery
from .exchange import RecoveryOrdered, Superseded


def caused_here(err: BaseException) -> bool:
    """Whether `err` is this rank's own failure rather than what a failure elsewhere, or a
    recovery, does to a survivor (an injected fault is a test's, announced as such)."""
    if isinstance(err, (RecoveryOrdered, Superseded, AbortedByRecovery, InjectedFault)):
        return False
    return not is_peer_loss_message(str(err))


def failed_here(err: BaseException) -> bool:
    """Whether `err` is this process's failure, for the agent to hear of: its own error, or a
    fault injected into it (raise@, announced as such); not what a failure elsewhere does."""
    return isinstance(err, InjectedFault) or caused_here(err)


def _signature(err: BaseException) -> tuple[str, str]:
    return type(err).__name__, str(err)


@dataclass
class OwnFailure:
    """The own error that started the recovery under way, if one did."""

    started: tuple[str, str] | None = None

    def interrupted(self, err: BaseException) -> bool:
        """A failure stops this rank: remember it when it is its own (True then)."""
        own = caused_here(err)
        self.started = _signature(err) if own else None
        return own

    def repeated(self, err: BaseException) -> bool:
        """Whether a recovery attempt failed with the error that started the recovery."""
        return self.started is not None and _signature(err) == self.started
