"""rl/tinker/service.py without a trainer: what a request is refused for before any model loads.

Fast: the service is built on the tests' tiny checkpoint but never starts a trainer or an engine (every
request here is refused first). The SDK-facing behaviour of the same refusals is in test_service_sdk.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from rl.tinker.models import Datum, LoraRequest
from rl.tinker.service import TinkerError, TinkerLimits, TinkerService
from tests.helpers.checkpoints import TinyModelSpec, build_tiny_checkpoint

LORA = LoraRequest(rank=4, seed=0, train_attn=True, train_mlp=False, train_unembed=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), TinyModelSpec(kind="qwen3_moe")))


def _service(ckpt, tmp_path, **limits) -> TinkerService:
    return TinkerService(ckpt, "tiny-moe", tmp_path, TinkerLimits(long_poll_s=30, **limits), None, max_model_len=64)


def test_a_model_that_cannot_fit_is_a_failed_future_naming_the_memory(ckpt, tmp_path):
    svc = _service(ckpt, tmp_path, memory_headroom=1e9)
    sid = svc.create_session()
    f = svc.create_model(sid, 0, "tiny-moe", LORA)
    assert f.done.wait(30) and f.error[1] == "user" and "cannot fit another training client" in f.error[0]
    assert svc.models == {}  # refused: nothing held


def test_refusals_before_anything_loads(ckpt, tmp_path):
    svc = _service(ckpt, tmp_path)
    sid = svc.create_session()
    with pytest.raises(TinkerError) as e:
        svc.create_model(sid, 0, "another-model", LORA)
    assert e.value.status == 400 and "not served here" in e.value.message
    with pytest.raises(TinkerError) as e:
        svc.create_model("session-forged", 0, "tiny-moe", LORA)
    assert e.value.status == 404
    with pytest.raises(TinkerError) as e:
        svc.create_model(sid, 0, "tiny-moe", LoraRequest(0, 0, True, True, True))
    assert e.value.status == 400 and "rank" in e.value.message
    full = _service(ckpt, tmp_path, max_training_clients=0)  # every slot taken
    with pytest.raises(TinkerError) as e:
        full.create_model(full.create_session(), 0, "tiny-moe", LORA)
    assert e.value.status == 400 and "at most 0 training clients" in e.value.message
    with pytest.raises(TinkerError) as e:
        svc.get_info("session-x:train:0")
    assert e.value.status == 404


def test_checkpoint_paths_stay_in_their_session(ckpt, tmp_path):
    svc = _service(ckpt, tmp_path)
    a, b = svc.create_session(), svc.create_session()
    path = f"tinker://{a}:train:0/sampler_weights/step-1"
    _, owner = svc._owned_path(a, path, "sampler_weights")
    assert owner == f"{a}:train:0"
    for sid, p, status in [(b, path, 404),  # another session's checkpoint: the same answer as an unknown one
                           (a, f"tinker://{a}:train:0/sampler_weights/../../etc", 400),
                           (a, f"tinker://{a}:train:0/weights/x", 400),  # the wrong kind
                           (a, "file:///etc/passwd", 400)]:
        with pytest.raises(TinkerError) as e:
            svc._owned_path(sid, p, "sampler_weights")
        assert e.value.status == status, p
    with pytest.raises(TinkerError) as e:
        svc.create_sampling_session(b, path, None)
    assert e.value.status == 404


def test_datum_checks(ckpt, tmp_path):
    svc = _service(ckpt, tmp_path, max_batch_tokens=100)
    ok = Datum(np.arange(10), {"target_tokens": np.arange(1, 11), "weights": np.ones(10, np.float32)})
    svc.check_data([ok], ("target_tokens", "weights"), ())
    cases = [([ok] * 11, "tokens in one request"),
             ([Datum(np.arange(65), {"target_tokens": np.arange(65), "weights": np.ones(65, np.float32)})], "at most 64"),
             ([Datum(np.arange(10), {"target_tokens": np.arange(10), "weights": np.ones(9, np.float32)})], "shape"),
             ([Datum(np.arange(10), {"target_tokens": np.arange(10)})], "lacks"),
             ([Datum(np.arange(10), {**ok.inputs, "advantages": np.ones(10, np.float32)})], "not read"),
             ([Datum(np.arange(10), {"target_tokens": np.arange(10), "weights": np.full(10, np.nan, np.float32)})], "non-finite"),
             ([Datum(np.array([0, 10**6]), {"target_tokens": np.arange(2), "weights": np.ones(2, np.float32)})], "token ids"),
             ([], "no data")]
    for data, match in cases:
        with pytest.raises(TinkerError, match=match) as e:
            svc.check_data(data, ("target_tokens", "weights"), ())
        assert e.value.status == 400


def test_sessions_without_heartbeats_are_finished_and_sessions_are_bounded(ckpt, tmp_path):
    import time

    svc = _service(ckpt, tmp_path, session_timeout_s=0.2, max_sessions=2, max_samplers_per_session=2)
    a = svc.create_session()
    samplers = [svc.create_sampling_session(a, None, "tiny-moe") for _ in range(3)]
    assert [s for s in samplers if s in svc.samplers] == samplers[1:]  # the oldest dropped
    svc.create_session()
    with pytest.raises(TinkerError) as e:
        svc.create_session()
    assert e.value.status == 429
    time.sleep(0.3)
    svc.create_session()  # the two silent sessions are finished first
    assert a not in svc.sessions and not any(v.session_id == a for v in svc.samplers.values())
    with pytest.raises(TinkerError) as e:
        svc.heartbeat(a)
    assert e.value.status == 404


def test_finishing_a_session_fails_its_queued_requests_and_never_blocks(ckpt, tmp_path):
    """A finished session's model: the running request completes, the queued ones fail (no client waits forever),
    and finishing returns at once even with the model's queue full."""
    import queue
    import threading

    from rl.tinker.service import Model

    svc = _service(ckpt, tmp_path, queue_depth=2)
    sid = svc.create_session()
    m = Model(f"{sid}:train:0", sid, "tiny-moe", LORA, queue.Queue(2))
    svc.models[m.model_id] = m
    threading.Thread(target=svc._worker, args=(m,), daemon=True).start()
    gate, started = threading.Event(), threading.Event()
    running = svc._future(sid)
    svc._enqueue(m, running, lambda: started.set() or (gate.wait(30) and "ran"))
    assert started.wait(30)  # the worker holds it: the queue is empty again
    queued = [svc._future(sid) for _ in range(2)]
    for f in queued:
        svc._enqueue(m, f, lambda: "should not run")
    with pytest.raises(TinkerError) as e:  # the queue is full: 429, and the refused future is forgotten
        svc._enqueue(m, svc._future(sid), lambda: None)
    assert e.value.status == 429
    svc.finish_session(sid)  # returns with the queue still full
    gate.set()
    assert running.done.wait(30) and running.result == "ran"
    for f in queued:
        assert f.done.wait(30) and f.error == (f"model {m.model_id} was unloaded: its session finished", "user")


@pytest.mark.parametrize("args,match", [(["--host", "0.0.0.0"], "needs an API key"), (["--api-key", " "], "empty or blank"),
                                        (["--max-training-clients", "0"], "must be >= 1")])
def test_cli_refuses_before_anything_starts(args, match):
    import subprocess
    import sys

    from tests import REPO

    r = subprocess.run([sys.executable, "-m", "rl.cli", "tinker", "serve", "tiny", *args], capture_output=True, text=True,
                       cwd=REPO, timeout=180)
    assert r.returncode == 2 and match in r.stderr, r.stderr
