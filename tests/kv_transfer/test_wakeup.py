"""kv_transfer.wakeup: a connector thread's news ends the engine's idle sleep early."""

from __future__ import annotations

import threading

import pytest

from kvrelay.kv_transfer import wakeup
from tests.engine.test_llm_engine import make_llm

pytestmark = pytest.mark.timeout(60)


def test_a_notify_from_another_thread_ends_the_wait_and_the_wait_clears_it():
    wakeup.wait(0)  # whatever an earlier test left
    threading.Timer(0.05, wakeup.notify).start()
    assert wakeup.wait(30) is True  # NOTE: returns at the notify; 30 s is only the bound
    assert wakeup.wait(0) is False  # cleared: the next wait sleeps again


def test_a_notify_before_the_wait_is_not_lost():
    wakeup.wait(0)
    wakeup.notify()
    assert wakeup.wait(0) is True


def test_a_waking_queue_wakes_after_the_item_is_in_it(monkeypatch):
    q = wakeup.WakingQueue()
    seen: list[int] = []
    monkeypatch.setattr(wakeup, "notify", lambda: seen.append(q.qsize()))
    q.put("pin")
    q.put("read done")
    assert seen == [1, 2]  # each notify finds its own item already there
    assert [q.get_nowait(), q.get_nowait()] == ["pin", "read done"]


def test_an_idle_engine_step_sleeps_in_the_wakeup_wait_and_a_busy_one_does_not(monkeypatch):
    from kvrelay.engine import llm_engine

    waits: list[float] = []
    monkeypatch.setattr(wakeup, "wait", lambda timeout_s: waits.append(timeout_s) or False)
    llm = make_llm()
    llm.engine.step()  # nothing to do
    assert waits == [llm_engine.IDLE_STEP_SLEEP_S]
    llm.generate([[1, 2, 3]])
    assert waits == [llm_engine.IDLE_STEP_SLEEP_S]  # steps that computed did not sleep
