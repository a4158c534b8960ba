"""SlotAllocator: uids leased with flock, and a full pool waits for a slot instead of failing at once."""
from __future__ import annotations

import threading
import time

import pytest

from envs.sandbox.hostctl import SlotAllocator


def test_a_full_pool_waits_for_a_released_slot(tmp_path):
    alloc = SlotAllocator(tmp_path / "locks", 61900, 1)
    held = alloc.acquire()
    threading.Timer(0.3, SlotAllocator.release, args=(held,)).start()
    t0 = time.monotonic()
    again = alloc.acquire(wait_s=10.0)
    waited = time.monotonic() - t0
    assert again.uid == held.uid and 0.25 <= waited < 10.0
    SlotAllocator.release(again)


def test_a_pool_that_stays_full_fails_after_the_wait_naming_the_knob(tmp_path):
    alloc = SlotAllocator(tmp_path / "locks", 61900, 1)
    held = alloc.acquire()
    try:
        with pytest.raises(RuntimeError, match="stayed in use for 0.2 s.*n_slots"):
            alloc.acquire(wait_s=0.2)
    finally:
        SlotAllocator.release(held)


def test_slots_are_exclusive_across_allocators(tmp_path):
    a, b = SlotAllocator(tmp_path / "locks", 61900, 2), SlotAllocator(tmp_path / "locks", 61900, 2)
    s1, s2 = a.acquire(), b.acquire()
    assert s1.uid != s2.uid
    with pytest.raises(RuntimeError):
        a.acquire(wait_s=0.0)
    for s in (s1, s2):
        SlotAllocator.release(s)
