"""The broker on a real redis-server: consumer group, claims of stale entries, heartbeats, dead letters; a poison job."""
from __future__ import annotations

import time
import uuid

import pytest
import redis

from rl.jobs.broker import Broker, ensure_redis
from rl.jobs.records import JobsConfig, JobSpec
from rl.jobs.server import free_port, repair
from rl.jobs.store import open_store

pytestmark = pytest.mark.slow  # starts redis-server


@pytest.fixture
def broker(redis_url):
    b = Broker(redis_url, f"test:{uuid.uuid4().hex[:8]}")
    yield b
    b.r.delete(b.stream, b.dead_stream)
    b.close()


def test_read_ack_and_depth(broker):
    ids = [broker.enqueue(f"job{i}") for i in range(3)]
    assert broker.depth() == (3, 0)
    d = broker.read("a", block_ms=100)
    assert (d.job_id, d.entry_id, d.claimed) == ("job0", ids[0], False)
    assert broker.depth() == (2, 1)
    broker.ack(d.entry_id)
    assert broker.depth() == (2, 0) and not broker.has_entry(ids[0], "job0") and broker.has_entry(ids[1], "job1")
    assert not broker.has_entry(ids[1], "job2")  # same id, another job: not this job's entry


def test_stale_entry_is_claimed_by_another_consumer_unless_heartbeats_keep_it(broker):
    broker.enqueue("j1")
    d = broker.read("dead", block_ms=100)
    assert broker.claim_stale("b", min_idle_s=0.3) is None  # not idle long enough yet
    time.sleep(0.2)
    assert broker.heartbeat("dead", d.entry_id)
    time.sleep(0.2)
    assert broker.claim_stale("b", min_idle_s=0.3) is None  # the heartbeat reset its idle time
    time.sleep(0.4)
    c = broker.claim_stale("b", min_idle_s=0.3)
    assert (c.job_id, c.entry_id, c.claimed) == ("j1", d.entry_id, True)
    assert not broker.heartbeat("dead", d.entry_id)  # the old owner learns it lost the entry
    assert broker.remove_consumer("b") == -1  # still owns a pending entry
    broker.dead_letter(c.entry_id, "j1", 3, "ValueError: bad")
    assert broker.dead_letters() == [{"job_id": "j1", "attempts": "3", "error": "ValueError: bad"}]
    assert broker.depth() == (0, 0) and broker.remove_consumer("b") == 1


def test_ensure_redis_starts_a_server_only_when_none_answers(redis_url):
    assert ensure_redis(redis_url) is None
    port = free_port()
    proc = ensure_redis(f"redis://127.0.0.1:{port}/0")
    try:
        assert redis.Redis(port=port).ping()
    finally:
        proc.stop()
    assert proc.proc.returncode is not None


def test_repair_reenqueues_jobs_whose_entries_are_gone(broker, tmp_path):
    st = open_store(f"sqlite:///{tmp_path}/j.sqlite")
    a, b = (st.create_job(JobSpec(env="terminal-basics-v0", index=i)) for i in range(2))
    st.set_entry(a, broker.enqueue(a))
    # b was written but never enqueued (a crash in between); a's entry survives
    assert repair(st, broker) == 1
    broker.r.delete(broker.stream)  # a fresh Redis: every entry gone
    broker.ensure_group()
    assert repair(st, broker) == 2
    got = {broker.read("w", 100).job_id for _ in range(2)}
    assert got == {a, b}


def test_a_job_past_the_split_fails_at_once_and_a_failing_one_is_dead_lettered_after_max_attempts(broker, tmp_path):
    """A task index past the split cannot succeed: failed and dead-lettered on its first attempt. A job whose
    attempts fail for other reasons (here: the policy server is unreachable) is retried until max_attempts."""
    from rl.jobs.worker import EpisodeRunner, Worker

    cfg = JobsConfig(redis_url=broker.url, db_url=f"sqlite:///{tmp_path}/j.sqlite", stream=broker.stream, max_attempts=3)
    st = open_store(cfg.db_url)
    bad = st.create_job(JobSpec(env="terminal-basics-v0", split="heldout", index=10**6))
    st.set_entry(bad, broker.enqueue(bad))
    w = Worker("w1", cfg, st, broker, EpisodeRunner(cfg, "http://127.0.0.1:9"))
    w.serve(max_jobs=1)
    v = st.get(bad)
    assert (v.status, v.attempts) == ("failed", 1)
    assert "TaskIndexError" in v.error and "out of range" in v.error
    (dl,) = broker.dead_letters()
    assert dl["job_id"] == bad and dl["attempts"] == "1" and "TaskIndexError" in dl["error"]
    assert [e.kind for e in st.events(bad)] == ["queued", "started", "dead_letter", "failed"]

    flaky = st.create_job(JobSpec(env="terminal-basics-v0", split="heldout", index=0))
    st.set_entry(flaky, broker.enqueue(flaky))
    w.serve(max_jobs=3)  # nothing answers on port 9: every attempt's first generation fails
    v = st.get(flaky)
    assert (v.status, v.attempts) == ("failed", 3), v.error
    kinds = [e.kind for e in st.events(flaky)]
    assert kinds.count("started") == 3 and kinds.count("retry") == 2 and kinds[-2:] == ["dead_letter", "failed"]
    assert [d["job_id"] for d in broker.dead_letters()] == [bad, flaky]
    assert broker.depth() == (0, 0)
