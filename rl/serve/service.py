"""The chat service both protocols call: prompt building, streamed generation with abort, tool_choice forcing, recording.

What it does
- `ChatService.prepare(req)`: the prompt ids of the checkpoint's chat codec (`rl.serve.codec.ServeCodec`:
  its template's rendering, token-exact), with token reuse; the context room; the generation caps
  -> a `Prepared` request. Raises ApiError before anything reaches the engine.
- Thinking tiers: with a format that has a thinking block (single-token markers) the tier's budget
  is vLLM's thinking budget; without one it caps the reply's tokens instead, as in training
  (rl/rollout/agent_loop.py), and a zero budget (thinking disabled) caps nothing.
- `ChatService.run(prepared)`: an async iterator of `TextDelta` events (reasoning / content pieces as
  the engine produces them) ending with one `Finished` event (the parsed choices). Closing the
  iterator early (the client went away) aborts the engine requests at once. Finished replies are
  recorded (`rl.serve.records`) and remembered for token reuse; aborted ones are not.
- tool_choice required / named: the call is written under vLLM's structured outputs (the name a choice
  over the request's tools, the arguments a JSON object, an instance of the tool's schema when it is `strict`),
  the server closing it; replies name only the
  request's tools (`finish_choice` drops others).
- Every message and tool schema is defused (`ServeCodec.defuse_message` / `defuse_tool`) before rendering,
  whichever route it came from; a request without a budget keeps half its reply for the answer.
- Stop strings end generation as soon as they appear in the decoded text (the engine request is
  aborted; the reply and the recorded ids are cut as `finish_choice` does).
- Admission and metrics: the service holds an `Admission` queue and `ServeMetrics` (rl/serve/capacity.py) and
  counts into them.

What it does not do
- No wire formats (rl/serve/openai.py, rl/serve/anthropic.py) and no HTTP (rl/serve/app.py).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Literal, Protocol, Sequence

from rl.log import get_logger
from rl.serve.capacity import Admission, ServeMetrics  # noqa: F401  (re-exported)
from rl.serve.codec import ServeCodec
from rl.serve.core import (ApiError, ChatRequest, Choice, Completion, PromptTokens, ServeSettings, TokenHistory, bad, encode_prompt,
                           engine_seed, finish_choice, first_stop)
from rl.serve.records import RecordedChoice, RecordedImage, Recorder, ServeRecord, message_json
from rl.types import TokenImage

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
    rendered: tuple[int, ...]  # the codec's prompt ids (the template's rendering)
    prompt: PromptTokens  # what the engine sees: `rendered` with a remembered head swapped for sampled ids
    max_tokens: int  # the reply's cap: the request's, the context room, and (no thinking block) the tier's budget
    thinking_budget: int | None  # vLLM thinking budget; None: no cap, or a format without a thinking block
    watch: tuple[str, ...] = ()  # text that ends generation besides the request's stop strings (tool_choice none)
    images: tuple[TokenImage, ...] = ()  # the request's images with the prompt spans they feed

    @property
    def n_prompt(self) -> int:
        return len(self.prompt.token_ids)


# ============================================================================ the service
@dataclass
class _ChoiceState:
    """One choice while it streams: its ids so far and what has been sent of each field."""

    index: int
    ids: list[int]
    logprobs: list[float | None]
    mask: list[int]
    top: list[tuple[tuple[int, float], ...]] = dataclasses.field(default_factory=list)  # per token, when alternatives were asked for
    sent_reasoning: str = ""
    sent_content: str = ""
    text: str = ""  # decoded ids[:decoded] (whole characters)
    decoded: int = 0

    def append(self, ids: Sequence[int], logprobs: Sequence[float | None], mask: int, top: Sequence[Any] = ()) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.mask += [mask] * len(ids)
        self.top += list(top) if top else [()] * len(ids)

    def drop_last(self) -> None:
        """Remove the last token (a structured phase's forced end of text); the decoded text is rebuilt."""
        for seq in (self.ids, self.logprobs, self.mask, self.top):
            seq.pop()
        self.text, self.decoded = "", 0

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

    def __init__(self, engine: EngineLike, codec: ServeCodec, settings: ServeSettings, model_names: Sequence[str],
                 max_model_len: int, recorder: Recorder | None = None, aliases: Sequence[str] = ()) -> None:
        self.engine = engine
        self.codec = codec
        self.tokenizer = codec.tokenizer
        self.settings = settings
        self.listed_names = tuple(model_names)  # what /v1/models lists
        self.model_names = self.listed_names + tuple(a for a in aliases if a not in self.listed_names)  # what requests may name
        self.max_model_len = max_model_len
        self.recorder = recorder
        self.history = TokenHistory(settings.token_cache_entries, (codec.end_token_id,))
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
        codec = self.codec
        for t in req.tools or ():
            name = t["function"]["name"]
            if codec.defuse(name) != name:
                raise bad(f"tool name {name[:80]!r} contains a structure string of the served model's chat format", "tools")
        # Every route's client text (system, user, tool, assistant history, tool schemas) with the format's
        # structure strings broken, here where all routes meet (the protocol parsers defuse too; it is idempotent).
        req = replace(req, messages=tuple(codec.defuse_message(m) for m in req.messages),
                      tools=tuple(codec.defuse_tool(t) for t in req.tools) if req.tools else req.tools)
        mode = req.tool_choice.mode
        if mode in ("required", "function") and codec.forced_call_prefix(req.tool_choice.name, False) is None:
            raise bad(f"tool_choice {mode if mode == 'required' else 'naming a function'} needs a tool-call opening the server can "
                      f"write for the model, and this server's chat format ({codec.describe()}) has none it knows "
                      "(the project format, or Hermes <tool_call> with the hermes parser); use tool_choice auto", "tool_choice",
                      "tool_choice_unsupported")
        try:
            rendered = tuple(codec.prompt_ids(req.messages, req.tools))
        except Exception as e:  # noqa: BLE001 - a template's own refusal (jinja raise_exception, bad roles): the request's fault
            raise bad(f"messages cannot be rendered in the served model's chat format ({codec.describe()}): "
                      f"{type(e).__name__}: {e}", "messages") from None
        rendered, images = self._place_images(req, rendered)
        # Token reuse swaps a remembered head of the prompt for sampled ids, which may differ in length and
        # would move the image spans: requests with images are encoded as rendered.
        prompt = encode_prompt(rendered, None if images else self.history)
        n_prompt = len(prompt.token_ids)
        room = self.max_model_len - n_prompt
        if room < 1:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens; the messages take {n_prompt} "
                                "tokens, which leaves no room for a reply. Shorten the messages.", param="messages",
                           code="context_length_exceeded")
        # max_tokens larger than the room left is clamped (finish_reason "length" says when it bit).
        cap = room if self.settings.max_tokens_limit is None else min(room, self.settings.max_tokens_limit)
        max_tokens = cap if req.max_tokens is None else min(req.max_tokens, room)
        budget = req.thinking_budget
        if codec.reasoning_markers is None:
            # No thinking block to budget: a tier the request names caps the whole reply (training does the
            # same, rl/rollout/agent_loop.py); a zero budget means "no thinking", which such a model never does,
            # and a request that names none is not capped (the tier would only truncate its answer).
            if budget and not req.default_budget:
                max_tokens = min(max_tokens, budget)
            budget = None
        elif req.default_budget and max_tokens > 1:
            # A request that names no budget keeps room for its answer: thinking takes at most half the reply.
            budget = max_tokens // 2 if budget is None else min(budget, max_tokens // 2)
        if budget is not None and budget >= max_tokens:
            budget = None  # a budget the reply cannot reach caps nothing (and the engine never sees a huge number)
        cut = codec.refused_call_marker(mode, bool(req.tools))
        watch = (cut,) if cut is not None and codec.tool_call_start_id is None else ()
        prefix = {"anthropic": "msg_", "responses": "resp_"}.get(req.protocol, "chatcmpl-")
        return Prepared(f"{prefix}{uuid.uuid4().hex[:24]}", int(time.time()), req, rendered, prompt, max_tokens, budget, watch,
                        images)

    def _place_images(self, req: ChatRequest, rendered: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[TokenImage, ...]]:
        """The prompt with each image's placeholder expanded to its patches, and the images' spans (the
        protocol parsers have checked every image against the model's contract already)."""
        data = [d for m in req.messages for d in m.images]
        if not data:
            return rendered, ()
        codec = self.codec
        if len(data) > codec.max_images:
            raise bad(f"the request carries {len(data)} images; this server accepts at most {codec.max_images} (--max-images)",
                      "messages", "too_many_images")
        from model.vision import ImageError, expand_placeholders, open_image

        try:
            ids, spans = expand_placeholders(rendered, [codec.vision.num_patches(*open_image(d).size) for d in data],
                                             codec.vision.image_token_id)
        except ImageError as e:
            raise bad(f"messages: {e}", "messages", "invalid_image") from None
        return tuple(ids), tuple(TokenImage(d, s.start, s.length) for d, s in zip(data, spans))

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
                        if sampled:
                            st.append(d.token_ids, d.logprobs, 1, d.top)
                        else:
                            st.append(d.token_ids, [None] * len(d.token_ids), 0)
                        self.metrics.count_tokens(len(d.token_ids))
                    if d.finish_reason is not None:
                        done = True
                # A plain reply without stop strings needs no text until the end (finish_choice decodes it).
                stop = self._emit(st, prep, out) if (prep.req.stream or prep.req.stop or prep.watch) else None
                if stop is not None:
                    return "stop", deltas[-1].policy_version, stop
                if done:
                    return deltas[-1].finish_reason or "abort", deltas[-1].policy_version, None
        finally:
            if not done:
                self.engine.abort([rid])

    def _emit(self, st: _ChoiceState, prep: Prepared, out: asyncio.Queue) -> str | None:
        """Queue the newly final part of the reasoning / content fields; returns a stop string (or a watched
        marker) once one appears."""
        text = st.decode(self.tokenizer)
        ends = prep.req.stop + prep.watch
        stop = first_stop(text, ends)
        if stop is not None:
            text = text[: stop[0]]
        req = prep.req
        f = self.codec.stream_fields(text, ends if stop is None else (), bool(req.tools) and req.tool_choice.mode != "none")
        _send(st, out, f.reasoning, f.content)
        return None if stop is None else stop[2]

    async def _choice(self, st: _ChoiceState, prep: Prepared, out: asyncio.Queue, t0: float, first: list[float]) -> Completion:
        """One choice: generate; for tool_choice required / named, write the call's opening (mask 0) once
        thinking ends (at once for a format without a thinking block), then the call itself under vLLM's
        structured outputs: the name one of the request's tools (a `choice` over them; written by the
        server when only one can be meant), the arguments a JSON object; the server closes the call."""
        from rl.serve.engine import ServeRequest

        req, codec = prep.req, self.codec
        force = req.tool_choice.mode in ("required", "function")
        think_first = codec.reasoning_end_id is not None
        stops = codec.stop_token_ids
        if force and think_first:
            stops = stops + (codec.reasoning_end_id,)  # stop when thinking ends, then force the call
        cut = codec.refused_call_marker(req.tool_choice.mode, bool(req.tools))
        if cut is not None and codec.tool_call_start_id is not None:
            stops = stops + (codec.tool_call_start_id,)  # (a marker of several tokens is watched in the text: prep.watch)

        def seed(phase: int) -> int | None:
            return None if req.seed is None else engine_seed(req.seed, phase, st.index)

        def generate(max_tokens: int, stop_ids: tuple[int, ...], budget: int | None, phase: int, **structured: Any) -> Any:
            return ServeRequest(prompt_token_ids=prep.prompt.token_ids + tuple(st.ids), max_tokens=max_tokens, temperature=req.temperature,
                                top_p=req.top_p, stop_token_ids=stop_ids, thinking_budget=budget, seed=seed(phase), images=prep.images,
                                top_logprobs=req.top_logprobs, **structured)

        def force_text(text: str) -> bool:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if prep.max_tokens - len(st.ids) - len(ids) <= 0:
                return False
            st.append(ids, [None] * len(ids), 0)
            return True

        finish, version, stop = "length", self.engine.policy_version, None
        if not force or think_first:
            finish, version, stop = await self._phase(generate(prep.max_tokens, stops, prep.thinking_budget, 0), st, prep, True, out, t0, first)
        if not force:
            return self._completion(st, finish, version, stop)
        if think_first:
            if not (st.ids and finish == "stop" and stop is None):
                return self._completion(st, finish, version, stop)  # cut by length or a stop string: no room for a call
            if st.ids[-1] != codec.reasoning_end_id:  # the model ended its turn inside thinking: close thinking for it
                st.drop_last()
                st.append([codec.reasoning_end_id], [None], 0)
        names = [t["function"]["name"] for t in req.tools or ()]
        name = req.tool_choice.name or (names[0] if len(names) == 1 else None)
        if not force_text(codec.forced_call_prefix(name, after_reasoning=think_first)):
            return self._completion(st, "length", version, stop)
        end_ids = set(codec.stop_token_ids) | {getattr(self.tokenizer, "eos_token_id", None)}
        if name is None:  # the model picks one of the request's tools, and only one of them
            choices = tuple(json.dumps(n, ensure_ascii=False)[1:] + ', "arguments": ' for n in names)
            start = len(st.ids)
            finish, version, stop = await self._phase(generate(prep.max_tokens - len(st.ids), codec.stop_token_ids, None, 1, choice=choices),
                                                      st, prep, False, out, t0, first)
            if finish != "stop":
                return self._completion(st, finish, version, stop)
            if st.ids[-1] in end_ids:
                st.drop_last()
            picked = self.tokenizer.decode(st.ids[start:], skip_special_tokens=False)
            name = next((n for n, c in zip(names, choices) if picked == c), None)
        schema = _strict_schema(req.tools or (), name)
        n0 = len(st.ids)
        try:
            finish, version, stop = await self._phase(generate(prep.max_tokens - n0, codec.stop_token_ids, None, 2, json_object=schema is None,
                                                               json_schema=schema), st, prep, True, out, t0, first)
        except Exception as e:  # noqa: BLE001 - a strict schema the grammar backend cannot compile: any JSON object instead
            if schema is None or isinstance(e, ApiError) or len(st.ids) != n0:
                raise
            log.info("request %s: tool %r's strict schema is not usable as a grammar (%s); its arguments are any JSON object",
                     prep.id, name, str(e)[:200])
            finish, version, stop = await self._phase(generate(prep.max_tokens - n0, codec.stop_token_ids, None, 2, json_object=True),
                                                      st, prep, True, out, t0, first)
        if finish == "stop" and stop is None:
            if st.ids and st.ids[-1] in end_ids:
                st.drop_last()  # the grammar's end of text: the server closes the call and the turn
            if force_text("}" + codec.call_close):
                st.append([codec.end_token_id], [None], 0)
        return self._completion(st, finish, version, stop)

    @staticmethod
    def _completion(st: _ChoiceState, finish: str, version: int, stop: str | None) -> Completion:
        return Completion(tuple(st.ids), tuple(st.logprobs), tuple(st.mask), finish, version, stop,
                          top=tuple(st.top) if any(st.top) else ())

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
            choices = tuple(finish_choice(i, c, self.codec, req, turn) for i, c in enumerate(comps))
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
            ids = c.completion.token_ids
            if ids and ids[-1] == self.codec.end_token_id and not c.parse_errors:
                self._remember(prep, c)
        self.requests += 1
        if self.recorder is not None:
            self.recorder.write(self.record(prep, choices), images=prep.images)

    def _remember(self, prep: Prepared, c: Choice) -> None:
        """Keep a finished reply's ids for the next turn, when the codec renders the parsed message back to the
        same text (the client sends back what it was given; otherwise the next prompt cannot extend these ids)."""
        try:
            rendered = self.codec.completion_ids(prep.req.messages, c.message, prep.req.tools)
        except Exception as e:  # noqa: BLE001 - a template that cannot render the reply back: no reuse for it, nothing else
            log.debug("reply %s not kept for token reuse: %s", prep.id, e)
            return
        if self.tokenizer.decode(rendered, skip_special_tokens=False) == c.text:
            self.history.remember(prep.rendered + tuple(rendered), prep.prompt.token_ids + c.completion.token_ids, (prep.id, c.index))

    def record(self, prep: Prepared, choices: Sequence[Choice]) -> ServeRecord:
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
            images=tuple(RecordedImage.of(im) for im in prep.images),
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


def _strict_schema(tools: Sequence[Any], name: str | None) -> str | None:
    """The arguments schema (JSON text) of the tool `name` when it is declared `strict` (OpenAI's promise: the
    arguments are an instance of its parameters schema), else None (any JSON object)."""
    fn = next((t["function"] for t in tools if t["function"]["name"] == name), None)
    if fn is None or fn.get("strict") is not True or not isinstance(fn.get("parameters"), dict):
        return None
    return json.dumps(fn["parameters"], ensure_ascii=False)


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
