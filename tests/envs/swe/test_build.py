"""The swe-v0 build loop's bookkeeping with stand-in validation (no tests run, no downloads):
quotas per split / library / function, determinism, rejection counts and resuming from the
checkpoint. The real validation is exercised by the small set (test_swe_env.py)."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

import envs.swe.build as B
from envs.swe.mutate import Mutation


def _cands(lib: str, n_fns: int, per_fn: int) -> list[B.Candidate]:
    out = []
    for r in range(per_fn):
        for f in range(n_fns):
            m = Mutation("off_by_one", f"{lib}/m.py", f"f{f}", 10 * f + r, 10 * f + r + 1, "0", "1", f + 1)
            out.append(B.Candidate(lib, m, "heldout" if f % 4 == 0 else "train"))
    return out


class _Pool:
    """Runs the stand-in validator in-process and records what was validated."""

    calls: list = []

    def __init__(self, *a, **k):
        pass

    def map(self, fn, items, chunksize=1):
        _Pool.calls += list(items)
        return [VERDICT(c) for c in items]

    def close(self):
        pass

    def join(self):
        pass


def VERDICT(c: B.Candidate) -> B.Verdict:  # noqa: N802 - a swappable module-level stand-in
    # Reject every third mutation start offset as too broad, accept the rest.
    return B.Verdict("too_many_failures") if c.mutation.start % 3 == 0 else B.Verdict("ok", ("t::x",))


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setenv("JOINTRL_CACHE", str(tmp_path))
    monkeypatch.setattr(B.L, "ensure_runtime", lambda: tmp_path)
    monkeypatch.setattr(B.L, "ensure_source", lambda lib: tmp_path)
    monkeypatch.setattr(B.L, "source_files", lambda lib, root=None: {})
    monkeypatch.setattr(B, "baseline", lambda lib, rt, py: B.Baseline(("t::x", "t::y"), {}, 1.0))
    monkeypatch.setattr(B, "candidates", lambda lib, seed: _cands(lib.name, 12, 3))
    monkeypatch.setattr(B, "make_instance", lambda c, v, lib, base, files: c)

    class Ctx:
        Pool = _Pool
    monkeypatch.setattr(B.mp, "get_context", lambda kind: Ctx)
    _Pool.calls = []
    return tmp_path


SPEC = B.BuildSpec("t", ("toolz", "cachetools"), n_train=9, n_heldout=3)


def test_quotas_are_met_exactly_and_respected(fake):
    got, report = B.build(SPEC, log=lambda *a: None)
    splits = Counter(c.split for c in got)
    assert splits == {"train": 9, "heldout": 3}
    per_lib = Counter((c.library, c.split) for c in got)
    assert all(v <= -(-q // 2) for (lib, s), v in per_lib.items() for q in [{"train": 9, "heldout": 3}[s]])
    per_fn = Counter((c.library, c.mutation.function) for c in got)
    assert max(per_fn.values()) <= B.MAX_PER_FUNCTION
    assert all(VERDICT(c).reason == "ok" for c in got)
    rejected = sum(1 for c in _Pool.calls if VERDICT(c).reason != "ok")
    assert report["reasons"] == {"ok": 12, "too_many_failures": rejected}
    assert report["evaluated"] == len(_Pool.calls) == 12 + rejected


def test_build_is_deterministic_and_resumes_from_its_checkpoint(fake):
    first, _ = B.build(SPEC, log=lambda *a: None)
    n_validated = len(_Pool.calls)
    assert n_validated > 0
    _Pool.calls = []
    again, _ = B.build(SPEC, log=lambda *a: None)
    assert again == first
    assert _Pool.calls == [], "a rebuild must take every verdict from the checkpoint"


def test_a_larger_quota_than_candidates_stops_cleanly(fake):
    spec = dataclasses.replace(SPEC, n_train=500, n_heldout=500)
    got, report = B.build(spec, log=lambda *a: None)
    assert 0 < len(got) < 1000 and report["accepted"] == len(got)
