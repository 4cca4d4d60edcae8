"""The queue megatron-core's checkpoint writer sends its write results through: a plain one for
synchronous saves, and for asynchronous ones a Manager whose spawned server does not run the
training script again (checkpointing.install_results_queue)."""

from __future__ import annotations

import queue
import sys
import types

import pytest
from megatron.core.dist_checkpointing.strategies import filesystem_async

from deadpool_megatron.megatron import checkpointing


@pytest.fixture
def no_results_queue(monkeypatch):
    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    yield
    checkpointing.release_writer_processes()


def test_a_synchronous_save_gets_a_plain_queue_and_no_process(no_results_queue):
    checkpointing.install_results_queue(async_save=False)
    results = filesystem_async._results_queue
    assert type(results) is queue.Queue
    # A save a recovery cut short after its write, before its finalization read its results:
    results.put({0: ["written by the interrupted save"]})
    checkpointing.install_results_queue(async_save=False)  # the next save
    assert filesystem_async._results_queue is not results
    assert filesystem_async._results_queue.empty()  # it will read its own results only


def test_an_asynchronous_saves_manager_does_not_run_the_script_again(
    tmp_path, monkeypatch, no_results_queue
):
    # A training script whose top level leaves a mark: the spawned server would run it as
    # __mp_main__ (with its torch and megatron-core imports) if it saw it as __main__.
    mark = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(mark)!r}, 'w').close()\n")
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "__main__", main)
    checkpointing.install_results_queue(async_save=True)
    results = filesystem_async._results_queue
    assert sys.modules["__main__"] is main  # given back
    results.put({0: ["written"]})
    assert results.get(timeout=10) == {0: ["written"]}
    assert not mark.exists()
    assert results._manager is not None
    results.put({0: ["written by a save abandoned in flight"]})
    checkpointing.install_results_queue(async_save=True)  # the next save: same server
    fresh = filesystem_async._results_queue
    assert fresh._manager is results._manager and fresh.empty()
