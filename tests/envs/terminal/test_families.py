"""The terminal families' check logic on crafted artifacts (no sandbox): cron semantics against a
brute-force reference, archive checks against bombs and links, answer normalisation."""
from __future__ import annotations

import csv
import datetime as dt
import gzip
import io
import random
import tarfile

import pytest

from envs.terminal.families import FAMILIES, _decompress_capped, cron_schedule_key, parse_crontab
from envs.terminal.tasks import make_task


class FileGrader:
    """Stands in for Grader where a check only reads files: returns bytes from a dict."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files_ = files

    def read(self, path, max_bytes=1_000_000):
        data = self.files_.get(path)
        return None if data is None or len(data) > max_bytes else data

    def read_text(self, path, max_bytes=1_000_000):
        data = self.read(path, max_bytes)
        return None if data is None else data.decode()


# ----------------------------------------------------------------------------- cron
DOW_NAMES = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]


def _ref_field_matches(field: str, value: int, lo: int, hi: int, dow: bool = False) -> bool:
    """man 5 crontab, read literally for one value: any comma part that matches."""
    for part in field.split(","):
        base, step = (part.split("/") + ["1"])[:2]
        step = int(step)
        if base == "*":
            start, end = lo, hi
        elif "-" in base:
            a, b = base.split("-")
            start, end = int(a), int(b)
        else:
            start = int(DOW_NAMES.index(base)) if dow and base in DOW_NAMES else int(base)
            end = hi if "/" in part else start
        for v in range(start, end + 1, step):
            if v == value or (dow and v == 7 and value == 0):
                return True
    return False


def _ref_matches(fields: list[str], t: dt.datetime) -> bool:
    m, h, dom, mon, dow = fields
    cron_dow = (t.weekday() + 1) % 7
    dom_ok = _ref_field_matches(dom, t.day, 1, 31)
    dow_ok = _ref_field_matches(dow, cron_dow, 0, 7, dow=True)
    # "If both fields are restricted (i.e., don't start with *), the command will be run when either
    # field matches the current time."
    day_ok = (dom_ok or dow_ok) if not dom.startswith("*") and not dow.startswith("*") else (dom_ok and dow_ok)
    return (_ref_field_matches(m, t.minute, 0, 59) and _ref_field_matches(h, t.hour, 0, 23)
            and _ref_field_matches(mon, t.month, 1, 12) and day_ok)


def _random_field(rng, lo, hi, names=None):
    kind = rng.choice(["*", "n", "range", "step", "list", "rangestep", "name"] if names else
                      ["*", "n", "range", "step", "list", "rangestep"])
    a = rng.randint(lo, hi)
    b = rng.randint(a, hi)
    return {"*": "*", "n": str(a), "range": f"{a}-{b}", "step": f"*/{rng.randint(1, 9)}",
            "list": ",".join(str(rng.randint(lo, hi)) for _ in range(3)), "rangestep": f"{a}-{b}/{rng.randint(1, 4)}",
            "name": rng.choice(names or ["x"])}[kind]


def test_cron_schedule_key_matches_a_brute_force_reference():
    rng = random.Random(0)
    start = dt.datetime(2027, 1, 1)
    times = [start + dt.timedelta(minutes=rng.randrange(2 * 366 * 24 * 60)) for _ in range(600)]
    times = [t for t in times if t.year in (2027, 2028)]
    for _ in range(150):
        fields = [_random_field(rng, 0, 59), _random_field(rng, 0, 23), _random_field(rng, 1, 31),
                  _random_field(rng, 1, 12), _random_field(rng, 0, 7, DOW_NAMES)]
        mins, hours, days = cron_schedule_key(fields)
        dayset = set(days)
        for t in times:
            ours = t.minute in mins and t.hour in hours and (t.year, t.month, t.day) in dayset
            assert ours == _ref_matches(fields, t), (fields, t)


def test_equivalent_cron_spellings_compare_equal_and_different_ones_do_not():
    assert cron_schedule_key("*/15 * * * 1-5".split()) == cron_schedule_key("0,15,30,45 * * * mon-fri".split())
    assert cron_schedule_key("0 0 * * 0".split()) == cron_schedule_key("0 0 * * 7".split())
    # both day fields restricted: OR, so this is not the same as "day 1 only"
    assert cron_schedule_key("0 0 1 * 1".split()) != cron_schedule_key("0 0 1 * *".split())
    assert parse_crontab("@daily /x\n# c\nSHELL=/bin/sh\n") == parse_crontab("0 0 * * * /x")
    with pytest.raises(ValueError):
        parse_crontab("61 * * * * /x")


def test_cron_check_accepts_an_equivalent_entry_and_rejects_a_dropped_one():
    task = make_task("train", 0, list(FAMILIES).index("cron_schedule"))
    fam, data = FAMILIES["cron_schedule"], task.private["check"]
    base = "\n".join(data["existing"]) + "\n"
    assert fam.check(FileGrader({"jobs.cron": (base + data["new"] + "\n").encode()}), data) == 1.0
    assert fam.check(FileGrader({"jobs.cron": (data["new"] + "\n").encode()}), data) == 0.0
    assert fam.check(FileGrader({"jobs.cron": b"garbage line\n"}), data) == 0.0


# ----------------------------------------------------------------------------- archives
def _tar(members: dict[str, bytes], symlink: str | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        if symlink:
            info = tarfile.TarInfo(symlink)
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tf.addfile(info)
    return buf.getvalue()


def test_tar_check_on_crafted_archives():
    fam = FAMILIES["tar_create"]
    data = {"archive": "b.tar.gz", "compression": "gz", "expected": {"docs/a.txt": "one\n", "docs/x/b.txt": "two\n"}}
    good = {"docs/a.txt": b"one\n", "./docs/x/b.txt": b"two\n"}
    assert fam.check(FileGrader({"b.tar.gz": _tar(good)}), data) == 1.0
    assert fam.check(FileGrader({"b.tar.gz": _tar({**good, "docs/c.md": b"x"})}), data) == 0.0
    assert fam.check(FileGrader({"b.tar.gz": _tar(good, symlink="docs/link.txt")}), data) == 0.0
    assert fam.check(FileGrader({"b.tar.gz": _tar({"docs/a.txt": b"one\n"})}), data) == 0.0
    assert fam.check(FileGrader({"b.tar.gz": b"not an archive"}), data) == 0.0
    assert fam.check(FileGrader({}), data) == 0.0


def test_decompression_is_capped_against_bombs():
    bomb = gzip.compress(b"\0" * (64 << 20))
    assert len(bomb) < 200_000 and _decompress_capped(bomb, cap=16 << 20) is None
    assert _decompress_capped(gzip.compress(b"hello")) == b"hello"
    assert _decompress_capped(b"\x1f\x8bjunk") is None


# ----------------------------------------------------------------------------- answers
def test_answer_normalisation_tolerates_trailing_space_only():
    fam = FAMILIES["log_top"]
    data = {"expected": ["10.0.0.1", "10.0.0.2"]}
    assert fam.check(FileGrader({"answer.txt": b"10.0.0.1  \r\n10.0.0.2\n\n\n"}), data) == 1.0
    assert fam.check(FileGrader({"answer.txt": b"10.0.0.2\n10.0.0.1\n"}), data) == 0.0
    assert fam.check(FileGrader({"answer.txt": b" 10.0.0.1\n10.0.0.2\n"}), data) == 0.0


def test_csv_check_accepts_any_valid_quoting():
    task = make_task("train", 0, list(FAMILIES).index("csv_groupby"))
    fam, data = FAMILIES["csv_groupby"], task.private["check"]
    buf = io.StringIO()
    csv.writer(buf, quoting=csv.QUOTE_ALL).writerows(data["expected"])
    assert fam.check(FileGrader({data["path"]: buf.getvalue().encode()}), data) == 1.0
    assert fam.check(FileGrader({data["path"]: buf.getvalue().encode()[:-10]}), data) == 0.0


def test_generation_is_deterministic_and_seed_dependent():
    for i in range(len(FAMILIES)):
        assert make_task("train", 3, i).to_row() == make_task("train", 3, i).to_row()
        assert make_task("train", 3, i).to_row() != make_task("train", 4, i).to_row()
