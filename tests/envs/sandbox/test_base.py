"""The `Sandbox` / `SandboxBackend` contract (stat_artifact, open_pristine) on every implementation:
the bubblewrap backend and the test double in fakes.py; and the terminal `permissions` check, which
grades through that interface (host-side lstat) without running anything in the agent's sandbox."""
from __future__ import annotations

import os
import random
import stat

import pytest

from envs.sandbox.base import PathStat, Sandbox, SandboxBackend, SandboxLimits
from envs.sandbox.bwrap import BwrapBackend, BwrapSandbox
from envs.sandbox.safefs import ArtifactError
from envs.terminal.families import FAMILIES
from envs.terminal.grader import Grader
from tests.envs.fakes import LocalBackend, LocalSandbox

SMALL = SandboxLimits(workdir_mb=8, tmp_mb=8, max_procs=32, address_space_mb=512, file_size_mb=4, cpu_seconds=5,
                      open_files=128, max_output_bytes=64 * 1024)


@pytest.fixture(params=["bwrap", "local"])
def any_backend(request) -> SandboxBackend:
    if request.param == "local":
        return LocalBackend()
    return request.getfixturevalue("backend")  # conftest: the real one, or a skip


def _host_path(sb: Sandbox, rel: str) -> str:
    """Where a work-dir entry lives on the host (the reference reads it with a plain os.lstat)."""
    root = sb.workdir_host if isinstance(sb, BwrapSandbox) else sb.root
    return os.path.join(root, rel)


def _reference_stat(sb: Sandbox, rel: str) -> PathStat:
    st = os.lstat(_host_path(sb, rel))
    kinds = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink", stat.S_IFIFO: "fifo"}
    return PathStat(kind=kinds[stat.S_IFMT(st.st_mode)], mode=stat.S_IMODE(st.st_mode), size=st.st_size, uid=st.st_uid)


@pytest.mark.parametrize("cls", [BwrapBackend, BwrapSandbox, LocalBackend, LocalSandbox])
def test_every_implementation_has_the_whole_interface(cls):
    assert not cls.__abstractmethods__  # instantiable: stat_artifact / open_pristine are implemented
    base = SandboxBackend if issubclass(cls, SandboxBackend) else Sandbox
    assert set(base.__abstractmethods__) <= set(vars(cls))


def test_stat_artifact_reports_the_entry_itself(any_backend, tmp_path):
    os.chmod(tmp_path, 0o755)
    target = tmp_path / "host.sh"
    target.write_text("#!/bin/sh\n")
    os.chmod(target, 0o755)
    sb = any_backend.open(limits=SMALL, files={"a.txt": b"hello"})
    try:
        sb.run(f"mkdir -p d/e && chmod 750 d && printf 12345 > d/e/f && chmod 604 d/e/f && ln -s {target} link.sh"
               " && ln -s d dl && mkfifo pipe", timeout_s=10)
        sb.kill_all()
        for rel in ("a.txt", "d", "d/e/f", "link.sh", "dl", "pipe", "/" + "d/e/f"):
            rel_host = rel.lstrip("/")
            inside = f"{sb.workdir_inside}/{rel_host}" if rel.startswith("/") else rel  # absolute form too
            assert sb.stat_artifact(inside) == _reference_stat(sb, rel_host), rel
        got = {r: sb.stat_artifact(r) for r in ("d", "d/e/f", "link.sh", "pipe")}
        assert (got["d"].kind, got["d"].mode) == ("dir", 0o750)
        assert (got["d/e/f"].kind, got["d/e/f"].mode, got["d/e/f"].size) == ("file", 0o604, 5)
        assert got["link.sh"].kind == "symlink"  # not the 0755 host file it points to
        assert got["pipe"].kind == "fifo"
        with pytest.raises(FileNotFoundError):
            sb.stat_artifact("nope.txt")
        with pytest.raises(ArtifactError):
            sb.stat_artifact("dl/e/f")  # a symlink among the parents
        for bad in ("../etc/passwd", "/etc/passwd", ""):
            with pytest.raises(ArtifactError):
                sb.stat_artifact(bad)
    finally:
        sb.close()


def test_open_pristine_copies_the_agents_regular_files_as_data(any_backend, tmp_path):
    agent = any_backend.open(limits=SMALL)
    grader = None
    try:
        agent.run("echo right > answer.txt && mkdir -p sub && echo deep > sub/x && ln -s answer.txt link.txt"
                  " && mkfifo pipe && head -c 3000 /dev/zero > big.bin", timeout_s=10)
        grader = any_backend.open_pristine(agent=agent, files={"check.sh": b"cat ../agent/answer.txt ../agent/sub/x\n"},
                                           limits=SMALL, max_agent_file_bytes=2000)
        rep = grader.agent_copy
        assert sorted(rep.copied) == ["answer.txt", "sub/x"]  # no link, no FIFO
        assert [p for p, _ in rep.skipped] == ["big.bin"]  # over the cap: left out, not an error
        assert grader.list_artifacts() == ["check.sh"]  # the agent's files are not in the grader's work dir
        r = grader.run(["/bin/sh", "check.sh"], timeout_s=10, env={"PATH": "/usr/bin:/bin"}, cwd=grader.workdir_inside)
        assert (r.exit_code, r.stdout) == (0, "right\ndeep\n"), r.stderr
        assert agent.agent_copy is None and agent.read_artifact("answer.txt") == b"right\n"  # still readable after
        assert "check.sh" not in agent.list_artifacts()
    finally:
        agent.close()
        if grader is not None:
            grader.close()


def test_open_pristine_takes_a_mapping_or_nothing(any_backend):
    g = any_backend.open_pristine(agent={"a/b.txt": b"data"}, files={"t.txt": b"t"}, limits=SMALL)
    try:
        r = g.run(["/bin/cat", "../agent/a/b.txt", "t.txt"], timeout_s=10, cwd=g.workdir_inside)
        assert r.stdout == "datat" and g.agent_copy is None
    finally:
        g.close()
    g = any_backend.open_pristine(agent=None, files={"t.txt": b"t"}, limits=SMALL)
    try:
        assert g.list_artifacts() == ["t.txt"]
        assert g.run(["/bin/ls", "-A", "../agent"], timeout_s=10, cwd=g.workdir_inside).stdout == ""
    finally:
        g.close()
    with pytest.raises(TypeError, match="agent must be"):
        any_backend.open_pristine(agent=42, limits=SMALL)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- terminal `permissions`
class NoRunSandbox(Sandbox):
    """Wraps a sandbox; any command in it fails the test (the check must not run the agent's programs)."""

    def __init__(self, inner: Sandbox) -> None:
        self.inner = inner
        self.workdir_inside = inner.workdir_inside

    def run(self, command, **kw):
        raise AssertionError(f"the grader ran {command!r} in the agent's sandbox")

    def write_file(self, path, data, mode=0o644):
        raise AssertionError("the grader wrote into the agent's sandbox")

    def read_artifact(self, path, max_bytes=1_000_000):
        return self.inner.read_artifact(path, max_bytes)

    def stat_artifact(self, path):
        return self.inner.stat_artifact(path)

    def list_artifacts(self, max_files=10_000):
        return self.inner.list_artifacts(max_files)

    def kill_all(self):
        self.inner.kill_all()

    def close(self):
        self.inner.close()


def _permissions_instance(variant_index: int):
    fam = FAMILIES["permissions"]
    return fam, fam.generate(random.Random(variant_index), fam.variants()[variant_index])


def _agent_state(backend: SandboxBackend, inst, commands: str) -> Sandbox:
    sb = backend.open(limits=SMALL)
    for p, data in inst.files.items():
        sb.write_file(p, data, inst.modes.get(p, 0o644))
    sb.run(commands, timeout_s=10)
    sb.kill_all()
    return sb


@pytest.mark.parametrize("variant_index", [0, 13, 26])
def test_permissions_check_reads_modes_host_side(any_backend, variant_index, tmp_path):
    fam, inst = _permissions_instance(variant_index)
    expected = inst.check["expected"]
    bindir = next(p.split("/")[0] for p, m in expected.items() if p.endswith(".sh"))
    secdir = next(p.split("/")[0] for p, m in expected.items() if m == 0o600)
    sh = sorted(p for p in expected if p.endswith(".sh"))
    os.chmod(tmp_path, 0o755)
    good = tmp_path / "good.sh"
    good.write_text("#!/bin/sh\n")
    os.chmod(good, expected[sh[0]])

    def score(commands: str) -> float:
        sb = _agent_state(any_backend, inst, commands)
        try:
            # The rule by hand: every expected path is a regular file with exactly its mode, reached
            # through plain directories only (lstat of each component, none a link).
            def plain_file_with_mode(rel: str, mode: int) -> bool:
                parts = rel.split("/")
                for i in range(1, len(parts) + 1):
                    try:
                        st = os.lstat(_host_path(sb, "/".join(parts[:i])))
                    except FileNotFoundError:
                        return False
                    want_type = stat.S_ISREG if i == len(parts) else stat.S_ISDIR
                    if not want_type(st.st_mode):
                        return False
                return stat.S_IMODE(st.st_mode) == mode
            ref = all(plain_file_with_mode(p, m) for p, m in expected.items())
            got = fam.check(Grader(NoRunSandbox(sb), any_backend, SMALL), inst.check)
            assert got == float(ref), commands
            return got
        finally:
            sb.close()

    assert score(inst.reference[0]) == 1.0
    assert score("true") == 0.0
    assert score(inst.reference[0] + f" && chmod 644 {sh[-1]}") == 0.0  # one file missed
    assert score(inst.reference[0] + f" && chmod 640 notes.txt") == 0.0  # a file that should keep 644
    # A symlink to a file that has the right mode is not the file: 0 (a reader that followed it would say 1).
    assert score(inst.reference[0] + f" && rm {sh[0]} && ln -s {good} {sh[0]}") == 0.0
    # The whole secrets dir swapped for a symlink to a dir with the right modes: refused, 0.
    assert score(inst.reference[0] + f" && mv {secdir} real && ln -s real {secdir}") == 0.0
    assert score(inst.reference[0] + f" && rm {sh[0]}") == 0.0  # deleted


def test_permissions_check_ignores_planted_programs(backend):
    """A fake `find`/`stat`/`python3` printing the wanted modes cannot matter: nothing is run."""
    fam, inst = _permissions_instance(5)
    lines = "\\n".join(f"{p}\\tf\\t{m:o}" for p, m in inst.check["expected"].items())
    plant = f"printf '#!/bin/sh\\nprintf \"{lines}\\\\n\"\\n' > find; chmod +x find; cp find stat; cp find python3"
    sb = _agent_state(backend, inst, plant)
    try:
        assert sb.stat_artifact("find").mode == 0o755  # the plant is there
        assert fam.check(Grader(NoRunSandbox(sb), backend, SMALL), inst.check) == 0.0
    finally:
        sb.close()
