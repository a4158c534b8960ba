"""The jobs database: versioned migrations, idempotent completion, durability across reopen, refused URLs."""
from __future__ import annotations

import sqlite3

import pytest

from jointrl.records import Message
from rl.config import ConfigError
from rl.jobs.pool import target_replicas
from rl.jobs.records import JobResult, JobsConfig, JobSpec
from rl.jobs.store import MIGRATIONS, SCHEMA_VERSION, SqliteStore, open_store
from rl.types import Episode


def _episode(reward: float = 1.0) -> Episode:
    return Episode(task_id="t0", domain="terminal", group_id="g", token_ids=(5, 6, 7, 3), loss_mask=(0, 1, 1, 1),
                   rollout_logprobs=(0.0, -0.5, -0.25, -0.125), messages=(Message(role="user", content="hi"),
                                                                          Message(role="assistant", content="ok")),
                   reward=reward, metrics={"turns": 1.0}, terminated=True, num_turns=1, wall_s=0.5)


def _result(reward: float = 1.0) -> JobResult:
    return JobResult(reward=reward, turns=1, terminated=True, truncated=False, grade_error=None, num_tokens=4, wall_s=0.5, worker="w1")


def test_complete_is_idempotent_and_episode_round_trips(tmp_path):
    st = open_store(f"sqlite:///{tmp_path}/j.sqlite")
    jid = st.create_job(JobSpec(env="terminal-basics-v0", index=3))
    assert st.get(jid).status == "queued"
    a1 = st.start_attempt(jid, "w1")
    a2 = st.start_attempt(jid, "w2")  # a second delivery of the same entry (the first worker looked dead)
    assert (a1, a2) == (1, 2)
    assert st.complete(jid, a2, _result(1.0), _episode(1.0)) is True
    assert st.complete(jid, a1, _result(0.0), _episode(0.0)) is False  # the late one changes nothing
    assert st.start_attempt(jid, "w3") is None
    v = st.get(jid)
    assert (v.status, v.attempts, v.result.reward) == ("done", 2, 1.0)
    kinds = [e.kind for e in st.events(jid)]
    assert kinds == ["queued", "started", "started", "done"]
    (ep,) = st.episodes([jid])
    want = _episode(1.0)
    assert (ep.token_ids, ep.loss_mask, ep.rollout_logprobs, ep.reward) == (want.token_ids, want.loss_mask, want.rollout_logprobs, 1.0)
    assert [m.content for m in ep.messages] == ["hi", "ok"]
    assert st.events(jid, after_seq=st.events(jid)[1].seq)[0].kind == "started"


def test_nothing_lost_on_reopen_and_cancel_is_final(tmp_path):
    url = f"sqlite:///{tmp_path}/j.sqlite"
    st = open_store(url)
    ids = [st.create_job(JobSpec(env="terminal-basics-v0", index=i)) for i in range(3)]
    st.start_attempt(ids[0], "w1")
    st.add_event(ids[0], 1, "turn", {"turn": 1})
    assert st.cancel(ids[2]) and not st.cancel(ids[2])
    assert st.fail_attempt(ids[1], 0, "boom", final=False)
    other = open_store(url)  # a second process's view (the server after a restart)
    assert [e.kind for e in other.events(ids[0])] == ["queued", "started", "turn"]
    assert sorted(j for j, _ in other.unfinished()) == sorted(ids[:2])
    assert other.get(ids[1]).error == "boom" and other.get(ids[1]).status == "queued"
    assert other.counts() == {"running": 1, "queued": 1, "cancelled": 1}
    st.close()
    other.close()


def test_migrations_upgrade_an_old_database_and_refuse_a_newer_one(tmp_path):
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(MIGRATIONS[0] + "\nPRAGMA user_version = 1;")
    conn.execute("INSERT INTO jobs(id, spec, status, created_at) VALUES ('a', ?, 'queued', 0)", (JobSpec(env="x-v0").to_json(),))
    conn.commit()
    conn.close()
    st = SqliteStore(path)
    assert st.migrated_from == 1 and SCHEMA_VERSION == 3
    assert st.get("a").status == "queued" and st.get("a").owner is None  # the column migration 3 added
    assert st.episodes() == []  # the table migration 2 added
    b = st.create_job(JobSpec(env="x-v0"), owner="k1")
    assert st.get(b).owner == "k1" and "owner" not in st.get(b).to_json()  # the owner is never sent to clients
    st.close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(ConfigError, match="newer than this build"):
        SqliteStore(path)


def test_refused_urls_and_bad_config_name_the_key():
    with pytest.raises(ConfigError, match="jobs.db_url.*Postgres backend is not built"):
        open_store("postgresql://u@127.0.0.1/jobs")
    with pytest.raises(ConfigError, match="jobs.db_url"):
        open_store("mysql://x")
    with pytest.raises(ConfigError, match="jobs.max_workers"):
        JobsConfig(min_workers=3, max_workers=2)
    with pytest.raises(ConfigError, match="jobs.workers must be an integer >= 0, got -1"):
        JobsConfig(workers=-1)
    assert JobsConfig(min_workers=0, max_workers=0, workers=0).initial_workers == 0  # API only
    with pytest.raises(ConfigError, match="jobs.claim_timeout_s"):
        JobsConfig(claim_timeout_s=0)
    with pytest.raises(ConfigError, match=r"job.split must be one of \['train', 'heldout'\]"):
        JobSpec(env="terminal-basics-v0", split="test")
    with pytest.raises(ConfigError, match="unknown job field"):
        JobSpec.from_json({"env": "terminal-basics-v0", "budget": 3})
    with pytest.raises(ConfigError, match="job.thinking"):
        JobSpec(env="terminal-basics-v0", thinking="huge")


def test_autoscaler_control_law():
    cfg = JobsConfig(min_workers=1, max_workers=4, jobs_per_worker=2)
    assert [target_replicas(q, f, cfg) for q, f in [(0, 0), (1, 0), (3, 0), (3, 2), (40, 4), (0, 1)]] == [1, 1, 2, 3, 4, 1]
    assert target_replicas(0, 0, JobsConfig(min_workers=0, max_workers=2)) == 0


def test_jobs_serve_refuses_bad_flags_before_starting_anything(capsys):
    from rl.cli import main

    assert main(["jobs", "serve", "tiny", "--workers", "3", "--max-workers", "2"]) == 2
    assert "jobs.max_workers (2) must be >= jobs.min_workers (3)" in capsys.readouterr().err
    assert main(["jobs", "serve", "tiny", "--db", "postgresql://127.0.0.1/j", "--policy-url", "http://127.0.0.1:9"]) == 2
    assert "Postgres backend is not built" in capsys.readouterr().err
