"""The serving engine: `RolloutEngine` plus incremental outputs per request and abort.

What it does
- `StreamingEngine` is built exactly like the rollout engine (it subclasses
  `rl.rollout.engine.RolloutEngine`, so the vLLM arguments, thinking budgets, seeds and weight
  updates are the same code) and keeps its `submit` / `generate` / `score` API.
- `open_streams([(id, request), ...], deliver)` adds requests whose outputs come back after every engine step
  (vLLM `RequestOutputKind.DELTA`): each step's new token ids and their logprobs, then a last delta
  carrying the finish reason. `deliver` is called on the stepper thread, once per step, with every
  delta of that step.
- `abort(ids)` removes requests from the engine (vLLM `abort_request`, which frees their KV blocks)
  before its next step; no delta is delivered for them afterwards. It never waits for a step.
- `ServeRequest`: a `GenerateRequest` plus `top_logprobs` (the alternatives per token come back on the
  deltas) and vLLM structured outputs (`choice`, `json_object`, `json_schema`) for forced tool calls.
- `load()`: the scheduler's running / waiting request counts and KV-cache usage (for /health,
  /metrics and the disconnect test).

What it does not do
- No chat format, no asyncio: the service (`rl.serve.service`) maps deltas onto its event loop.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rl.rollout.engine import EngineError, GenerateRequest, RolloutEngine
from rl.rollout.multimodal import engine_prompt


@dataclass(frozen=True)
class ServeRequest(GenerateRequest):
    """A `GenerateRequest` with what serving adds: alternatives per token, and vLLM structured outputs
    (tool_choice: `choice`, the generation is exactly one of these strings; `json_object`, a JSON object;
    `json_schema`, an instance of that schema: a strict tool's arguments)."""

    top_logprobs: int = 0
    choice: tuple[str, ...] = ()
    json_object: bool = False
    json_schema: str | None = None  # a JSON schema (as JSON text): the generation is an instance of it


TopLogprobs = tuple[tuple[int, float], ...]  # (token id, logprob) of one position, most likely first


@dataclass(frozen=True)
class StreamDelta:
    """New tokens of one request after one engine step; `finish_reason` is set on its last delta."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None = None  # stop / length / abort
    policy_version: int = 0
    error: str | None = None  # the engine failed or shut down; no more deltas follow
    top: tuple[TopLogprobs, ...] = ()  # per token, when the request asked for alternatives


@dataclass(frozen=True)
class EngineLoad:
    running: int  # requests the scheduler is running (holding KV blocks)
    waiting: int  # requests admitted to the engine but not scheduled yet
    kv_cache_usage: float  # fraction of KV blocks in use


Deliver = Callable[[list[StreamDelta]], None]


class StreamingEngine(RolloutEngine):
    """An in-process vLLM engine whose requests can stream their tokens and be aborted."""

    def __init__(self, config: Any) -> None:
        # Set before the parent starts the stepper thread, which runs this class's _step_loop.
        self._streams: dict[str, Deliver] = {}
        self._aborts: list[str] = []
        self._abort_lock = threading.Lock()
        self._want_top: set[str] = set()  # requests that asked for alternatives per token
        super().__init__(config)

    # -- streaming requests
    def open_streams(self, requests: Sequence[tuple[str, GenerateRequest]], deliver: Deliver) -> None:
        """Add (id, request) pairs whose outputs stream to `deliver`. Raises EngineError (nothing added) on a bad request."""
        from vllm.sampling_params import RequestOutputKind

        if self._broken:
            raise EngineError(f"the engine is broken after a failed step: {self._broken}")
        params = [self._sampling_params(r) for _, r in requests]
        prompts = {rid: engine_prompt(r.prompt_token_ids, r.images, self.vision, self.config.max_images_per_prompt)
                   for rid, r in requests}
        with self._cv:  # the stepper holds this for a whole step: requests join at a step boundary
            if self._closed:
                raise EngineError("the engine was shut down")
            clash = [rid for rid, _ in requests if rid in self._streams or rid in self._pending]
            if clash:
                raise EngineError(f"request ids already in use: {clash[:4]}")
            for (rid, r), sp in zip(requests, params):
                sp.output_kind = RequestOutputKind.DELTA
                self.llm.llm_engine.add_request(rid, prompts[rid], sp)
                self._streams[rid] = deliver
                if getattr(r, "top_logprobs", 0):
                    self._want_top.add(rid)
            self._cv.notify_all()

    def _sampling_params(self, r: GenerateRequest) -> Any:
        sp = super()._sampling_params(r)
        if isinstance(r, ServeRequest):
            if r.top_logprobs:
                sp.logprobs = r.top_logprobs
            if r.choice or r.json_object or r.json_schema:
                from vllm.sampling_params import StructuredOutputsParams

                sp.structured_outputs = StructuredOutputsParams(choice=list(r.choice)) if r.choice else \
                    StructuredOutputsParams(json=r.json_schema) if r.json_schema else StructuredOutputsParams(json_object=True)
        return sp

    def abort(self, request_ids: Sequence[str]) -> None:
        """Stop these requests before the next engine step (returns at once; their KV blocks are freed then)."""
        with self._abort_lock:
            self._aborts.extend(request_ids)

    def load(self) -> EngineLoad:
        """Read without the engine lock: a snapshot that may be one step old."""
        sched = self.llm.llm_engine.engine_core.engine_core.scheduler
        return EngineLoad(running=len(sched.running), waiting=len(sched.waiting), kv_cache_usage=float(sched.get_kv_cache_usage()))

    # -- the stepper (replaces RolloutEngine's: it also serves the streams)
    def _apply_aborts(self) -> None:
        with self._abort_lock:
            ids, self._aborts = self._aborts, []
        ids = [i for i in ids if self._streams.pop(i, None) is not None]
        self._want_top.difference_update(ids)
        if ids:
            self.llm.llm_engine.abort_request(ids)

    def _fail_all(self, why: str) -> None:
        self._fail_pending(why)
        by_sink: dict[Deliver, list[StreamDelta]] = {}
        for rid, deliver in self._streams.items():
            by_sink.setdefault(deliver, []).append(StreamDelta(rid, (), (), "abort", self.policy_version, error=why))
        self._streams.clear()
        self._want_top.clear()
        for deliver, deltas in by_sink.items():
            deliver(deltas)

    def _delta(self, out: Any) -> StreamDelta:
        c = out.outputs[0]
        ids = tuple(int(t) for t in c.token_ids)
        lps: tuple[float, ...] = ()
        if ids:
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise EngineError(f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} logprob entries for {len(ids)} tokens")
            lps = tuple(float(step[t].logprob) for step, t in zip(c.logprobs, ids))
        top: tuple[TopLogprobs, ...] = ()
        if ids and out.request_id in self._want_top:  # alternatives were asked for (rank 1 = most likely)
            top = tuple(tuple((int(t), float(lp.logprob)) for t, lp in sorted(step.items(), key=lambda kv: kv[1].rank or 0)
                              if lp.rank is not None and lp.rank >= 1) for step in c.logprobs)
        finish = (c.finish_reason or "abort") if out.finished else None
        return StreamDelta(out.request_id, ids, lps, finish, self.policy_version, top=top)

    def _step_loop(self) -> None:
        """Continuous batching over both kinds of request: futures (submit) and streams (open_streams)."""
        self._apply_threads()
        while True:
            with self._cv:
                while not self._pending and not self._streams and not self._closed:
                    self._cv.wait()
                if self._closed:
                    self._fail_all("the engine was shut down")
                    return
                try:
                    self._apply_aborts()
                    if not self._pending and not self._streams:
                        continue
                    outs = self.llm.llm_engine.step()
                except BaseException as e:  # the engine is broken: fail everything waiting, loudly
                    import logging

                    logging.getLogger(__name__).exception("serving engine step failed")
                    self._broken = repr(e)
                    self._fail_all(f"engine step failed: {e!r}")
                    continue
                if not outs and not self.llm.llm_engine.has_unfinished_requests():
                    self._fail_all("request lost by the engine (no output and no unfinished requests)")
                    continue
                by_sink: dict[Deliver, list[StreamDelta]] = {}
                for out in outs:
                    deliver = self._streams.get(out.request_id)
                    if deliver is not None:
                        try:
                            d = self._delta(out)
                        except EngineError as e:
                            d = StreamDelta(out.request_id, (), (), "abort", self.policy_version, error=str(e))
                        if d.finish_reason is not None:
                            del self._streams[out.request_id]
                            self._want_top.discard(out.request_id)
                        by_sink.setdefault(deliver, []).append(d)
                        continue
                    self._resolve_finished(out)
            # Delivered outside the lock: the sinks only hand the deltas to an event loop.
            for deliver, deltas in by_sink.items():
                deliver(deltas)
