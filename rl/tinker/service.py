"""The state behind the Tinker routes: sessions, training models, sampling sessions, snapshots, futures and queues.

Every long operation is a future: the route validates the request, queues the work and answers
`{"request_id", "model_id"}` at once; `/api/v1/retrieve_future` then answers the result, a failure
(`{"error", "category"}`, which the SDK raises as `RequestFailedError`) or, after a long poll,
`{"type": "try_again"}`. A training model's requests run one at a time, in arrival order, on that
model's own worker thread (the SDK sends a client's requests in its sequence order); its queue is
bounded (`TinkerLimits.queue_depth`, then 429). Sampling requests run on a small pool in front of
the shared engine, bounded the same way.

Ownership: a session id, model id, sampling session id and request id are unguessable tokens handed
out by this service, and a checkpoint path names the model that wrote it; a model can load only
checkpoints written by a model of its own session, and a sampling session can be made only from
snapshots of its own session's models. A wrong or foreign id answers 404, the same as an unknown one.

What this module does not do: HTTP or body decoding (rl/tinker/app.py), the math (rl/tinker/losses.py,
rl/algos), the trainer or the engine (rl/tinker/models.py).
"""
from __future__ import annotations

import queue
import re
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rl.log import get_logger
from rl.tinker.models import AdamStep, Datum, LoraRequest, SamplerEngine, TrainingModel, lora_targets

log = get_logger("tinker")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class TinkerError(Exception):
    """A refused request: HTTP status and a message (the app answers `{"detail": message}`)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class UserFailure(Exception):
    """A queued request that cannot be done for a reason the caller can fix (a failed future, category `user`)."""


@dataclass(frozen=True)
class TinkerLimits:
    max_training_clients: int = 4  # training models held at once (over all sessions)
    queue_depth: int = 64  # queued requests per training model, and sampling requests in all
    max_datums: int = 1024  # datums per forward_backward request (the SDK's chunk size is set to this)
    max_batch_tokens: int = 65536  # model-input tokens per forward_backward request
    max_body_bytes: int = 64 << 20  # any request body
    max_samples: int = 64  # num_samples of one sample request
    max_snapshots: int = 8  # sampler snapshots kept per model (oldest dropped)
    memory_headroom: float = 1.5  # a new model must fit this many times its estimated size in available memory
    long_poll_s: float = 20.0  # retrieve_future waits this long for a pending result before try_again
    session_timeout_s: float = 600.0  # a session without a heartbeat this long is finished (the SDK beats every 10 s)
    max_sessions: int = 1024
    max_samplers_per_session: int = 64  # sampling sessions kept per session (oldest dropped: they hold snapshots)


@dataclass
class Future:
    request_id: str
    session_id: str
    proto: bool = False  # the result is protobuf bytes (ForwardBackwardOutput / SampleResponse)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: tuple[str, str] | None = None  # (message, category)
    finished_at: float = 0.0
    _wakers: list[Callable[[], None]] = field(default_factory=list)  # long polls waiting on this result
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def set_done(self) -> None:
        with self._lock:
            self.done.set()
            wakers, self._wakers = self._wakers, []
        for wake in wakers:
            wake()

    async def wait(self, timeout: float) -> None:
        """Wait (in the event loop, holding no thread) until the result is in or `timeout` seconds pass."""
        import asyncio

        loop = asyncio.get_running_loop()
        woken = loop.create_future()

        def wake() -> None:  # called from the worker thread that finished the job
            loop.call_soon_threadsafe(lambda: woken.done() or woken.set_result(None))

        with self._lock:
            if self.done.is_set():
                return
            self._wakers.append(wake)
        try:
            await asyncio.wait_for(woken, timeout)
        except asyncio.TimeoutError:
            with self._lock:
                if wake in self._wakers:
                    self._wakers.remove(wake)


@dataclass
class Model:
    model_id: str
    session_id: str
    base_model: str
    lora: LoraRequest
    work: "queue.Queue[tuple[Future, Callable[[], Any]] | None]"
    closed: bool = False  # its session finished: queued requests fail instead of running
    model: TrainingModel | None = None
    snapshots: "OrderedDict[str, list]" = field(default_factory=OrderedDict)  # tinker path -> buckets
    thread: threading.Thread | None = None


@dataclass
class SamplingSession:
    sampling_session_id: str
    session_id: str
    base_model: str
    model_path: str | None
    key: str  # which weights: "base" or the snapshot path
    buckets: list | None


class TinkerService:
    def __init__(self, model_dir: str, served_name: str, state_dir: Path, limits: TinkerLimits,
                 engine_factory: Callable[[], Any] | None, max_model_len: int, tokenizer_dir: str | None = None) -> None:
        self.model_dir = model_dir
        self.tokenizer_dir = tokenizer_dir or model_dir  # what get_info names as the tokenizer (get_tokenizer loads it)
        self.served_name = served_name
        self.state_dir = state_dir
        self.limits = limits
        self.max_model_len = max_model_len
        self._lock = threading.Lock()
        self.sessions: dict[str, float] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self.futures: dict[str, Future] = {}
        self._engine_factory = engine_factory
        self._sampler: SamplerEngine | None = None
        self._sampler_lock = threading.Lock()
        self._sample_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tinker-sample")
        self._sample_slots = threading.BoundedSemaphore(limits.queue_depth)
        self._targets: dict[tuple[bool, bool], tuple[str, ...]] = {}
        self._vocab: int | None = None

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _token(prefix: str) -> str:
        return f"{prefix}{secrets.token_hex(12)}"

    def vocab_size(self) -> int:
        if self._vocab is None:
            import json

            cfg = json.loads((Path(self.model_dir) / "config.json").read_text())
            self._vocab = int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))
        return self._vocab

    def _future(self, session_id: str, proto: bool = False) -> Future:
        self._expire()
        f = Future(self._token("req-"), session_id, proto)
        with self._lock:
            self.futures[f.request_id] = f
        return f

    def _expire(self) -> None:
        """Forget results nobody fetched for 10 minutes (bounds memory under clients that never retrieve), and
        finish sessions whose client stopped beating (a crashed client's models are freed)."""
        now = time.monotonic()
        with self._lock:
            for rid in [r for r, f in self.futures.items() if f.done.is_set() and now - f.finished_at > 600]:
                del self.futures[rid]
            stale = [s for s, t in self.sessions.items() if now - t > self.limits.session_timeout_s]
        for sid in stale:
            log.info("session %s sent no heartbeat for %.0f s: finished", sid, self.limits.session_timeout_s)
            try:
                self.finish_session(sid)
            except TinkerError:  # finished meanwhile
                pass

    @staticmethod
    def _finish(f: Future, fn: Callable[[], Any]) -> None:
        try:
            f.result = fn()
        except UserFailure as e:
            f.error = (str(e), "user")
        except TinkerError as e:
            f.error = (e.message, "user")
        except Exception as e:  # a fault of the service: reported as such, never a hang
            log.exception("tinker request %s failed", f.request_id)
            f.error = (f"{type(e).__name__}: {e}", "server")
        f.finished_at = time.monotonic()
        f.set_done()

    def session(self, session_id: str) -> None:
        if session_id not in self.sessions:
            raise TinkerError(404, f"unknown session {session_id!r}")

    def model(self, model_id: str) -> Model:
        m = self.models.get(model_id)
        if m is None:
            raise TinkerError(404, f"unknown model_id {model_id!r}")
        return m

    def _enqueue(self, m: Model, f: Future, fn: Callable[[], Any]) -> None:
        try:
            m.work.put_nowait((f, fn))
        except queue.Full:
            with self._lock:
                self.futures.pop(f.request_id, None)
            raise TinkerError(429, f"model {m.model_id}: {self.limits.queue_depth} requests already queued; retry later") from None

    def _worker(self, m: Model) -> None:
        while True:
            job = m.work.get()
            if job is None:
                if m.closed:
                    m.model = None  # the trainer's memory goes with the last reference
                    return
                continue
            f, fn = job
            if m.closed:
                f.error = (f"model {m.model_id} was unloaded: its session finished", "user")
                f.finished_at = time.monotonic()
                f.set_done()
                continue
            self._finish(f, fn)

    @staticmethod
    def _close(m: Model) -> None:
        """Stop model `m`: what is queued fails, then its worker ends (never blocks the caller on a full queue)."""
        m.closed = True
        threading.Thread(target=m.work.put, args=(None,), daemon=True).start()

    # ------------------------------------------------------------------ sessions
    def create_session(self) -> str:
        self._expire()
        sid = self._token("session-")
        with self._lock:
            if len(self.sessions) >= self.limits.max_sessions:
                raise TinkerError(429, f"{self.limits.max_sessions} sessions are open; close one (ServiceClient.close) or retry later")
            self.sessions[sid] = time.monotonic()
        return sid

    def heartbeat(self, session_id: str) -> None:
        self.session(session_id)
        self.sessions[session_id] = time.monotonic()

    def finish_session(self, session_id: str) -> None:
        """The session's models and sampling sessions are dropped (their memory is freed)."""
        self.session(session_id)
        with self._lock:
            gone = [m for m in self.models.values() if m.session_id == session_id]
            for m in gone:
                del self.models[m.model_id]
            for sid in [s for s, v in self.samplers.items() if v.session_id == session_id]:
                del self.samplers[sid]
            del self.sessions[session_id]
        for m in gone:
            self._close(m)

    # ------------------------------------------------------------------ training models
    def _estimate_bytes(self, lora: LoraRequest) -> int:
        """fp32 weights of the base (the adapters and their Adam moments are a small fraction of it) plus a snapshot."""
        size = sum(f.stat().st_size for f in Path(self.model_dir).glob("*.safetensors"))
        return int(size * 2.2)  # the trainer's copy, one sampler snapshot, and slack for activations

    def create_model(self, session_id: str, model_seq_id: int, base_model: str, lora: LoraRequest) -> Future:
        self.session(session_id)
        if base_model not in (self.served_name, self.model_dir):
            raise TinkerError(400, f"base_model {base_model!r} is not served here; this service trains {self.served_name!r}")
        if not 1 <= lora.rank <= 256:
            raise TinkerError(400, f"lora_config.rank must be in [1, 256], got {lora.rank}")
        if not (lora.train_attn or lora.train_mlp):
            raise TinkerError(400, "lora_config: train_attn or train_mlp must be true (the unembedding is never adapted here)")
        model_id = f"{session_id}:train:{int(model_seq_id)}"
        with self._lock:
            if model_id in self.models:
                raise TinkerError(409, f"model {model_id} already exists")
            if len(self.models) >= self.limits.max_training_clients:
                raise TinkerError(400, f"this service holds at most {self.limits.max_training_clients} training clients "
                                       f"(--max-training-clients); unload one or finish its session first")
            m = Model(model_id, session_id, base_model, lora, queue.Queue(self.limits.queue_depth))
            self.models[model_id] = m
        m.thread = threading.Thread(target=self._worker, args=(m,), daemon=True, name=f"tinker-{model_seq_id}")
        m.thread.start()
        f = self._future(session_id)

        def build() -> dict:
            import psutil

            need = self._estimate_bytes(lora) * self.limits.memory_headroom
            avail = psutil.virtual_memory().available
            if need > avail:
                with self._lock:
                    self.models.pop(model_id, None)
                self._close(m)
                raise UserFailure(f"cannot fit another training client: it needs about {need / 2**30:.2f} GiB and "
                                  f"{avail / 2**30:.2f} GiB is available")
            key = (lora.train_attn, lora.train_mlp)
            if key not in self._targets:
                self._targets[key] = lora_targets(self.model_dir, lora)
            if not self._targets[key]:
                raise UserFailure("none of the requested LoRA targets exists in this model")
            m.model = TrainingModel(self.model_dir, lora, self._targets[key])
            return {"model_id": model_id, "type": "create_model"}

        self._enqueue(m, f, build)
        return f

    def get_info(self, model_id: str) -> dict:
        m = self.model(model_id)
        return {"type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": m.lora.rank,
                "model_name": m.base_model, "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": self._arch(), "model_name": m.base_model, "tokenizer_id": self.tokenizer_dir}}

    def _arch(self) -> str:
        import json

        cfg = json.loads((Path(self.model_dir) / "config.json").read_text())
        return str((cfg.get("architectures") or [cfg.get("model_type", "")])[0])

    def _ready(self, m: Model) -> TrainingModel:
        if m.model is None:
            raise UserFailure(f"model {m.model_id} failed to start; create a new training client")
        return m.model

    def check_data(self, data: list[Datum], loss_inputs: tuple[str, ...], optional: tuple[str, ...]) -> None:
        """Shapes, ranges and sizes of a forward_backward request's datums (400 naming the datum and input)."""
        if not data:
            raise TinkerError(400, "forward_backward: no data")
        if len(data) > self.limits.max_datums:
            raise TinkerError(400, f"forward_backward: {len(data)} datums; the limit is {self.limits.max_datums} per request")
        total = sum(len(d.tokens) for d in data)
        if total > self.limits.max_batch_tokens:
            raise TinkerError(400, f"forward_backward: {total} tokens in one request; the limit is {self.limits.max_batch_tokens} "
                                   "(send fewer datums per call)")
        V = self.vocab_size()
        for i, d in enumerate(data):
            n = len(d.tokens)
            if n == 0:
                raise TinkerError(400, f"datum {i}: empty model_input")
            if n > self.max_model_len:
                raise TinkerError(400, f"datum {i}: {n} tokens; the model takes at most {self.max_model_len}")
            if d.tokens.min() < 0 or d.tokens.max() >= V:
                raise TinkerError(400, f"datum {i}: model_input token ids must be in [0, {V})")
            need = set(loss_inputs) - set(optional)
            missing = need - set(d.inputs)
            extra = set(d.inputs) - set(loss_inputs)
            if missing:
                raise TinkerError(400, f"datum {i}: loss_fn_inputs lacks {sorted(missing)} (this loss reads {list(loss_inputs)})")
            if extra:
                raise TinkerError(400, f"datum {i}: loss_fn_inputs {sorted(extra)} are not read by this loss (it reads {list(loss_inputs)})")
            for k, v in d.inputs.items():
                if v.shape != (n,):
                    raise TinkerError(400, f"datum {i}: loss_fn_inputs[{k!r}] has shape {list(v.shape)}; expected [{n}] "
                                           "(one value per model_input token)")
                if k == "target_tokens" and (v.min() < 0 or v.max() >= V):
                    raise TinkerError(400, f"datum {i}: target_tokens must be in [0, {V})")
                if k != "target_tokens" and not __import__("numpy").isfinite(v).all():
                    raise TinkerError(400, f"datum {i}: loss_fn_inputs[{k!r}] holds a non-finite value")

    def forward_backward(self, model_id: str, data: list[Datum], loss_fn: str, config: dict, forward_only: bool) -> Future:
        from rl.tinker.wire import encode_forward_backward_output

        m = self.model(model_id)
        f = self._future(m.session_id, proto=True)

        def run() -> bytes:
            outputs, metrics = self._ready(m).forward_backward(data, loss_fn, config, forward_only)
            return encode_forward_backward_output(outputs, metrics)

        self._enqueue(m, f, run)
        return f

    def optim_step(self, model_id: str, step: AdamStep) -> Future:
        m = self.model(model_id)
        f = self._future(m.session_id)
        self._enqueue(m, f, lambda: {"metrics": self._ready(m).optim_step(step)})
        return f

    def _path(self, m: Model, kind: str, name: str | None) -> str:
        if name is None:
            name = self._token("auto-")
        if not _NAME_RE.match(name):
            raise TinkerError(400, f"checkpoint name {name!r}: use 1-128 characters from A-Z a-z 0-9 . _ - (no '/')")
        return f"tinker://{m.model_id}/{kind}/{name}"

    def _state_dir(self, path: str) -> Path:
        model_id, _, name = path[len("tinker://"):].split("/")
        return self.state_dir / model_id.replace(":", "_") / name

    def save_state(self, model_id: str, name: str | None, overwrite: bool) -> Future:
        m = self.model(model_id)
        path = self._path(m, "weights", name)
        out = self._state_dir(path)
        if out.exists() and not overwrite:
            raise TinkerError(409, f"checkpoint {path} exists; pass overwrite=True to replace it")
        f = self._future(m.session_id)

        def run() -> dict:
            self._ready(m).save_state(out)
            return {"path": path, "type": "save_weights"}

        self._enqueue(m, f, run)
        return f

    def _owned_path(self, session_id: str, path: str, kind: str) -> tuple[Model | None, str]:
        """(the model that wrote `path`, its model id) if it is this session's; 404 otherwise."""
        if not isinstance(path, str) or not path.startswith("tinker://") or path.count("/") != 4:
            raise TinkerError(400, f"path {path!r} is not a tinker://MODEL_ID/{kind}/NAME path")
        model_id, seg, name = path[len("tinker://"):].split("/")
        if seg != kind or not _NAME_RE.match(name):
            raise TinkerError(400, f"path {path!r} is not a tinker://MODEL_ID/{kind}/NAME path")
        if model_id.split(":train:")[0] != session_id:
            raise TinkerError(404, f"no checkpoint {path} in this session")
        return self.models.get(model_id), model_id

    def load_state(self, model_id: str, path: str, optimizer: bool) -> Future:
        m = self.model(model_id)
        _, owner_id = self._owned_path(m.session_id, path, "weights")
        ckpt = self._state_dir(path)
        if not ckpt.is_dir():
            raise TinkerError(404, f"no checkpoint {path} in this session")
        owner = self.models.get(owner_id)
        if owner is not None and (owner.lora.rank, owner.lora.train_attn, owner.lora.train_mlp) != \
                (m.lora.rank, m.lora.train_attn, m.lora.train_mlp):
            raise TinkerError(400, f"checkpoint {path} has another LoRA configuration than model {model_id}")
        f = self._future(m.session_id)

        def run() -> dict:
            self._ready(m).load_state(ckpt, optimizer)
            return {"path": path, "model_id": model_id, "type": "load_weights"}

        self._enqueue(m, f, run)
        return f

    def save_for_sampler(self, model_id: str, name: str | None) -> Future:
        """A snapshot of the model's merged weights; with `name` a tinker:// path to sample from, without one a
        sampling session on it (the SDK's save_weights_and_get_sampling_client)."""
        m = self.model(model_id)
        path = self._path(m, "sampler_weights", name)
        f = self._future(m.session_id)

        def run() -> dict:
            buckets = self._ready(m).sampler_snapshot()
            with self._lock:
                m.snapshots[path] = buckets
                while len(m.snapshots) > self.limits.max_snapshots:
                    m.snapshots.popitem(last=False)
            if name is not None:
                return {"path": path, "type": "save_weights_for_sampler"}
            s = self._new_sampler(m.session_id, m.base_model, path, buckets)
            return {"sampling_session_id": s.sampling_session_id, "type": "save_weights_for_sampler"}

        self._enqueue(m, f, run)
        return f

    # ------------------------------------------------------------------ sampling
    def _new_sampler(self, session_id: str, base_model: str, path: str | None, buckets: list | None) -> SamplingSession:
        s = SamplingSession(self._token("sampler-"), session_id, base_model, path, path or "base", buckets)
        with self._lock:
            mine = [k for k, v in self.samplers.items() if v.session_id == session_id]  # dicts keep insertion order
            for k in mine[: max(0, len(mine) + 1 - self.limits.max_samplers_per_session)]:
                del self.samplers[k]
            self.samplers[s.sampling_session_id] = s
        return s

    def create_sampling_session(self, session_id: str, model_path: str | None, base_model: str | None) -> str:
        self.session(session_id)
        if model_path is None:
            if base_model not in (self.served_name, self.model_dir):
                raise TinkerError(400, f"base_model {base_model!r} is not served here; this service samples {self.served_name!r}")
            return self._new_sampler(session_id, self.served_name, None, None).sampling_session_id
        owner, _ = self._owned_path(session_id, model_path, "sampler_weights")
        buckets = owner.snapshots.get(model_path) if owner is not None else None
        if buckets is None:
            raise TinkerError(404, f"no sampler weights {model_path} in this session (unknown, or dropped: a model keeps its "
                                   f"last {self.limits.max_snapshots} snapshots)")
        return self._new_sampler(session_id, owner.base_model, model_path, buckets).sampling_session_id

    def sampler(self, sampling_session_id: str) -> SamplingSession:
        s = self.samplers.get(sampling_session_id)
        if s is None:
            raise TinkerError(404, f"unknown sampling session {sampling_session_id!r}")
        return s

    def engine(self) -> SamplerEngine:
        with self._sampler_lock:
            if self._sampler is None:
                if self._engine_factory is None:
                    raise UserFailure("this service was started without a sampling engine (--no-sampling)")
                self._sampler = SamplerEngine(self._engine_factory(), self.model_dir)
            return self._sampler

    def sample(self, s: SamplingSession, run: Callable[[Any], Any]) -> Future:
        if not self._sample_slots.acquire(blocking=False):
            raise TinkerError(429, f"{self.limits.queue_depth} sampling requests already queued; retry later")
        f = self._future(s.session_id, proto=True)

        def job() -> None:
            try:
                self._finish(f, lambda: self.engine().run(s.key, s.buckets, run))
            finally:
                self._sample_slots.release()

        self._sample_pool.submit(job)
        return f

    def shutdown(self) -> None:
        for m in list(self.models.values()):
            self._close(m)
        self._sample_pool.shutdown(wait=False, cancel_futures=True)
        if self._sampler is not None:
            self._sampler.shutdown()
