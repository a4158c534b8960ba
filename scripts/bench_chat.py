"""Benchmark the chat format's hot paths, printing figures side by side (ratios) in one run.

1. Rendering a conversation: `model.chat.render` (pure Python) vs the shipped Jinja template
   through transformers' `apply_chat_template(tokenize=False)`.
2. Token-in/token-out growth of a long agent episode: encoding only the appended text per turn
   (`render_turn_suffix`) vs re-rendering and re-encoding the whole history every turn.
3. `parse_assistant` on generated turns.

Run: .venv/bin/python scripts/bench_chat.py [--turns 40] [--repeat 5]
Timings are wall-clock on whatever machine runs it; compare the ratios, not absolute numbers.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from jointrl.records import Message, ToolCall  # noqa: E402
from model import chat  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
     "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {"name": "submit", "description": "Finish the task.",
     "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}},
]


def episode(turns: int, seed: int = 0) -> list[Message]:
    """A synthetic SWE-like episode: ~400-char thoughts, one bash call and ~1.5 kB of output per turn."""
    rng = random.Random(seed)
    src = (Path(json.__file__).parent / "decoder.py").read_text().splitlines()
    msgs = [Message("system", "You are a careful software engineer."), Message("user", "Fix the failing test in tests/test_io.py.")]
    for t in range(turns):
        thought = " ".join(rng.choice(("check", "the", "parser", "fails", "on", "empty", "input", "so", "I", "will", "grep", "it")) for _ in range(70))
        cmd = rng.choice(("grep -rn 'def scan' src/", "python -m pytest -q tests/", "sed -n '1,40p' src/io.py"))
        msgs.append(Message("assistant", "", reasoning=thought, tool_calls=(ToolCall(chat.tool_call_id(t, 0), "bash", json.dumps({"command": cmd})),)))
        start = rng.randrange(len(src) - 40)
        msgs.append(Message("tool", "\n".join(src[start : start + 40]), tool_call_id=chat.tool_call_id(t, 0)))
    return msgs


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    tok = chat.load_tokenizer()
    msgs = episode(args.turns)
    dicts = chat.to_template_messages(msgs)
    text = chat.render(msgs, tools=TOOLS, add_generation_prompt=True)
    assert text == tok.apply_chat_template(dicts, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    n_tokens = len(tok.encode(text, add_special_tokens=False))
    print(f"episode: {args.turns} turns, {len(msgs)} messages, {len(text)} chars, {n_tokens} tokens")

    # 1. render: Python vs Jinja
    t_py = best_of(lambda: chat.render(msgs, tools=TOOLS, add_generation_prompt=True), args.repeat)
    t_jinja = best_of(lambda: tok.apply_chat_template(dicts, tools=TOOLS, add_generation_prompt=True, tokenize=False), args.repeat)
    print(f"{'render whole episode':<44} python {t_py * 1e3:8.2f} ms | jinja {t_jinja * 1e3:8.2f} ms | jinja/python {t_jinja / t_py:6.1f}x")

    # 2. per-turn growth: append-only encoding vs re-encode everything each turn
    a_idx = [i for i, m in enumerate(msgs) if m.role == "assistant"]

    def incremental() -> list[int]:
        ids = tok.encode(chat.render(msgs[: a_idx[0]], tools=TOOLS, add_generation_prompt=True), add_special_tokens=False)
        for j, i in enumerate(a_idx):
            ids += tok.encode(chat.render_completion(msgs[i]), add_special_tokens=False)  # stands in for generated ids
            nxt = a_idx[j + 1] if j + 1 < len(a_idx) else len(msgs)
            ids += tok.encode(chat.render_turn_suffix(msgs[i + 1 : nxt]), add_special_tokens=False)
        return ids

    def rerender() -> list[int]:
        ids: list[int] = []
        for j, i in enumerate(a_idx):
            nxt = a_idx[j + 1] if j + 1 < len(a_idx) else len(msgs)
            ids = tok.encode(chat.render(msgs[:nxt], tools=TOOLS, add_generation_prompt=True), add_special_tokens=False)
        return ids

    assert incremental() == rerender()
    t_inc = best_of(incremental, args.repeat)
    t_re = best_of(rerender, args.repeat)
    print(f"{'build token ids over all turns':<44} append {t_inc * 1e3:8.2f} ms | re-encode {t_re * 1e3:8.2f} ms | re-encode/append {t_re / t_inc:6.1f}x")

    # 3. parsing generated turns
    completions = [chat.render_completion(msgs[i]) for i in a_idx]
    t_parse = best_of(lambda: [chat.parse_assistant(c, turn=k) for k, c in enumerate(completions)], args.repeat)
    print(f"{'parse_assistant':<44} {len(completions) / t_parse:10.0f} turns/s | {t_parse / len(completions) * 1e6:8.1f} us/turn")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
