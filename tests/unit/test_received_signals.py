"""The launcher's signals, from its handler to its watch loop: none dropped, none doubled,
whenever the handler runs."""

import signal

from reentry import interrupt_at_every_opcode

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
    # gets. Simulated at every opcode of the take, one signal each.
    signals = ReceivedSignals()
    signals.note(signal.SIGTERM)
    noted = [signal.SIGTERM]
    first = []

    def note():
        signum = signal.SIGINT if len(noted) % 2 else signal.SIGTERM
        signals.note(signum)
        noted.append(signum)

    interrupt_at_every_opcode(lambda: first.extend(signals.take()), note)
    assert len(noted) > 3  # the take ran several opcodes, each with a signal noted
    assert first + signals.take() == noted
