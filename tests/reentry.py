"""A signal handler's view of the code it interrupts, simulated: Python runs a handler
between any two bytecodes of the main thread, so a test can run the handler (or anything a
handler does) at every opcode of a call instead of waiting for a signal to land there."""

from __future__ import annotations

import sys
from collections.abc import Callable


def interrupt_at_every_opcode(call: Callable[[], object], interrupt: Callable[[], None]) -> int:
    """Run `call()`, and `interrupt()` at every opcode of it and of what it calls, on this
    thread; an interrupt is not interrupted in turn. Returns how many interrupts ran."""
    state = {"inside": False, "ran": 0}

    def trace(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode" and not state["inside"]:
            state["inside"] = True
            try:
                interrupt()
            finally:
                state["inside"] = False
            state["ran"] += 1
        return trace

    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return state["ran"]
