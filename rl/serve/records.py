"""Serve records: one JSON line per request/response at token level, and the readers that turn them back into RL sequences.

What it does
- `ServeRecord` / `RecordedChoice`: the JSONL layout (docs/serve.md "Records"); both wire protocols
  write the same records (`request.protocol` says which one the request came in).
- `Recorder`: appends records to `<dir>/serve-<time>-<pid>.jsonl`, one file per server run.
- `read_records` / `recorded_sequence`: follow `continues` links to rebuild one append-only token
  sequence (ids, loss mask, logprobs) from a multi-turn conversation.

What it does not do
- No rewards: a record becomes an `rl.types.Episode` once a scaffold supplies one.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

RECORD_VERSION = 1


@dataclass(frozen=True)
class RecordedChoice:
    index: int
    completion_token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]  # None where the server forced the token
    loss_mask: tuple[int, ...]  # 1 = sampled by the policy, 0 = forced by the server
    finish_reason: str
    text: str
    message: Mapping[str, Any]
    parse_errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServeRecord:
    """One request/response, token level. See docs/serve.md for the JSONL layout."""

    id: str
    created: float
    model: str
    policy_version: int
    request: Mapping[str, Any]  # messages, tools, tool_choice, thinking tier/budget, sampling params, user, metadata
    prompt_token_ids: tuple[int, ...]
    prompt_reused_tokens: int  # leading prompt ids copied from the `continues` record's prompt + completion
    continues: tuple[str, int] | None  # (record id, choice index) this prompt extends, or None
    choices: tuple[RecordedChoice, ...]
    record_version: int = RECORD_VERSION

    def to_json(self) -> str:
        d = {
            "record_version": self.record_version, "id": self.id, "created": self.created, "model": self.model,
            "policy_version": self.policy_version, "request": self.request,
            "prompt_token_ids": list(self.prompt_token_ids), "prompt_reused_tokens": self.prompt_reused_tokens,
            "continues": None if self.continues is None else {"id": self.continues[0], "choice": self.continues[1]},
            "choices": [
                {"index": c.index, "completion_token_ids": list(c.completion_token_ids), "logprobs": list(c.logprobs),
                 "loss_mask": list(c.loss_mask), "finish_reason": c.finish_reason, "text": c.text,
                 "message": c.message, "parse_errors": list(c.parse_errors)}
                for c in self.choices
            ],
        }
        return json.dumps(d, ensure_ascii=False)

    @staticmethod
    def from_json(line: str) -> "ServeRecord":
        d = json.loads(line)
        if d.get("record_version") != RECORD_VERSION:
            raise ValueError(f"record {d.get('id')!r}: record_version {d.get('record_version')!r}, this reader knows {RECORD_VERSION}")
        cont = d["continues"]
        return ServeRecord(
            id=d["id"], created=d["created"], model=d["model"], policy_version=d["policy_version"], request=d["request"],
            prompt_token_ids=tuple(d["prompt_token_ids"]), prompt_reused_tokens=d["prompt_reused_tokens"],
            continues=None if cont is None else (cont["id"], int(cont["choice"])),
            choices=tuple(
                RecordedChoice(index=c["index"], completion_token_ids=tuple(c["completion_token_ids"]), logprobs=tuple(c["logprobs"]),
                               loss_mask=tuple(c["loss_mask"]), finish_reason=c["finish_reason"], text=c["text"],
                               message=c["message"], parse_errors=tuple(c["parse_errors"]))
                for c in d["choices"]
            ),
            record_version=d["record_version"],
        )


class Recorder:
    """Appends ServeRecords as JSON lines to `<dir>/serve-<time>-<pid>.jsonl` (one file per server run)."""

    def __init__(self, record_dir: str | os.PathLike[str]) -> None:
        d = Path(record_dir)
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / f"serve-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.jsonl"
        self._lock = threading.Lock()

    def write(self, record: ServeRecord) -> None:
        line = record.to_json() + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line)


def read_records(path: str | os.PathLike[str]) -> list[ServeRecord]:
    """All records of one JSONL file (or of every *.jsonl file in a directory), in file order."""
    p = Path(path)
    files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    out = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    out.append(ServeRecord.from_json(line))
                except (ValueError, KeyError) as e:
                    raise ValueError(f"{f}:{n}: not a serve record ({e})") from None
    return out


@dataclass(frozen=True)
class RecordedSequence:
    """One append-only token sequence rebuilt from a chain of records (an RL sample)."""

    record_ids: tuple[str, ...]  # the chain, first turn first
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]  # 1 exactly on tokens the policy sampled
    logprobs: tuple[float, ...]  # sampled logprob where loss_mask == 1, else 0.0


def recorded_sequence(records: Mapping[str, ServeRecord] | Sequence[ServeRecord], record_id: str, choice: int = 0) -> RecordedSequence:
    """Prompt + completion of `record_id`'s choice, with the loss mask and logprobs of every earlier turn it extends."""
    by_id = records if isinstance(records, Mapping) else {r.id: r for r in records}
    chain: list[tuple[ServeRecord, int]] = []
    rid, ch = record_id, choice
    while True:
        rec = by_id.get(rid)
        if rec is None:
            raise KeyError(f"record {rid!r} not found (chain: {[r.id for r, _ in chain]})")
        if not 0 <= ch < len(rec.choices):
            raise KeyError(f"record {rid!r} has no choice {ch}")
        chain.append((rec, ch))
        if rec.continues is None:
            break
        rid, ch = rec.continues
    chain.reverse()
    ids: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    for rec, ch in chain:
        if tuple(ids) != rec.prompt_token_ids[: rec.prompt_reused_tokens] or len(ids) != rec.prompt_reused_tokens:
            raise ValueError(f"record {rec.id!r}: its first {rec.prompt_reused_tokens} prompt ids are not the tokens of the record it continues")
        rest = rec.prompt_token_ids[len(ids):]
        ids += rest
        mask += [0] * len(rest)
        lps += [0.0] * len(rest)
        c = rec.choices[ch]
        ids += c.completion_token_ids
        mask += list(c.loss_mask)
        lps += [0.0 if lp is None else float(lp) for lp in c.logprobs]
    return RecordedSequence(record_ids=tuple(r.id for r, _ in chain), token_ids=tuple(ids), loss_mask=tuple(mask), logprobs=tuple(lps))


