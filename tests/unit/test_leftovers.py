"""Finding a generation's model that outlived its collection, and what holds it."""

from __future__ import annotations

import gc
import threading

from deadpool_megatron.recovery.leftovers import LeftBehind, referrer_chain


class _Model:
    def __init__(self):
        self.me = self  # a cycle: only a collection frees it


class _Holder:
    pass


HELD = _Holder()


def test_only_older_generations_that_are_still_alive_are_survivors():
    left = LeftBehind()
    old, freed, current = _Model(), _Model(), _Model()
    left.track(1, old)
    left.track(2, freed)
    left.track(3, current)
    del freed
    gc.collect()
    assert sorted(left.survivors(before=3)) == [1]
    del old
    gc.collect()
    assert left.survivors(before=3) == {} and left.survivors(before=4) == {3: left.survivors(4)[3]}


def test_the_chain_names_a_module_global_that_holds_the_model():
    left = LeftBehind()
    model = _Model()
    left.track(0, model)
    HELD.keep = {"model": [model]}
    del model
    try:
        chain = referrer_chain(left.survivors(before=1)[0])
    finally:
        del HELD.keep
    assert chain[0].startswith("globals of ") and chain[-1] == "_Model", chain
    assert "_Holder" in chain and "list" in chain


def test_the_chain_names_the_thread_and_local_variable_of_a_running_frame():
    left = LeftBehind()
    model = _Model()
    left.track(0, model)
    release, started = threading.Event(), threading.Event()

    def stuck(waiting_on):
        started.set()
        release.wait(10)

    thread = threading.Thread(target=stuck, args=([model],), name="stuck-helper")
    thread.start()
    started.wait(10)
    del model
    try:
        chain = referrer_chain(left.survivors(before=1)[0])
    finally:
        release.set()
        thread.join(10)
    assert chain[0].startswith("thread stuck-helper: frame stuck") and "'waiting_on'" in chain[0]
    assert chain[1:] == ["list", "_Model"]
    gc.collect()
    assert left.survivors(before=1) == {}


def test_a_freed_model_has_no_chain():
    left = LeftBehind()
    model = _Model()
    left.track(0, model)
    ref = left.survivors(before=1)[0]
    del model
    gc.collect()
    assert referrer_chain(ref) == []
