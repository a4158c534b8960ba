"""Quiet consoles, kept logs: vLLM's per-weight notices fold into one line per burst on the console while
RUN_DIR/logs/ keeps every record; the driver's log file has what the console leaves out; start-up stages
log their progress."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

ENGINE = r"""
import logging, sys
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging_if_needed, init_logger
configure_logging_if_needed(LoggingConfig())  # what vllm.LLM(...) does first, from the VLLM_* variables
utils = init_logger("vllm.model_executor.models.utils")
reload = init_logger("vllm.model_executor.model_loader.reload.inplace")
for i in range(122):
    utils.warning("Attempted to load weight %s with dtype %s into parameter with dtype %s", f"model.layers.{i}.w", "torch.bfloat16", "torch.float32")
utils.info("engine ready")
for _ in range(3):
    utils.warning("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.")
for sync in range(2):
    for i in range(31):
        reload.warning("Following weights were not loaded from checkpoint: %s", {f"model.layers.{j}.x" for j in range(40)})
    utils.info("sync %d done", sync)
"""


def test_engine_chatter_is_one_line_on_the_console_and_whole_in_engines_log(tmp_path):
    from rl.log import setup_logging

    setup_logging("INFO", tmp_path)  # writes RUN_DIR/logs/engine_logging.json and points VLLM_LOGGING_CONFIG_PATH at it
    cfg = tmp_path / "logs" / "engine_logging.json"
    assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == str(cfg)
    # a process that reads the config as a rollout worker does: vLLM's own logging set-up, from the variable
    p = subprocess.run([sys.executable, "-c", ENGINE], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "VLLM_LOGGING_CONFIG_PATH": str(cfg)})
    assert p.returncode == 0, p.stderr[-3000:]
    console = [line for line in p.stderr.splitlines() if " vllm." in line]
    print("\n".join(console))
    assert sum("Attempted to load weight" in line for line in console) == 0
    assert sum("Following weights were not loaded" in line for line in console) == 0
    assert [line.split(": ", 1)[1] for line in console] == [
        "vLLM loaded 122 weight(s) into parameters of another dtype (first: model.layers.0.w torch.bfloat16 torch.float32); "
        "the list is in RUN_DIR/logs/engines.log",
        "engine ready", "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.",
        "(the line above 2 more time(s))", "sync 0 done", "sync 1 done"]  # the partial-update summaries are DEBUG lines
    kept = (tmp_path / "logs" / "engines.log").read_text().splitlines()
    assert sum("Attempted to load weight" in line for line in kept) == 122
    assert sum("Following weights were not loaded" in line for line in kept) == 62


def test_debug_console_shows_the_partial_update_count(tmp_path):
    from rl.log import QuietStreamHandler

    import io

    out = io.StringIO()
    h = QuietStreamHandler(out)
    h.setLevel(logging.DEBUG)
    lg = logging.getLogger("vllm.test_quiet")
    lg.addHandler(h)
    lg.propagate = False
    lg.setLevel(logging.DEBUG)
    try:
        for _ in range(31):
            lg.warning("Following weights were not loaded from checkpoint: %s", {"a", "b"})
        lg.info("next")
    finally:
        lg.removeHandler(h)
    assert out.getvalue().splitlines() == [
        "vLLM: 31 partial weight update(s) left the other weights as they were (expected: a sync sends what changed)", "next"]


def test_driver_log_keeps_what_the_console_leaves_out(tmp_path, capsys):
    from rl.log import StartupStages, get_logger, setup_logging

    setup_logging("INFO", tmp_path)
    log = get_logger("test_logs")
    log.debug("a detail for the file only")
    log.info("a line for both")
    logging.getLogger("some_library").info("library chatter in the driver")
    os.environ["JOINTRL_CACHE"] = str(tmp_path / "cache")
    try:
        st = StartupStages(["one", "two"], key="k")
        st.next("one")
        st.next("two")
        st.done()
        again = StartupStages(["one", "two"], key="k")
        again.next("one")
    finally:
        del os.environ["JOINTRL_CACHE"]
    err = capsys.readouterr().err
    assert "a line for both" in err and "a detail for the file only" not in err
    assert "start-up [1/2] one" in err and "start-up [2/2] two" in err and "start-up done in" in err
    kept = (tmp_path / "logs" / "driver.log").read_text()
    assert "a detail for the file only" in kept and "a line for both" in kept and "library chatter in the driver" in kept
    assert json.loads((tmp_path / "cache" / "startup_times.json").read_text())["k"].keys() == {"one", "two"}
    assert "s left (last start here)" in kept or "s left" in err or again.before  # the second start knows the first


def test_ray_logs_link_survives_a_copied_run_directory(tmp_path, monkeypatch):
    """RUN_DIR/logs/ray-<session> per start and logs/ray to the latest; a run directory copied with its links
    followed (a real `ray` directory, as shutil.copytree makes) is left as it is and the run goes on. The Ray
    node here is a stand-in with a session directory (starting Ray costs ~25 s; the real link is made by every
    `jointrl train`, e.g. tests/rl/test_train_e2e.py)."""
    import types

    import ray

    from rl.log import link_ray_logs

    session = tmp_path / "session_2026_x"
    (session / "logs").mkdir(parents=True)
    monkeypatch.setattr(ray._private.worker, "_global_node", types.SimpleNamespace(get_session_dir_path=lambda: str(session)))
    run = tmp_path / "run"
    own = link_ray_logs(run)
    assert own == run / "logs" / "ray-session_2026_x" and own.resolve() == (session / "logs").resolve()
    assert (run / "logs" / "ray").resolve() == (session / "logs").resolve()
    (run / "logs" / "ray").unlink()
    (run / "logs" / "ray").mkdir()  # what a copy with followed links holds
    assert link_ray_logs(run) == own and (run / "logs" / "ray").is_dir() and not (run / "logs" / "ray").is_symlink()


def test_a_second_run_in_one_process_points_the_engines_at_its_own_logs(tmp_path, monkeypatch):
    from rl.log import setup_logging

    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.delenv("JOINTRL_ENGINE_LOGGING", raising=False)
    setup_logging("INFO", tmp_path / "a")
    setup_logging("INFO", tmp_path / "b")
    assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == str(tmp_path / "b" / "logs" / "engine_logging.json")
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", "/somewhere/a/person/chose.json")  # set by hand: kept
    setup_logging("INFO", tmp_path / "c")
    assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == "/somewhere/a/person/chose.json"
