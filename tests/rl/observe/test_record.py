"""rl/observe/record.py: the run record's families, its JSON round trip, and what a bad file says."""
from __future__ import annotations

import json
import re

import pytest

from jointrl.records import Message, Task
from rl.observe.record import DomainInfo, RunRecord, read_run_record, write_run_record


def test_run_record_families_come_from_tasks():
    t = Task(id="a", domain="rg-gcd-v0", prompt=(Message(role="user", content="q"),), public={"family": "arithmetic"})
    rec = RunRecord.of({"gcd": "rg-gcd-v0", "terminal": "terminal-v0"}, {"gcd": [t], "terminal": []}, steps=7)
    assert rec.family_of() == {"gcd": "arithmetic", "terminal": "terminal"}
    assert rec.steps == 7 and RunRecord.from_json(rec.to_json()) == rec


def test_version_1_records_read_with_unknown_steps(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"version": 1, "domains": [{"name": "a", "env_id": "a-v0", "family": "f"}]}))
    rec = read_run_record(tmp_path)
    assert rec == RunRecord((DomainInfo("a", "a-v0", "f"),), steps=None)


@pytest.mark.parametrize("text,msg", [
    ('{"domains": 3}', "'domains' must be a list"),
    ('{"domains": [{"name": "a"}]}', "domains[0] needs string 'name', 'env_id' and 'family'"),
    ('{"domains": [], "steps": -1}', "'steps' must be a non-negative integer"),
    ('{"domains": [], "steps": true}', "'steps' must be a non-negative integer"),
    ('{"domains": [', "not valid JSON"),
])
def test_a_bad_record_is_refused_naming_the_field(tmp_path, text, msg):
    (tmp_path / "run.json").write_text(text)
    with pytest.raises(ValueError, match=re.escape(msg)):
        read_run_record(tmp_path)


def test_runs_without_a_record_read_none(tmp_path):
    assert read_run_record(tmp_path) is None
    write_run_record(tmp_path, RunRecord((), steps=0))
    assert read_run_record(tmp_path) == RunRecord((), steps=0)
