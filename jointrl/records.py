"""The records every layer shares: messages, tool calls, tasks, limits, step results, grades.

It imports nothing from `rl`, `envs`, `rewards` or `model`, so each of them can depend on it without
pointing at another layer. Messages follow the OpenAI chat format (role / content / tool_calls /
tool_call_id) but travel between components as frozen dataclasses; `to_openai()` / `from_openai()`
convert at the edges (HTTP, chat templates). This module holds data only: no sandboxing, no tools,
no grading logic.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

Role = Literal["system", "user", "assistant", "tool"]
ThinkingTier = Literal["low", "high", "max"]


@dataclass(frozen=True)
class ToolCall:
    """One function call the assistant asked for. `arguments` is the raw JSON text the model wrote."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    @staticmethod
    def from_openai(d: Mapping[str, Any]) -> "ToolCall":
        fn = d.get("function", d)
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args)
        return ToolCall(id=str(d.get("id", "")), name=str(fn.get("name", "")), arguments=args)


@dataclass(frozen=True)
class Message:
    """One chat message. `reasoning` holds the assistant's thinking text (kept in history, per the seeds)."""

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None
    images: tuple[bytes, ...] = ()  # PNG bytes for image input (CAD views); empty for text-only

    def to_openai(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [tc.to_openai() for tc in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        if self.reasoning is not None:
            d["reasoning_content"] = self.reasoning
        return d

    @staticmethod
    def from_openai(d: Mapping[str, Any]) -> "Message":
        content = d.get("content") or ""
        if isinstance(content, list):  # OpenAI content parts: keep the text parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        return Message(
            role=d["role"],
            content=str(content),
            tool_calls=tuple(ToolCall.from_openai(tc) for tc in (d.get("tool_calls") or ())),
            tool_call_id=d.get("tool_call_id"),
            name=d.get("name"),
            reasoning=d.get("reasoning_content") or d.get("reasoning"),
        )


@dataclass(frozen=True)
class Limits:
    """Budgets the framework enforces for every episode (the agent cannot change them)."""

    max_turns: int = 16
    tool_timeout_s: float = 20.0
    episode_timeout_s: float = 300.0
    max_obs_chars: int = 4000
    max_arg_chars: int = 100_000


@dataclass(frozen=True)
class Task:
    """One problem instance.

    `public` is what the agent may see (besides `prompt`); `private` is for the grader only and
    never enters the agent's sandbox. Both must be JSON-serialisable so tasks live in HF datasets.
    """

    id: str
    domain: str
    prompt: tuple[Message, ...]
    public: Mapping[str, Any] = field(default_factory=dict)
    private: Mapping[str, Any] = field(default_factory=dict)
    limits: Limits = Limits()
    thinking: ThinkingTier = "high"
    split: str = "train"

    def to_row(self) -> dict[str, Any]:
        """A flat row for `datasets.Dataset` (nested data as JSON text so schemas stay stable)."""
        return {
            "id": self.id,
            "domain": self.domain,
            "prompt": json.dumps([m.to_openai() for m in self.prompt]),
            "public": json.dumps(dict(self.public)),
            "private": json.dumps(dict(self.private)),
            "limits": json.dumps(self.limits.__dict__),
            "thinking": self.thinking,
            "split": self.split,
        }

    @staticmethod
    def from_row(row: Mapping[str, Any]) -> "Task":
        return Task(
            id=row["id"],
            domain=row["domain"],
            prompt=tuple(Message.from_openai(m) for m in json.loads(row["prompt"])),
            public=json.loads(row["public"]),
            private=json.loads(row["private"]),
            limits=Limits(**json.loads(row["limits"])),
            thinking=row.get("thinking", "high"),
            split=row.get("split", "train"),
        )


@dataclass(frozen=True)
class StepResult:
    """What `Env.step` returns: tool messages to append, and whether the episode is over."""

    messages: tuple[Message, ...]
    terminated: bool  # the task reached a natural end (submit / answer)
    truncated: bool  # a budget ended it (turns, wall time, context)
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Grade:
    """The grader's verdict. `error` is set when grading itself failed: never silently a 0."""

    reward: float
    metrics: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None
