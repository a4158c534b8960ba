"""The chat service both protocols call: prompt building, streamed generation with abort, tool_choice forcing, recording, admission, metrics.

What it does
- `ChatService.prepare(req)`: render (through the `ChatCodec` seam), tokenise with token reuse,
  check the context room -> a `Prepared` request. Raises ApiError before anything reaches the engine.
- `ChatService.run(prepared)`: an async iterator of `TextDelta` events (reasoning / content pieces as
  the engine produces them) ending with one `Finished` event (the parsed choices). Closing the
  iterator early (the client went away) aborts the engine requests at once. Finished replies are
  recorded (`rl.serve.records`) and remembered for token reuse; aborted ones are not.
- Stop strings end generation as soon as they appear in the decoded text (the engine request is
  aborted; the reply and the recorded ids are cut as `finish_choice` does).
- `Admission`: at most `max_running` requests generate at once, at most `max_queue` wait; beyond
  that `acquire` raises 429 with `Retry-After`.
- `ServeMetrics`: Prometheus counters, gauges and histograms in the service's own registry.

What it does not do
- No wire formats (rl/serve/openai.py, rl/serve/anthropic.py) and no HTTP (rl/serve/app.py).
"""
from __future__ import annotations

import asyncio
import collections
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal, Protocol, Sequence

from rl.log import get_logger
from rl.serve.core import (DEFAULT_CODEC, ApiError, ChatCodec, ChatRequest, Choice, Completion, PromptTokens, ServeSettings,
                           TokenHistory, bad, encode_prompt, finish_choice, first_stop)
from rl.serve.records import Recorder, RecordedChoice, ServeRecord

log = get_logger("serve")


class EngineLike(Protocol):
    """What the service needs from `rl.serve.engine.StreamingEngine`."""

    policy_version: int

    def open_streams(self, requests: Sequence[Any], deliver: Any) -> list[str]: ...

    def abort(self, request_ids: Sequence[str]) -> None: ...


# ============================================================================ events
@dataclass(frozen=True)
class TextDelta:
    choice: int
    field: Literal["reasoning", "content"]
    text: str


@dataclass(frozen=True)
class Finished:
    choices: tuple[Choice, ...]


@dataclass(frozen=True)
class Prepared:
    id: str
    created: int
    req: ChatRequest
    prompt_text: str
    prompt: PromptTokens
    max_tokens: int

    @property
    def n_prompt(self) -> int:
        return len(self.prompt.token_ids)


# ============================================================================ admission
class Admission:
    """A bounded admission queue in front of the engine (event-loop only)."""

    def __init__(self, max_running: int, max_queue: int) -> None:
        self.max_running, self.max_queue = max_running, max_queue
        self.running = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, retry_after_s: float) -> None:
        if self.running < self.max_running and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.max_queue:
            raise ApiError(429, f"the server is at capacity ({self.running} requests running, {len(self._waiters)} queued, "
                                f"--max-queue {self.max_queue}); retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(max(1, round(retry_after_s)))})
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # release() hands its slot over: `running` is not decremented in between
        except BaseException:
            if fut in self._waiters:
                self._waiters.remove(fut)
            elif fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over just as the waiter was cancelled
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1


# ============================================================================ metrics
class ServeMetrics:
    """Prometheus metrics of one service, in their own registry (several services can live in one process)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("jointrl_serve_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.running = Gauge("jointrl_serve_requests_running", "requests generating now", registry=r)
        self.queue_depth = Gauge("jointrl_serve_queue_depth", "requests waiting for admission", registry=r)
        self.engine_running = Gauge("jointrl_serve_engine_running", "requests the engine scheduler is running", registry=r)
        self.kv_usage = Gauge("jointrl_serve_kv_cache_usage", "fraction of KV-cache blocks in use", registry=r)
        self.prompt_tokens = Counter("jointrl_serve_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("jointrl_serve_generated_tokens", "tokens generated", registry=r)
        self.tokens_per_s = Gauge("jointrl_serve_generated_tokens_per_second", "tokens generated per second over the last 10 s", registry=r)
        self.aborted = Counter("jointrl_serve_aborted", "requests aborted because the client went away", registry=r)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        self.latency = Histogram("jointrl_serve_request_latency_seconds", "request latency", ["route"], buckets=buckets, registry=r)
        self.ttft = Histogram("jointrl_serve_time_to_first_token_seconds", "time to the first generated token", ["route"],
                              buckets=buckets, registry=r)
        self._window: collections.deque[tuple[float, int]] = collections.deque()

    def count_tokens(self, n: int) -> None:
        self.generated_tokens.inc(n)
        now = time.monotonic()
        self._window.append((now, n))
        while self._window and self._window[0][0] < now - 10:
            self._window.popleft()

    def refresh(self) -> None:
        now = time.monotonic()
        while self._window and self._window[0][0] < now - 10:
            self._window.popleft()
        self.tokens_per_s.set(sum(n for _, n in self._window) / 10.0)


# ============================================================================ the service
@dataclass
class _ChoiceState:
    """One choice while it streams: its ids so far and what has been sent of each field."""

    index: int
    ids: list[int]
    logprobs: list[float | None]
    mask: list[int]
    sent_reasoning: str = ""
    sent_content: str = ""
    text: str = ""  # decoded ids[:decoded] (whole characters)
    decoded: int = 0

    def decode(self, tokenizer: Any) -> str:
        """The text of the ids so far, decoding only the new ones (byte-level BPE: a whole-character suffix
        decodes to the suffix of the whole); a character split across tokens waits for its last byte."""
        dec = getattr(tokenizer, "backend_tokenizer", None)
        new = (dec.decode if dec is not None else tokenizer.decode)(self.ids[self.decoded:], skip_special_tokens=False)
        if new.endswith("\ufffd"):
            return self.text + new.rstrip("\ufffd")
        self.text += new
        self.decoded = len(self.ids)
        return self.text


class ChatService:
    """Turns validated requests into engine streams and replies; owns token reuse, recording, admission and metrics."""

    def __init__(self, engine: EngineLike, tokenizer: Any, settings: ServeSettings, model_names: Sequence[str],
                 max_model_len: int, recorder: Recorder | None = None, codec: ChatCodec = DEFAULT_CODEC,
                 aliases: Sequence[str] = ()) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.listed_names = tuple(model_names)  # what /v1/models lists
        self.model_names = self.listed_names + tuple(a for a in aliases if a not in self.listed_names)  # what requests may name
        self.max_model_len = max_model_len
        self.recorder = recorder
        self.codec = codec
        self.history = TokenHistory(settings.token_cache_entries, codec.end_of_turn)
        self.admission = Admission(settings.max_running, settings.max_queue)
        self.metrics = ServeMetrics()
        self.created = int(time.time())
        self.requests = 0
        self.inflight = 0  # requests generating now
        self.peak_inflight = 0  # most requests generating at once: > 1 means they shared engine steps (batched)
        self._opens: list[tuple[str, Any, asyncio.Future]] = []  # event-loop only, like _routes
        self._opener: asyncio.Task | None = None
        self._routes: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._seq = 0
        self._recent_latency: collections.deque[float] = collections.deque(maxlen=64)

    def retry_after_s(self) -> float:
        """A client told to come back should wait about one typical request."""
        return sorted(self._recent_latency)[len(self._recent_latency) // 2] if self._recent_latency else 1.0

    # -- prompt
    def prepare(self, req: ChatRequest) -> Prepared:
        try:
            text = self.codec.render_prompt(req.messages, req.tools)
        except (ValueError, TypeError) as e:
            raise bad(f"messages cannot be rendered in the chat format: {e}", "messages") from None
        prompt = encode_prompt(text, self.tokenizer, self.history)
        n_prompt = len(prompt.token_ids)
        room = self.max_model_len - n_prompt
        if room < 1:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens; the messages take {n_prompt} "
                                "tokens, which leaves no room for a reply. Shorten the messages.", param="messages",
                           code="context_length_exceeded")
        # max_tokens larger than the room left is clamped (finish_reason "length" says when it bit).
        cap = room if self.settings.max_tokens_limit is None else min(room, self.settings.max_tokens_limit)
        max_tokens = cap if req.max_tokens is None else min(req.max_tokens, room)
        prefix = "msg_" if req.protocol == "anthropic" else "chatcmpl-"
        return Prepared(f"{prefix}{uuid.uuid4().hex[:24]}", int(time.time()), req, text, prompt, max_tokens)

    def count_tokens(self, req: ChatRequest) -> int:
        return self.prepare(req).n_prompt

    # -- engine streams
    def _deliver(self, deltas: list[Any]) -> None:
        """Called on the engine's stepper thread once per step: hand the step's deltas to the event loop."""
        self._loop.call_soon_threadsafe(self._route, deltas)

    def _route(self, deltas: list[Any]) -> None:
        for d in deltas:
            q = self._routes.get(d.request_id)
            if q is not None:
                q.put_nowait(d)
                if d.finish_reason is not None:
                    del self._routes[d.request_id]

    async def _open(self, rid: str, gen: Any) -> asyncio.Queue:
        """Start one engine stream; its deltas arrive on the returned queue.

        Adding a request takes the engine's lock, which its stepper holds for a whole step. Streams
        opened while an add is waiting are added together in the next one (one lock acquisition per
        step, not per HTTP request), off the event loop.
        """
        loop = asyncio.get_running_loop()
        self._loop = loop
        q: asyncio.Queue = asyncio.Queue()
        self._routes[rid] = q  # before the engine can produce anything for it
        fut: asyncio.Future = loop.create_future()
        self._opens.append((rid, gen, fut))
        if self._opener is None or self._opener.done():
            self._opener = loop.create_task(self._open_pending())
        try:
            await fut
        except BaseException:
            self._routes.pop(rid, None)
            raise
        return q

    async def _open_pending(self) -> None:
        while self._opens:
            batch, self._opens = self._opens, []
            try:
                await asyncio.to_thread(self.engine.open_streams, [(rid, g) for rid, g, _ in batch], self._deliver)
                results: list[BaseException | None] = [None] * len(batch)
            except Exception:  # noqa: BLE001 - one bad request must not fail the others: add them one by one
                results = []
                for rid, g, _ in batch:
                    try:
                        await asyncio.to_thread(self.engine.open_streams, [(rid, g)], self._deliver)
                        results.append(None)
                    except Exception as e:  # noqa: BLE001 - reported to its own request
                        results.append(e)
            for (rid, _, f), err in zip(batch, results):
                if f.done():  # cancelled while being added: stop it again
                    if err is None:
                        self.engine.abort([rid])
                elif err is not None:
                    f.set_exception(err)
                else:
                    f.set_result(None)

    async def _phase(self, gen: Any, st: _ChoiceState, prep: Prepared, sampled: bool,
                     out: asyncio.Queue, t0: float, first: list[float]) -> tuple[str, int, str | None]:
        """Run one engine request to its end, appending to `st`; returns (finish, policy version, stop string)."""
        self._seq += 1
        rid = f"{prep.id}-{st.index}-{self._seq}"
        q = await self._open(rid, gen)
        done = False
        try:
            while True:
                deltas = [await q.get()]
                while not q.empty():
                    deltas.append(q.get_nowait())
                for d in deltas:
                    if d.error:
                        done = True
                        raise ApiError(500, f"generation failed: {d.error}", type="server_error")
                    if d.token_ids:
                        if not first:
                            first.append(time.perf_counter() - t0)
                        st.ids += d.token_ids
                        st.logprobs += d.logprobs if sampled else [None] * len(d.token_ids)
                        st.mask += [1 if sampled else 0] * len(d.token_ids)
                        self.metrics.count_tokens(len(d.token_ids))
                    if d.finish_reason is not None:
                        done = True
                # A plain reply without stop strings needs no text until the end (finish_choice decodes it).
                stop = self._emit(st, prep, out) if (prep.req.stream or prep.req.stop) else None
                if stop is not None:
                    return "stop", deltas[-1].policy_version, stop
                if done:
                    return deltas[-1].finish_reason or "abort", deltas[-1].policy_version, None
        finally:
            if not done:
                self.engine.abort([rid])

    def _emit(self, st: _ChoiceState, prep: Prepared, out: asyncio.Queue) -> str | None:
        """Queue the newly final part of the reasoning / content fields; returns a stop string once one appears."""
        text = st.decode(self.tokenizer)
        stop = first_stop(text, prep.req.stop)
        if stop is not None:
            text = text[: stop[0]]
        f = self.codec.stream_fields(text, prep.req.stop if stop is None else ())
        _send(st, out, f.reasoning, f.content)
        return None if stop is None else stop[2]

    async def _choice(self, st: _ChoiceState, prep: Prepared, out: asyncio.Queue, t0: float, first: list[float]) -> Completion:
        from rl.rollout.engine import GenerateRequest

        req, codec = prep.req, self.codec
        mode = req.tool_choice.mode
        stops = codec.stop_token_ids
        if mode in ("required", "function"):
            stops = stops + (codec.think_end_id,)  # stop when thinking ends, then force the call
        elif mode == "none":
            stops = stops + (codec.tool_call_start_id,)

        def seed(phase: int) -> int | None:
            return None if req.seed is None else req.seed + 1000 * phase + st.index

        prompt = prep.prompt.token_ids
        finish, version, stop = await self._phase(
            GenerateRequest(prompt_token_ids=prompt, max_tokens=prep.max_tokens, temperature=req.temperature, top_p=req.top_p,
                            stop_token_ids=stops, thinking_budget=req.thinking_budget, seed=seed(0)), st, prep, True, out, t0, first)
        if mode in ("required", "function") and stop is None and finish == "stop" and st.ids and st.ids[-1] == codec.think_end_id:
            forced = tuple(self.tokenizer.encode(codec.forced_call_prefix(req.tool_choice.name), add_special_tokens=False))
            room = prep.max_tokens - len(st.ids) - len(forced)
            if room > 0:
                st.ids += forced
                st.logprobs += [None] * len(forced)
                st.mask += [0] * len(forced)
                finish, version, stop = await self._phase(
                    GenerateRequest(prompt_token_ids=prompt + tuple(st.ids), max_tokens=room, temperature=req.temperature,
                                    top_p=req.top_p, stop_token_ids=codec.stop_token_ids, thinking_budget=None, seed=seed(1)),
                    st, prep, True, out, t0, first)
        return Completion(tuple(st.ids), tuple(st.logprobs), tuple(st.mask), finish, version, stop)

    async def run(self, prep: Prepared, route: str = "") -> AsyncIterator[TextDelta | Finished]:
        """Stream one request's reply. Leaving the iteration early aborts its engine requests."""
        req = prep.req
        out: asyncio.Queue = asyncio.Queue()
        t0 = time.perf_counter()
        first: list[float] = []
        self.metrics.prompt_tokens.inc(prep.n_prompt)
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        self.metrics.running.set(self.inflight)
        states = [_ChoiceState(i, [], [], []) for i in range(req.n)]
        tasks = [asyncio.ensure_future(self._choice(st, prep, out, t0, first)) for st in states]
        for t in tasks:  # a choice's end (or error) arrives on the same queue as its text
            t.add_done_callback(out.put_nowait)
        finished = False
        try:
            remaining = len(tasks)
            while remaining:
                batch = [await out.get()]
                while not out.empty():
                    batch.append(out.get_nowait())
                for ev in _merge(batch):
                    if isinstance(ev, asyncio.Future):
                        remaining -= 1
                        ev.result()  # raises the choice's error
                    else:
                        yield ev
            comps = [t.result() for t in tasks]
            turn = sum(1 for m in req.messages if m.role == "assistant")
            choices = tuple(finish_choice(i, c, self.tokenizer, req, turn, self.codec) for i, c in enumerate(comps))
            for c, st in zip(choices, states):  # the rest of each field (held-back whitespace, etc.)
                _send(st, out, c.message.reasoning or "", c.message.content)
            while not out.empty():
                yield out.get_nowait()
            self._finish(prep, choices)
            if first:
                self.metrics.ttft.labels(route).observe(first[0])
            latency = time.perf_counter() - t0
            self.metrics.latency.labels(route).observe(latency)
            self._recent_latency.append(latency)
            finished = True
            yield Finished(choices)
        finally:
            # No awaiting here: when the client went away this runs inside a cancelled scope. A cancelled
            # choice aborts its engine request from its own finally (_phase) on the next loop iteration.
            self.inflight -= 1
            self.metrics.running.set(self.inflight)
            if not finished:
                self.metrics.aborted.inc()
            for t in tasks:
                if not t.done():
                    t.cancel()
                t.add_done_callback(_retrieve)

    def _finish(self, prep: Prepared, choices: Sequence[Choice]) -> None:
        for c in choices:
            # Remember only completions the client can send back verbatim: the re-rendered message must be
            # the generated text, else the next prompt would not extend these ids.
            ids = c.completion.token_ids
            if ids and ids[-1] == self.codec.end_of_turn_id and not c.parse_errors:
                if self.codec.render_completion(c.message) == c.text:
                    self.history.remember(prep.prompt_text + c.text, prep.prompt.token_ids + ids, (prep.id, c.index))
        self.requests += 1
        if self.recorder is not None:
            self.recorder.write(self.record(prep, choices))

    def record(self, prep: Prepared, choices: Sequence[Choice]) -> ServeRecord:
        from rl.serve.openai import message_json

        req = prep.req
        request = {
            "protocol": req.protocol,
            "messages": list(req.raw_messages),
            "system": req.raw_system,
            "tools": list(req.tools) if req.tools else None,
            "tool_choice": req.tool_choice.mode if req.tool_choice.mode != "function" else {"type": "function", "function": {"name": req.tool_choice.name}},
            "thinking_tier": req.tier, "thinking_budget_tokens": req.thinking_budget,
            "max_tokens": req.max_tokens, "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
            "stop": list(req.stop), "n": req.n, "user": req.user, "metadata": dict(req.metadata) if req.metadata else None,
        }
        return ServeRecord(
            id=prep.id, created=time.time(), model=req.model,
            policy_version=max((c.completion.policy_version for c in choices), default=0),
            request=request, prompt_token_ids=prep.prompt.token_ids, prompt_reused_tokens=prep.prompt.reused, continues=prep.prompt.continues,
            choices=tuple(
                RecordedChoice(index=c.index, completion_token_ids=c.completion.token_ids, logprobs=c.completion.logprobs,
                               loss_mask=c.completion.loss_mask, finish_reason=c.finish_reason, text=c.text,
                               message=message_json(c.message), parse_errors=c.parse_errors)
                for c in choices
            ),
        )

    async def complete(self, prep: Prepared, route: str = "") -> tuple[Choice, ...]:
        """The whole reply (no deltas)."""
        agen = self.run(prep, route)
        try:
            async for ev in agen:
                if isinstance(ev, Finished):
                    return ev.choices
        finally:
            await agen.aclose()
        raise ApiError(500, "generation ended without a reply", type="server_error")

    def models_json(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": n, "object": "model", "created": self.created, "owned_by": "jointrl",
                                            "max_model_len": self.max_model_len} for n in self.listed_names]}


def _merge(events: list[Any]) -> list[Any]:
    """Join consecutive text pieces of the same choice and field (fewer, larger stream chunks under load)."""
    out: list[Any] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, TextDelta) and isinstance(last, TextDelta) and (last.choice, last.field) == (ev.choice, ev.field):
            out[-1] = TextDelta(ev.choice, ev.field, last.text + ev.text)
        else:
            out.append(ev)
    return out


def _retrieve(t: asyncio.Task) -> None:
    """Consume a finished choice task's exception (it was reported through the stream, or nobody is listening)."""
    if not t.cancelled():
        t.exception()


def _send(st: _ChoiceState, out: asyncio.Queue, reasoning: str, content: str) -> None:
    """Queue what extends the fields already sent. A field that no longer extends what was sent (the
    parser changed its mind at the end, e.g. a malformed tool call) cannot be retracted in a stream:
    it is left as sent, and the finished message says what the reply is."""
    if len(reasoning) > len(st.sent_reasoning) and reasoning.startswith(st.sent_reasoning):
        out.put_nowait(TextDelta(st.index, "reasoning", reasoning[len(st.sent_reasoning):]))
        st.sent_reasoning = reasoning
    if len(content) > len(st.sent_content) and content.startswith(st.sent_content):
        out.put_nowait(TextDelta(st.index, "content", content[len(st.sent_content):]))
        st.sent_content = content
