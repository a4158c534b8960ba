"""The environment API (`Env`) and the framework that runs every domain (`ToolEnv` around a `Domain`).

Two layers, so that budgets cannot depend on each domain getting them right:

- `Domain` is what an environment author writes: tools as `@tool` methods, `setup(task)`,
  `check(task, transcript) -> {name: value}` (the final-state checks), a `rubric`, and
  `reference(task)` (a scripted solution as tool calls, used by the conformance checker).
- `ToolEnv` is the `Env` the trainer talks to. It owns the loop around the domain and enforces
  the task's `Limits` (max turns, per-tool timeout, episode wall time, observation clipping with
  a head + tail marker, argument size caps) and turns malformed model output into error messages
  the model reads, so the episode goes on:
    * an assistant message with no tool call      -> a `user` message saying a call is needed
      (there is no tool_call_id to answer; domains with `text_ends_episode` finish instead,
      unless the reply held calls that could not be parsed)
    * calls the caller's parser could not parse    -> one `user` message listing them, after the
      (`step(..., parse_errors=...)`)                 tool messages (each counts as a malformed call)
    * invalid JSON / non-object / oversize args    -> `tool` message answering that call
      (also over-deep nesting, over-long numbers)
    * unknown tool, missing / unexpected / mistyped arguments -> `tool` message
    * more than `max_calls_per_turn` calls         -> the extra calls are answered "skipped"
    * a tool that raises or overruns its timeout   -> `tool` message with the error
  Malformed calls are counted (`malformed_calls`) and reach the rubric.

What raises: only API misuse by the caller (`EnvUsageError`: step before reset, reset after close)
and set-up failures the episode cannot run without (`EnvSetupError`, e.g. the sandbox is refused
by the kernel: we never fall back to running unsandboxed). Nothing the model writes raises (any
`Message` with any strings in it; tests/envs/test_tools_fuzz.py fuzzes this with hypothesis), every
observation is valid UTF-8 and clipped to `max_obs_chars`, and
`grade()` never raises: a grader exception or timeout becomes `Grade(reward=rubric.error_reward,
error=..., metrics={"grade_error": 1})`.

Hooks are plain synchronous methods (sandbox calls block); the framework runs them on a shared
thread pool so many episodes can be stepped concurrently from one asyncio loop. A synchronous
tool cannot be killed from outside its thread: the framework stops waiting after its timeout and
answers the model, and tools that run commands pass `ctx.timeout_s` to the sandbox, whose
wall-clock kill ends the command itself.
"""
from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import dataclasses
import inspect
import json
import logging
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Sequence

from envs.tools import ToolArgError, ToolContext, ToolSpec, collect_tools
from jointrl.records import Grade, Limits, Message, StepResult, Task, ToolCall
from rewards.rubric import EpisodeSummary, Rubric

log = logging.getLogger(__name__)


class EnvUsageError(RuntimeError):
    """The caller used the API out of order (step before reset, reset after close)."""


class EnvSetupError(RuntimeError):
    """The episode cannot start (sandbox refused, set-up command failed). Never a model error."""


@dataclass(frozen=True)
class ToolInvocation:
    """One scripted tool call (reference solutions, do-nothing policies)."""

    name: str
    arguments: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class ToolOutput:
    """A tool may return this instead of a str to report that its own inner work timed out, or to answer
    with images (encoded PNG / JPEG; the agent loop decides what the policy sees of them)."""

    content: str
    timed_out: bool = False
    images: tuple[bytes, ...] = ()


# ----------------------------------------------------------------------------- observation clipping
def clip_observation(text: str, max_chars: int) -> tuple[str, bool]:
    """Keep the head and the tail of `text` so the result has at most `max_chars` characters.

    The middle is replaced by a marker saying how many characters were dropped (the model sees
    that output was cut, and both the command's start and its final lines / exit status survive).
    Returns (text, clipped).
    """
    if max_chars < 0:
        raise ValueError(f"max_chars must be >= 0, got {max_chars}")
    if len(text) <= max_chars:
        return text, False
    # The marker's length depends on the number it prints; grow the dropped count until it fits.
    dropped = len(text) - max_chars
    while True:
        marker = f"\n[... {dropped} characters clipped ...]\n"
        keep = max_chars - len(marker)
        if keep < 0:  # too small a budget for the marker: plain head cut
            return text[:max_chars], True
        if len(text) - keep == dropped:
            break
        dropped = len(text) - keep
    head = (keep + 1) // 2
    tail = keep - head
    return text[:head] + marker + (text[len(text) - tail:] if tail else ""), True


# ----------------------------------------------------------------------------- the public interface
class Env(abc.ABC):
    """One episode at a time: reset(task) -> step(assistant message)* -> grade() -> close()."""

    @abc.abstractmethod
    async def reset(self, task: Task) -> tuple[list[Message], list[dict[str, Any]]]:
        """Start an episode; returns the prompt messages and the OpenAI tool schemas."""

    @abc.abstractmethod
    async def step(self, assistant: Message, *, parse_errors: Sequence[str] = ()) -> StepResult:
        """Apply one assistant message; returns the tool/user messages to append and the episode state.

        parse_errors: one line per tool call the caller's parser could not turn into a `ToolCall`
        (the chat codec's `ParsedAssistant.call_errors`); they are answered and counted as malformed calls.
        """

    @abc.abstractmethod
    async def grade(self) -> Grade:
        """Grade the episode (ends it first if it is still running). Never raises."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything (sandbox, processes). Idempotent."""


class Domain(abc.ABC):
    """What an environment author writes. See docs/envs.md ("Writing a domain")."""

    rubric: ClassVar[Rubric]
    text_ends_episode: ClassVar[bool] = False  # True: a reply without tool calls is the final answer

    def setup(self, task: Task) -> None:
        """Prepare the episode's world (open a sandbox, write files). Raise EnvSetupError on failure."""

    @abc.abstractmethod
    def check(self, task: Task, transcript: tuple[Message, ...]) -> Mapping[str, float]:
        """Trusted final-state checks after the episode, e.g. {"correct": 1.0}. May raise (-> error Grade)."""

    def before_grade(self) -> None:
        """Stop everything the agent started; called before `check` (grading starts after this)."""

    def teardown(self) -> None:
        """Release the episode's resources. Must be idempotent."""

    @abc.abstractmethod
    def reference(self, task: Task) -> list[ToolInvocation]:
        """A scripted solution that must score 1 (the conformance checker runs it)."""

    def noop(self, task: Task) -> list[ToolInvocation]:
        """A do-nothing episode that must score 0: call the episode-ending tool at once."""
        enders = [s.name for s, _ in collect_tools(self).values() if s.ends_episode]
        return [ToolInvocation(enders[0])] if enders else []


# ----------------------------------------------------------------------------- the framework
_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    # One pool for every env in the process: asyncio's default executor has only cpu+4 threads,
    # which would serialise 32 concurrent episodes on a 2-core machine.
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="jointrl-env")
        return _POOL


async def _in_thread(fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kw: Any) -> Any:
    fut = _pool().submit(fn, *args, **kw)
    return await asyncio.wait_for(asyncio.wrap_future(fut), timeout=timeout_s)


@dataclass
class _Episode:
    task: Task
    limits: Limits
    started: float
    transcript: list[Message]
    turns: int = 0
    tool_calls: int = 0
    malformed_calls: int = 0
    tool_timeouts: int = 0
    tool_errors: int = 0
    obs_clipped: int = 0
    terminated: bool = False
    truncated: bool = False
    truncation_reason: str = ""
    grade: Grade | None = None
    # The episode's clock: time spent inside step() (tools), not the time between steps, which is the
    # policy generating. On a shared engine that time depends on the batch and the machine's load, not
    # on the agent; counting it truncated every episode of a 60 s rung under a 64-episode CPU batch.
    env_s: float = 0.0
    step_started: float | None = None


class ToolEnv(Env):
    """The framework `Env`: runs a `Domain` under the task's budgets. See the module docstring.

    limits: if given, replaces every task's `Limits` (an operator override; the agent never can).
    max_calls_per_turn: calls beyond this in one assistant message are answered "skipped".
    grade_timeout_s: wall-clock cap for `before_grade` + `check`; overrun -> error Grade.
    grace_s: how long past a tool's timeout the framework waits for a synchronous tool's thread.
    """

    NO_CALL_MESSAGE = ("Error: your reply contained no tool call. Act by calling one of the tools: {tools}."
                       " Call `{ender}` when you are done.")

    def __init__(self, domain: Domain, *, limits: Limits | None = None, max_calls_per_turn: int = 8,
                 grade_timeout_s: float = 120.0, setup_timeout_s: float = 120.0, grace_s: float = 2.0) -> None:
        if max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn must be >= 1, got {max_calls_per_turn}")
        self.domain = domain
        self.limits_override = limits
        self.max_calls_per_turn = max_calls_per_turn
        self.grade_timeout_s = grade_timeout_s
        self.setup_timeout_s = setup_timeout_s
        self.grace_s = grace_s
        self._tools: dict[str, tuple[ToolSpec, Callable]] = collect_tools(domain)
        if not self._tools and not domain.text_ends_episode:
            raise TypeError(f"domain {type(domain).__name__} has no @tool methods and text does not end its episodes")
        self._ep: _Episode | None = None
        self._closed = False

    # -- introspection used by the checker, play and tests
    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        return [spec.openai_schema() for spec, _ in self._tools.values()]

    @property
    def transcript(self) -> tuple[Message, ...]:
        return tuple(self._ep.transcript) if self._ep else ()

    @property
    def limits(self) -> Limits | None:
        return self._ep.limits if self._ep else None

    def reference(self, task: Task) -> list[ToolInvocation]:
        return self.domain.reference(task)

    def noop(self, task: Task) -> list[ToolInvocation]:
        return self.domain.noop(task)

    # -- the API
    async def reset(self, task: Task) -> tuple[list[Message], list[dict[str, Any]]]:
        if self._closed:
            raise EnvUsageError("reset() on a closed env: make a new one with envs.make(...)")
        if not isinstance(task, Task):
            raise EnvUsageError(f"reset() needs an envs.Task, got {type(task).__name__} (use Task.from_row(row))")
        if self._ep is not None:
            await _in_thread(self.domain.teardown)
            self._ep = None
        limits = self.limits_override or task.limits
        try:
            await _in_thread(self.domain.setup, task, timeout_s=self.setup_timeout_s)
        except asyncio.TimeoutError:
            await _in_thread(self.domain.teardown)
            raise EnvSetupError(f"set-up of task {task.id} took longer than {self.setup_timeout_s} s") from None
        except EnvSetupError:
            await _in_thread(self.domain.teardown)
            raise
        except Exception as e:
            await _in_thread(self.domain.teardown)
            raise EnvSetupError(f"set-up of task {task.id} failed: {type(e).__name__}: {e}") from e
        prompt = list(task.prompt)
        self._ep = _Episode(task=task, limits=limits, started=time.monotonic(), transcript=list(prompt))
        return prompt, self.tool_schemas

    def _time_left(self, ep: _Episode) -> float:
        running = time.monotonic() - ep.step_started if ep.step_started is not None else 0.0
        return ep.limits.episode_timeout_s - (ep.env_s + running)

    async def step(self, assistant: Message, *, parse_errors: Sequence[str] = ()) -> StepResult:
        ep = self._ep
        if ep is None:
            raise EnvUsageError("step() before reset()")
        if ep.terminated or ep.truncated:
            return StepResult(messages=(), terminated=ep.terminated, truncated=ep.truncated,
                              info={"error": "the episode is over; call grade()", **self._info(ep)})
        if not isinstance(assistant, Message):
            raise EnvUsageError(f"step() needs an envs.Message, got {type(assistant).__name__} (use Message.from_openai)")
        ep.step_started = time.monotonic()
        try:
            return await self._step(ep, assistant, parse_errors)
        finally:
            ep.env_s += time.monotonic() - ep.step_started
            ep.step_started = None

    async def _step(self, ep: _Episode, assistant: Message, parse_errors: Sequence[str]) -> StepResult:
        unparsed = [_text(e) for e in ([parse_errors] if isinstance(parse_errors, str) else parse_errors or ())]
        ep.turns += 1
        ep.transcript.append(assistant)
        out: list[Message] = []
        calls = assistant.tool_calls if isinstance(assistant.tool_calls, (list, tuple)) else ()
        if not calls and not unparsed:
            if self.domain.text_ends_episode:
                ep.terminated = True
            else:
                ep.malformed_calls += 1
                out.append(Message(role="user", content=self._no_call_text()))
        for i, call in enumerate(calls):
            out.append(await self._answer_call(ep, call, i))
        if unparsed:
            # After the tool messages: those are matched to the well-formed calls by position.
            ep.tool_calls += len(unparsed)
            ep.malformed_calls += len(unparsed)
            text, clipped = clip_observation(self._unparsed_text(unparsed), ep.limits.max_obs_chars)
            ep.obs_clipped += clipped
            out.append(Message(role="user", content=_valid_utf8(text)))
        if not ep.terminated:
            if ep.turns >= ep.limits.max_turns:
                ep.truncated, ep.truncation_reason = True, "max_turns"
            elif self._time_left(ep) <= 0:
                ep.truncated, ep.truncation_reason = True, "episode_timeout"
        ep.transcript.extend(out)
        return StepResult(messages=tuple(out), terminated=ep.terminated, truncated=ep.truncated, info=self._info(ep))

    def _unparsed_text(self, lines: Sequence[str]) -> str:
        shown = [f"- {line[:300]}" for line in lines[: self.max_calls_per_turn]]
        if len(lines) > len(shown):
            shown.append(f"- ... and {len(lines) - len(shown)} more")
        return (f"Error: {len(lines)} tool call(s) in your reply could not be parsed and were not run:\n"
                + "\n".join(shown) + "\nEach call must be one JSON object with a \"name\" and an \"arguments\" object.")

    def _no_call_text(self) -> str:
        names = list(self._tools)
        enders = [s.name for s, _ in self._tools.values() if s.ends_episode]
        return self.NO_CALL_MESSAGE.format(tools=", ".join(names), ender=enders[0] if enders else names[0])

    async def _answer_call(self, ep: _Episode, call: ToolCall, index: int) -> Message:
        ep.tool_calls += 1

        # A ToolCall built by other code than the codec may carry anything; read it defensively.
        name = getattr(call, "name", None)
        name = name if isinstance(name, str) else ""
        call_id = getattr(call, "id", None)
        call_id = call_id if isinstance(call_id, str) else None

        def reply(text: str, images: tuple[bytes, ...] = ()) -> Message:
            text, clipped = clip_observation(text, ep.limits.max_obs_chars)
            ep.obs_clipped += clipped
            return Message(role="tool", content=_valid_utf8(text), tool_call_id=call_id, name=name or None, images=images)

        if ep.terminated:
            return reply("Not executed: the episode already ended in this turn.")
        if index >= self.max_calls_per_turn:
            ep.malformed_calls += 1
            return reply(f"Error: skipped; at most {self.max_calls_per_turn} tool calls are executed per turn.")
        entry = self._tools.get(name)
        if entry is None:
            ep.malformed_calls += 1
            return reply(f"Error: unknown tool {name[:100]!r}; available tools: {', '.join(self._tools)}.")
        spec, fn = entry
        try:
            kwargs = spec.parse_arguments(getattr(call, "arguments", None), ep.limits.max_arg_chars)
        except ToolArgError as e:
            ep.malformed_calls += 1
            return reply(f"Error: {e}")
        except Exception as e:  # noqa: BLE001 - a validator bug must not end the episode; logged loudly
            ep.malformed_calls += 1
            log.warning("validating arguments of %s raised %s", spec.name, traceback.format_exc())
            return reply(f"Error: the arguments of '{spec.name}' could not be validated ({type(e).__name__}).")
        left = self._time_left(ep)
        if left <= 0:
            return reply("Not executed: the episode's time budget is exhausted.")
        timeout = min(ep.limits.tool_timeout_s, left)
        if spec.context_param:
            kwargs[spec.context_param] = ToolContext(timeout_s=timeout, task=ep.task, turn=ep.turns)
        try:
            if inspect.iscoroutinefunction(fn):
                result = await asyncio.wait_for(fn(**kwargs), timeout=timeout)
            else:
                result = await _in_thread(fn, timeout_s=timeout + self.grace_s, **kwargs)
        except asyncio.TimeoutError:
            ep.tool_timeouts += 1
            return reply(f"Error: tool '{spec.name}' did not finish within its {timeout:.1f} s time limit.")
        except ToolArgError as e:  # the tool's own semantic validation of the model's arguments
            ep.malformed_calls += 1
            return reply(f"Error: {e}")
        except Exception as e:  # noqa: BLE001 - a failing tool is reported to the model, never raised
            ep.tool_errors += 1
            log.debug("tool %s raised: %s", spec.name, traceback.format_exc())
            return reply(f"Error: tool '{spec.name}' failed: {type(e).__name__}: {e}")
        try:
            text = _result_text(result)
        except Exception as e:  # noqa: BLE001 - an unprintable result is the tool's failure, reported like one
            ep.tool_errors += 1
            return reply(f"Error: tool '{spec.name}' returned a result that cannot be shown: {type(e).__name__}")
        if isinstance(result, ToolOutput):
            ep.tool_timeouts += bool(result.timed_out)
        if spec.ends_episode:
            ep.terminated = True
        images = result.images if isinstance(result, ToolOutput) else ()
        if not all(isinstance(b, bytes) for b in images):
            ep.tool_errors += 1
            return reply(f"Error: tool '{spec.name}' returned images that are not encoded bytes")
        return reply(text, tuple(images))

    def _info(self, ep: _Episode) -> dict[str, Any]:
        return {"turn": ep.turns, "tool_calls": ep.tool_calls, "malformed_calls": ep.malformed_calls,
                "tool_timeouts": ep.tool_timeouts, "tool_errors": ep.tool_errors, "obs_clipped": ep.obs_clipped,
                "truncation_reason": ep.truncation_reason, "elapsed_s": time.monotonic() - ep.started, "env_s": ep.env_s}

    async def grade(self) -> Grade:
        ep = self._ep
        if ep is None:
            raise EnvUsageError("grade() before reset()")
        if ep.grade is not None:
            return ep.grade
        if self._closed:
            ep.grade = self.domain.rubric.error("grade() after close(): the episode's sandbox is gone")
            return ep.grade
        if not (ep.terminated or ep.truncated):  # e.g. the agent loop ran out of context
            ep.truncated, ep.truncation_reason = True, "ended_by_caller"
        rubric = self.domain.rubric
        base = {"turns": float(ep.turns), "tool_calls": float(ep.tool_calls),
                "malformed_calls": float(ep.malformed_calls), "tool_timeouts": float(ep.tool_timeouts),
                "tool_errors": float(ep.tool_errors), "obs_clipped": float(ep.obs_clipped),
                "terminated": float(ep.terminated), "truncated": float(ep.truncated),
                "episode_s": time.monotonic() - ep.started}
        t0 = time.monotonic()
        transcript = tuple(ep.transcript)

        def run_checks() -> Mapping[str, float]:
            self.domain.before_grade()  # every agent process is gone before any check runs
            return self.domain.check(ep.task, transcript)

        try:
            checks = await _in_thread(run_checks, timeout_s=self.grade_timeout_s)
            checks = {str(k): float(v) for k, v in dict(checks).items()}
        except asyncio.TimeoutError:
            g = rubric.error(f"grader timed out after {self.grade_timeout_s} s")
        except Exception as e:  # noqa: BLE001 - reported as Grade.error + grade_error metric, never raised
            g = rubric.error(f"grader raised {type(e).__name__}: {e}", detail=traceback.format_exc(limit=4))
        else:
            g = rubric.score(EpisodeSummary(task=ep.task, messages=transcript, checks=checks, num_turns=ep.turns,
                                            tool_calls=ep.tool_calls, malformed_calls=ep.malformed_calls,
                                            terminated=ep.terminated, truncated=ep.truncated))
        metrics = {**base, **g.metrics, "grade_s": time.monotonic() - t0}
        ep.grade = Grade(reward=g.reward, metrics=metrics, error=g.error)
        if ep.grade.error:
            log.warning("grading task %s failed: %s", ep.task.id, ep.grade.error.splitlines()[0])
        return ep.grade

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.domain.teardown()
        except Exception:  # noqa: BLE001 - close must not raise; the leak is logged loudly
            log.exception("teardown of %s failed", type(self.domain).__name__)
        ep = self._ep
        if ep is not None and not (ep.terminated or ep.truncated):
            ep.truncated, ep.truncation_reason = True, "closed"

    def __del__(self) -> None:  # a forgotten close() must not leak sandboxes
        try:
            if not self._closed:
                self.close()
        except Exception:  # noqa: BLE001
            pass


def _text(x: Any) -> str:
    return x if isinstance(x, str) else repr(x)


def _valid_utf8(text: str) -> str:
    """`text` with anything UTF-8 cannot encode (lone surrogates, which JSON's \\ud800 escapes
    produce) replaced by "?": the tokenizer refuses such strings, and the observation must reach it."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def _result_text(result: Any) -> str:
    if isinstance(result, ToolOutput):
        return result.content if isinstance(result.content, str) else str(result.content)
    if isinstance(result, str):
        return result
    if result is None:
        return ""
    return json.dumps(result, default=str)


def messages_for_calls(invocations: Sequence[ToolInvocation], start: int = 0) -> list[Message]:
    """Scripted calls -> one assistant message each (ids `call_<n>`)."""
    return [Message(role="assistant", content="",
                    tool_calls=(ToolCall(id=f"call_{start + i}", name=inv.name, arguments=json.dumps(dict(inv.arguments))),))
            for i, inv in enumerate(invocations)]
