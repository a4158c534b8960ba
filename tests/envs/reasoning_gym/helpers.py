"""Shared pieces of the reasoning-gym adapter tests: a deterministic stratified sample of domains,
corrupted answers, and the in-process oracles (reasoning-gym's own `score_answer` on the task's entry;
the same under the project's rules of `envs/reasoning_gym/answers.py`)."""
from __future__ import annotations

import hashlib

from envs.reasoning_gym.answers import ALL_OR_NOTHING, GATES, OWN_SCORERS, AnswerRefused
from envs.reasoning_gym.catalog import DatasetInfo, datasets
from envs.reasoning_gym.judge_worker import decode_entry
from envs.reasoning_gym.tasks import open_dataset
from jointrl.records import Task

# Generators slower than ~20 ms per item here (measured in tests/envs/reasoning_gym/test_catalog.py's
# survey): left out of the conformance sample only to keep the suite short.
SLOW_GENERATORS = frozenset({"knight_swap", "futoshiki", "intermediate_integration", "zebra_puzzles", "puzzle24",
                             "sudoku", "countdown", "polynomial_equations", "acre", "spell_backward", "arc_agi"})


def stratified_sample(k: int, *, skip: frozenset[str] = frozenset()) -> list[DatasetInfo]:
    """k domains, round-robin over families (each family's domains in a fixed hash order)."""
    by_family: dict[str, list[DatasetInfo]] = {}
    for d in datasets():
        if d.name not in skip:
            by_family.setdefault(d.family, []).append(d)
    for v in by_family.values():
        v.sort(key=lambda d: hashlib.sha256(d.name.encode()).hexdigest())
    out: list[DatasetInfo] = []
    depth = 0
    while len(out) < k and any(len(v) > depth for v in by_family.values()):
        for fam in sorted(by_family):
            if len(by_family[fam]) > depth and len(out) < k:
                out.append(by_family[fam][depth])
        depth += 1
    return out


def corruptions(ref: str) -> list[str]:
    """Wrong answers close to the reference, most plausible first."""
    flips = {"True": "False", "False": "True", "true": "false", "false": "true", "Yes": "No", "No": "Yes",
             "yes": "no", "no": "yes"}
    out = [flips[ref]] if ref in flips else []
    digits = [i for i, c in enumerate(ref) if c.isdigit()]
    if digits:
        i = digits[-1]
        out.append(ref[:i] + str((int(ref[i]) + 1) % 10) + ref[i + 1:])
    out += [ref[::-1], ref + " 1", ref[: len(ref) // 2], "x" + ref, "wrong"]
    return [c for c in out if c != ref and c.strip()]


def oracle(task: Task, answer: str) -> float | None:
    """score_answer in this process, on the task's entry (the test is the trusted side); None when it
    raises (the judge reports that as `scorer_error`, reward 0)."""
    ds = open_dataset(task.private["dataset"], _seed_of(task))[0]
    try:
        return float(ds.score_answer(answer, decode_entry(task.private["entry"])))
    except Exception:  # noqa: BLE001 - e.g. prime_factorization raises ValueError on a non-number
        return None


def project_oracle(task: Task, answer: str) -> float:
    """The reward jointrl gives: `oracle` under the project's rules (own scorers, gates, all-or-nothing)."""
    name = task.private["dataset"]
    entry = decode_entry(task.private["entry"])
    if name in OWN_SCORERS:
        return OWN_SCORERS[name](answer, entry)
    if name in GATES:
        try:
            GATES[name](answer, entry)
        except AnswerRefused:
            return 0.0
    v = oracle(task, answer) or 0.0
    return 0.0 if name in ALL_OR_NOTHING and v < 1.0 else v


def _seed_of(task: Task) -> int:
    return int(task.id.split("/s")[-1].split("/")[0])
