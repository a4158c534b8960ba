"""Serve records: one JSON line per request/response at token level, and the readers that turn them back into RL sequences.

What it does
- `ServeRecord` / `RecordedChoice`: the JSONL layout (docs/serve.md "Records"); both wire protocols
  write the same records (`request.protocol` says which one the request came in); a reply message is
  stored by `message_json`, in the OpenAI chat form.
- `Recorder`: appends records to `<dir>/serve-<time>-<pid>.jsonl`, one file per server run, and each
  request's images, content-addressed, to `<dir>/images/<sha256>.<png|jpg|img>` (a multi-turn
  conversation re-sends its images; each is stored once). A record names its images by sha256 with
  the prompt span each feeds (`RecordedImage`); the image file is written before the record line,
  so a record never names a missing file.
- `read_records` / `recorded_sequence`: follow `continues` links to rebuild one append-only token
  sequence (ids, loss mask, logprobs, and the images with their spans, read back from the record
  directory and checked against their sha256) from a multi-turn conversation.
- `recorded_episode`: the segments of one episode a client drove through the server and named in its requests'
  `metadata.episode_id`. A client that truncates or summarises its own history sends a prompt that no longer
  extends the earlier turns: that turn starts a new chain. Each chain is one segment (its tokens exactly what
  the engine was given and generated), oldest first, as `rl.types.Episode.segments` holds an agent loop's
  compacted contexts (rl/rollout/context.py).
- `training_episode`: that episode, with a reward the caller supplies, as the `rl.types.Episode` rollouts produce
  (one segment per context, the loss mask on exactly the sampled tokens, their logprobs, and the policy version of
  each record's tokens), so a served conversation is trained like a rolled-out one (`rl.trainer.batch.collate`).

What it does not do
- No rewards of its own: the scaffold that drove the conversation grades it and passes the reward in.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from jointrl.records import Message
from rl.types import Episode, Segment, TokenImage

RECORD_VERSION = 1
IMAGES_DIR = "images"  # under the record directory


@dataclass(frozen=True)
class RecordedImage:
    """An image of the request's prompt: its bytes' sha256 (the file `images/<sha256>.<ext>` next to the record)
    and the prompt span [start, start + length) of placeholder tokens it feeds."""

    sha256: str
    start: int
    length: int

    @staticmethod
    def of(image: TokenImage) -> "RecordedImage":
        return RecordedImage(sha256=hashlib.sha256(image.data).hexdigest(), start=image.start, length=image.length)


def image_file_name(data: bytes) -> str:
    """`<sha256>.<ext>`: png / jpg by the bytes' signature, `img` for any other format Pillow read."""
    ext = "png" if data.startswith(b"\x89PNG\r\n\x1a\n") else "jpg" if data.startswith(b"\xff\xd8\xff") else "img"
    return f"{hashlib.sha256(data).hexdigest()}.{ext}"


def load_image(record_dir: str | os.PathLike[str], sha256: str) -> bytes:
    """The bytes of a recorded image, checked against their sha256 (ValueError when missing or altered)."""
    files = sorted((Path(record_dir) / IMAGES_DIR).glob(f"{sha256}.*"))
    if not files:
        raise ValueError(f"image {sha256} is not in {Path(record_dir) / IMAGES_DIR} (records read without their record directory?)")
    data = files[0].read_bytes()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"{files[0]}: its bytes do not hash to the name it is recorded under")
    return data


def message_json(m: Message) -> dict[str, Any]:
    """A reply message as a record stores it, in the OpenAI chat form every record uses (content null when
    there are only tool calls); rl/serve/openai.py sends the same dict."""
    d: dict[str, Any] = {"role": "assistant", "content": m.content if (m.content or not m.tool_calls) else None}
    d["reasoning_content"] = m.reasoning
    if m.tool_calls:
        d["tool_calls"] = [tc.to_openai() for tc in m.tool_calls]
    return d


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
    images: tuple[RecordedImage, ...] = ()  # the prompt's images, in order, with the spans they feed

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
            "images": [{"sha256": im.sha256, "start": im.start, "length": im.length} for im in self.images],
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
            # absent in records written before images were recorded: those requests carried none
            images=tuple(RecordedImage(sha256=str(im["sha256"]), start=int(im["start"]), length=int(im["length"]))
                         for im in d.get("images", ())),
        )


class Recorder:
    """Appends ServeRecords as JSON lines to `<dir>/serve-<time>-<pid>.jsonl` (one file per server run) and their
    images to `<dir>/images/`, one file per distinct image."""

    def __init__(self, record_dir: str | os.PathLike[str]) -> None:
        d = Path(record_dir)
        d.mkdir(parents=True, exist_ok=True)
        self.dir = d
        self.path = d / f"serve-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.jsonl"
        self._lock = threading.Lock()

    def write(self, record: ServeRecord, images: Sequence[TokenImage] = ()) -> None:
        """Append `record`; `images`: the request's images (bytes and spans), which `record.images` must name."""
        if tuple(RecordedImage.of(im) for im in images) != record.images:
            raise ValueError(f"record {record.id!r}: the images given are not the ones the record names")
        line = record.to_json() + "\n"
        with self._lock:
            for im in images:
                self._store(im.data)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)

    def _store(self, data: bytes) -> None:
        target = self.dir / IMAGES_DIR / image_file_name(data)
        if target.exists():
            return
        target.parent.mkdir(exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)  # whole or absent: a crash never leaves a truncated image under its hash


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
    images: tuple[TokenImage, ...] = ()  # the images and the spans of `token_ids` they feed (rl.types.Episode.images)


def recorded_sequence(records: Mapping[str, ServeRecord] | Sequence[ServeRecord], record_id: str, choice: int = 0,
                      record_dir: str | os.PathLike[str] | None = None) -> RecordedSequence:
    """Prompt + completion of `record_id`'s choice, with the loss mask and logprobs of every earlier turn it extends.

    `record_dir`: the server's `--record-dir`, where the images are; needed when the conversation has images
    (ValueError naming it otherwise). The images are those of the last turn's prompt, which holds the whole
    conversation (requests with images are never encoded by reusing an earlier turn's ids)."""
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
    last = chain[-1][0]
    images: tuple[TokenImage, ...] = ()
    if last.images:
        if record_dir is None:
            raise ValueError(f"record {last.id!r} has {len(last.images)} images: pass record_dir (the server's "
                             "--record-dir, which holds images/) to read them")
        images = tuple(TokenImage(data=load_image(record_dir, im.sha256), start=im.start, length=im.length)
                       for im in last.images)
    return RecordedSequence(record_ids=tuple(r.id for r, _ in chain), token_ids=tuple(ids), loss_mask=tuple(mask),
                            logprobs=tuple(lps), images=images)




EPISODE_KEY = "episode_id"  # the request metadata key naming the episode a request belongs to


@dataclass(frozen=True)
class RecordedEpisode:
    """The contexts of one served episode, oldest first; the last is the one the client sent most recently."""

    episode_id: str
    segments: tuple[RecordedSequence, ...]


def recorded_episode(records: Sequence[ServeRecord], episode_id: str, choice: int = 0,
                     record_dir: str | os.PathLike[str] | None = None) -> RecordedEpisode:
    """Every segment of the episode whose requests carried `metadata.episode_id == episode_id`.

    `records` in file order (`read_records`), which is the order requests finished. A segment is a chain of
    `continues` links (`recorded_sequence`) ending at a record of the episode that no later record continues; the
    segments are ordered by their last record. A turn the client sent twice (a retry) leaves the abandoned reply as
    a segment of its own: its tokens are still exactly what the engine saw and generated."""
    by_id = {r.id: r for r in records}
    mine = [r for r in records if isinstance(r.request.get("metadata"), Mapping) and r.request["metadata"].get(EPISODE_KEY) == episode_id]
    if not mine:
        raise KeyError(f"no record names metadata.{EPISODE_KEY} {episode_id!r}")
    continued = {(r.continues[0], r.continues[1]) for r in mine if r.continues is not None}
    ends = [r for r in mine if (r.id, choice) not in continued]
    return RecordedEpisode(episode_id=episode_id,
                           segments=tuple(recorded_sequence(by_id, r.id, choice, record_dir) for r in ends))


def _turns(by_id: Mapping[str, ServeRecord], seq: RecordedSequence, choice: int) -> list[tuple[ServeRecord, RecordedChoice]]:
    """Each record of `seq`'s chain with the choice the chain goes through (the one the next record continues;
    `choice` for the last)."""
    out = []
    for k, rid in enumerate(seq.record_ids):
        rec = by_id[rid]
        nxt = by_id[seq.record_ids[k + 1]].continues if k + 1 < len(seq.record_ids) else None
        out.append((rec, rec.choices[choice if nxt is None else nxt[1]]))
    return out


def _token_versions(turns: Sequence[tuple[ServeRecord, RecordedChoice]], n_tokens: int) -> tuple[int, ...]:
    """The policy version of each token of a chain: its record's `policy_version` on the tokens the policy sampled,
    0 elsewhere (`rl.types.Segment.token_versions`'s layout)."""
    versions: list[int] = []
    for rec, ch in turns:
        versions += [0] * (len(rec.prompt_token_ids) - len(versions))
        versions += [rec.policy_version if m else 0 for m in ch.loss_mask]
    if len(versions) != n_tokens:
        raise ValueError(f"records {[r.id for r, _ in turns]}: {len(versions)} token versions for {n_tokens} tokens")
    return tuple(versions)


def training_episode(records: Sequence[ServeRecord], episode_id: str, reward: float, *, task_id: str | None = None,
                     domain: str = "served", group_id: str | None = None, choice: int = 0,
                     record_dir: str | os.PathLike[str] | None = None, terminated: bool = True,
                     truncated: bool = False) -> Episode:
    """The served episode `episode_id` (`recorded_episode`) as a training `rl.types.Episode` with `reward`.

    Its segments are the recorded contexts, oldest first, token for token (the last one is the Episode's own
    fields, as the agent loop leaves it): loss mask 1 exactly on the tokens the policy sampled, their engine
    logprobs, the images with their spans. Each record's sampled tokens carry its `policy_version` (a request
    that straddled a weight update records the later one); `token_versions` are kept where the episode's records
    span more than one version, and `policy_version` is the oldest (staleness counts from it). `messages` are the
    policy's replies in record order: the prompts are in the tokens, and the client's own messages stay in the
    records in the protocol they came in. `task_id` and `group_id` default to the episode id; episodes that share a
    `group_id` share a GRPO baseline. Routed experts are not recorded, so the trainer routes afresh (no R3)."""
    if not isinstance(reward, (int, float)) or isinstance(reward, bool) or reward != reward or abs(reward) == float("inf"):
        raise ValueError(f"episode {episode_id!r}: reward must be a finite number, got {reward!r}")
    by_id = {r.id: r for r in records}
    recorded = recorded_episode(records, episode_id, choice, record_dir)
    chains = [_turns(by_id, seq, choice) for seq in recorded.segments]
    versions = [_token_versions(turns, len(seq.token_ids)) for turns, seq in zip(chains, recorded.segments)]
    replies = [turn for turns in chains for turn in turns]
    seen = {rec.policy_version for rec, _ in replies}
    mixed = len(seen) > 1  # per-token versions are kept only when they differ, as the agent loop keeps them
    segs = [Segment(token_ids=seq.token_ids, loss_mask=seq.loss_mask, rollout_logprobs=seq.logprobs, images=seq.images,
                    token_versions=v if mixed else ()) for seq, v in zip(recorded.segments, versions)]
    last = segs[-1]
    metrics = {"segments": float(len(segs)), "compactions": float(len(segs) - 1),
               "context_tokens_max": float(max(len(x.token_ids) for x in segs)), "policy_versions": float(len(seen)),
               "parse_errors": float(sum(len(ch.parse_errors) for _, ch in replies)),
               "capped_turns": float(sum(ch.finish_reason == "length" for _, ch in replies)),
               "episode_error": 0.0, "grade_error": 0.0}
    return Episode(task_id=task_id or episode_id, domain=domain, group_id=group_id or episode_id, token_ids=last.token_ids,
                   loss_mask=last.loss_mask, rollout_logprobs=last.rollout_logprobs,
                   messages=tuple(Message.from_openai({"role": "assistant", **ch.message}) for _, ch in replies), reward=float(reward), metrics=metrics,
                   terminated=terminated, truncated=truncated, num_turns=len(replies), policy_version=min(seen),
                   images=last.images, segments=tuple(segs[:-1]), token_versions=last.token_versions)
