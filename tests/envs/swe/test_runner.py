"""The swe-v0 test driver on a tiny synthetic library (local subprocess, no sandbox, no downloads).

Each tampering file is first shown to work against a plain `python -m pytest` run (so the test
could fail), then shown to have no effect through the driver's flags.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from envs.swe import libraries as L
from envs.swe.runner import TEST_ENV, SuiteResult, driver_argv, run_suite_local

DEMO = L.Library("demo", "0.0", "0" * 64, licence="MIT", import_root="", packages=("demo",), test_dirs=("tests",))

FILES = {
    "demo/__init__.py": "def add(a, b):\n    return a - b  # the bug\n",
    "tests/__init__.py": "",
    "tests/test_demo.py": ("from demo import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
                           "def test_other():\n    assert add(0, 0) == 0\n\n\n"
                           "class TestK:\n    def test_k(self):\n        assert add(1, 0) == 1\n"),
}
FORCE_PASS_CONFTEST = (
    "import pytest\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
    "    rep = (yield).get_result()\n    rep.outcome = 'passed'\n    rep.longrepr = None\n")
FIXED_SHADOW = "def add(a, b):\n    return a + b\n"
TAMPER = {
    "conftest.py": FORCE_PASS_CONFTEST,
    "tests/conftest.py": FORCE_PASS_CONFTEST,
    "pytest.ini": "[pytest]\naddopts = -k test_other\n",
    "setup.cfg": "[tool:pytest]\naddopts = -k test_other\n",
    # Startup hooks that put a fixed copy of the package first on sys.path.
    # (the import caches the fixed copy in sys.modules before anything else can import the package).
    "sitecustomize.py": "import sys; sys.path.insert(0, __file__.rsplit('/', 1)[0] + '/shadow'); import demo\n",
    # A .pth only runs from a site directory (e.g. if a grader ran `site.addsitedir` on the repo).
    "zz_shadow.pth": "import sys; sys.path.insert(0, 'shadow'); import demo\n",
    "shadow/demo/__init__.py": FIXED_SHADOW,
    # A stand-in for pytest that reports success without running anything.
    "pytest.py": "import sys\ndef main(*a, **k):\n    print('all tests passed')\n    return 0\n"
                 "if __name__ == '__main__':\n    sys.exit(main())\n",
}


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


@pytest.fixture(scope="module")
def runtime() -> Path:
    return L.ensure_runtime()


def run(tree: Path, runtime: Path) -> SuiteResult:
    return run_suite_local(DEMO, tree, runtime, L.interpreter(), timeout_s=120)


def test_driver_records_outcomes_failures_and_locations(tmp_path, runtime):
    write(tmp_path, FILES)
    r = run(tmp_path, runtime)
    assert r.ok and r.outcomes == {"tests/test_demo.py::test_add": "failed", "tests/test_demo.py::test_other": "passed",
                                   "tests/test_demo.py::TestK::test_k": "passed"}
    f = r.failures["tests/test_demo.py::test_add"]
    assert "assert -1 == 5" in f.message
    assert f.frames[-1][0] == "tests/test_demo.py" and f.frames[-1][2] == "test_add"
    assert r.locations["tests/test_demo.py::TestK::test_k"] == ("tests/test_demo.py", 13)
    assert r.cpu_s > 0
    assert not list(tmp_path.rglob("__pycache__")) and not (tmp_path / ".pytest_cache").exists()


def test_tampering_works_on_plain_pytest_but_not_through_the_driver(tmp_path, runtime):
    write(tmp_path, {**FILES, **TAMPER})
    # The attacks are real: a plain run (site enabled, conftest and ini honoured, cwd first on
    # sys.path) is fooled into reporting success.
    env = {**TEST_ENV, "PYTHONPATH": f"{tmp_path}/shadow:{runtime}/site"}
    plain = subprocess.run([str(L.interpreter()), "-m", "pytest", "-p", "no:cacheprovider", "tests"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    site_run = subprocess.run([str(L.interpreter()), "-c", "import demo; print(demo.add(2, 3))"], cwd=tmp_path,
                              env={**TEST_ENV, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=60)
    assert site_run.stdout.strip() == "5", "sitecustomize on the path must shadow the package in a plain run"
    # The driver: no conftest, no ini file, no site hooks, the real pytest.
    r = run(tmp_path, runtime)
    assert r.ok
    assert r.outcomes["tests/test_demo.py::test_add"] == "failed"
    assert r.outcomes["tests/test_demo.py::test_other"] == "passed"
    assert len(r.outcomes) == 3, "pytest.ini / setup.cfg addopts must not deselect tests"


def test_a_run_that_dies_reports_no_results(tmp_path, runtime):
    write(tmp_path, {**FILES, "demo/__init__.py": "import os\nos._exit(0)\n"})
    r = run(tmp_path, runtime)
    assert not r.ok and not r.outcomes


def test_a_timed_out_run_leaves_no_process_behind(tmp_path, runtime):
    """An endless mutation: the run times out, and the judge's worker goes with the judge (not left to spin
    until its CPU rlimit)."""
    import os
    import time

    write(tmp_path, {**FILES, "demo/__init__.py": "def add(a, b):\n    while True:\n        pass\n"})
    r = run_suite_local(DEMO, tmp_path, runtime, L.interpreter(), timeout_s=8)
    assert r.timed_out and not r.ok

    def alive() -> list[str]:
        out = []
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if str(tmp_path).encode() in cmd and state != "Z":
                out.append(pid)
        return out
    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive() == []


def test_collection_errors_are_recorded(tmp_path, runtime):
    write(tmp_path, {**FILES, "demo/__init__.py": "def add(a, b:\n"})
    r = run(tmp_path, runtime)
    assert r.ok and r.collect_errors == ("tests/test_demo.py",)


def test_driver_argv_refuses_options_as_selectors():
    with pytest.raises(ValueError, match="not an option"):
        driver_argv(DEMO, python="py", runtime="/rt", repo="/w", out=None, selectors=["-p", "evil"])
    argv = driver_argv(L.LIBRARIES["cachetools"], python="py", runtime="/rt", repo="/w", out="/w/o.json")
    assert argv[:6] == ["py", "-B", "-s", "-S", "-P", "/rt/driver.py"]
    assert argv[argv.index("--import-root") + 1] == "/w/src"
    assert argv[-2:] == ["--", "tests"] and "tests/test_threading.py" in argv


def test_runtime_holds_pytest_but_not_the_libraries(runtime):
    site = runtime / "site"
    assert (site / "pytest" / "__init__.py").exists() and (site / "_pytest").is_dir() and (site / "pluggy").is_dir()
    for lib in ("toolz", "cachetools", "tabulate", "more_itertools"):
        assert not (site / lib).exists(), f"{lib} in the runtime would mask a deleted package"
