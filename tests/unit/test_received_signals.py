"""The launcher's signals, from its handler to its watch loop: none dropped, none doubled,
whenever the handler runs."""

import signal
import sys

from deadpool_megatron.agent.signals import ReceivedSignals


def test_signals_are_taken_oldest_first_once_each():
    signals = ReceivedSignals()
    assert signals.take() == []
    signals.note(signal.SIGTERM, None)
    signals.note(signal.SIGINT, None)
    assert signals.take() == [signal.SIGTERM, signal.SIGINT]
    assert signals.take() == []


def test_a_signal_noted_at_any_point_of_a_take_is_taken_once():
    # Python runs a handler between any two bytecodes of the main thread: a signal noted in
    # the middle of the loop's take must land in what it takes or in what the next take
    # gets. Simulated at every opcode of `take`, one signal each.
    take_code = ReceivedSignals.take.__code__
    signals = ReceivedSignals()
    signals.note(signal.SIGTERM)
    noted = [signal.SIGTERM]

    def trace(frame, event, arg):
        if frame.f_code is not take_code:
            return None
        frame.f_trace_opcodes = True
        if event == "opcode":
            signum = signal.SIGINT if len(noted) % 2 else signal.SIGTERM
            signals.note(signum)
            noted.append(signum)
        return trace

    sys.settrace(trace)
    try:
        first = signals.take()
    finally:
        sys.settrace(None)
    assert len(noted) > 3  # the take ran several opcodes, each with a signal noted
    assert first + signals.take() == noted
