"""A small environment whose prompt and tool results carry images, for the image path's loop and trainer tests.

`look(view)` answers with a PNG: "a" / "b" give two fixed 64 x 64 random images, "wide" a 96 x 32 one,
"broken" corrupt bytes, "odd" a 30 x 30 image (not a multiple of the patch size), "many" four images at once.
`submit()` ends the episode; the reward is 1 when the agent looked at least once. The task's user message
carries one 32 x 32 image. Test-only: real domains (envs/) render their own images.
"""
from __future__ import annotations

import io
import json
from typing import Any

import numpy as np

from jointrl.records import Grade, Message, StepResult, Task

TOOLS = [
    {"type": "function", "function": {"name": "look", "description": "Look at a view.",
                                      "parameters": {"type": "object", "properties": {"view": {"type": "string"}},
                                                     "required": ["view"]}}},
    {"type": "function", "function": {"name": "submit", "description": "Finish.",
                                      "parameters": {"type": "object", "properties": {}}}},
]


def png(width: int, height: int, seed: int = 0) -> bytes:
    from PIL import Image

    arr = np.random.RandomState(seed).randint(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="PNG")
    return buf.getvalue()


VIEWS = {"a": (png(64, 64, 1),), "b": (png(64, 64, 2),), "wide": (png(96, 32, 3),), "broken": (b"\x89PNG\r\n\x1a\nbroken",),
         "odd": (png(30, 30, 4),), "many": tuple(png(16, 16, 10 + i) for i in range(4))}
PROMPT_IMAGE = png(32, 32, 0)


def image_task(task_id: str = "img/0") -> Task:
    return Task(id=task_id, domain="img", prompt=(
        Message(role="system", content="You look at pictures."),
        Message(role="user", content="What is in these pictures?", images=(PROMPT_IMAGE,))))


class ImageEnv:
    """Implements the calls the agent loop makes: reset, step, grade, close."""

    def __init__(self, tools_in_prompt: bool = True) -> None:
        self.looked = 0
        self.tools_in_prompt = tools_in_prompt  # False: a short prompt (engine tests at a small max_model_len)

    async def reset(self, task: Task) -> tuple[list[Message], list[dict[str, Any]]]:
        return list(task.prompt), (TOOLS if self.tools_in_prompt else [])

    async def step(self, message: Message, parse_errors: tuple[str, ...] = ()) -> StepResult:
        out = []
        for call in message.tool_calls:
            if call.name == "submit":
                return StepResult(messages=(), terminated=True, truncated=False)
            view = json.loads(call.arguments).get("view", "")
            if view not in VIEWS:
                out.append(Message(role="tool", content=f"unknown view {view!r}"))
                continue
            self.looked += 1
            out.append(Message(role="tool", content=f"view {view}", images=VIEWS[view]))
        for e in parse_errors:
            out.append(Message(role="tool", content=f"error: {e}"))
        if not out:
            out.append(Message(role="tool", content="call look or submit"))
        return StepResult(messages=tuple(out), terminated=False, truncated=False)

    async def grade(self) -> Grade:
        return Grade(reward=1.0 if self.looked else 0.0)

    def close(self) -> None:
        pass
