"""Serving settings, declared once: the `ServeSettings` dataclass and the command-line flags generated from its fields.

`jointrl serve` (rl/cli.py) and `python -m rl.serve` both call `add_arguments` and `from_args`, so
every setting is a flag with the dataclass's default and comment as its help. Light on purpose
(no model or engine imports): the top-level CLI builds its parser from it.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Mapping

from jointrl.records import ThinkingTier as Tier
from rl.model_config import ModelSection
from rl.rollout.config import RolloutSection, default_thinking_budgets
from rl.rollout.tiers import TIERS, tier_budget
# Effort names a request may send (`reasoning_effort`, `thinking_budget`, Responses `reasoning.effort`) -> tier.
# OpenAI's four efforts fold onto the three tiers: minimal and low are `low`; medium (OpenAI's default) and
# high are `high`, this server's default tier; `max` (the project's own) has no cap.
EFFORTS: dict[str, str] = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "max": "max"}
API_KEY_ENV = "JOINTRL_API_KEY"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class ServeError(RuntimeError):
    """The server cannot start (bad model argument, unsafe binding, ...), with a message naming why."""


@dataclass(frozen=True)
class ServeSettings:
    """How the server builds its engine and answers requests."""

    max_model_len: int = RolloutSection.max_model_len  # context length of the engine (prompt + reply)
    dtype: Literal["auto", "float32", "bfloat16"] = RolloutSection.dtype  # auto: float32, bfloat16 for models with delta layers on CPU (vLLM's CPU kernel needs it)
    kv_cache_gib: float = RolloutSection.kv_cache_gib  # KV-cache size of the engine
    enforce_eager: bool = RolloutSection.enforce_eager  # no graph capture / compilation at start-up
    seed: int = ModelSection.seed  # engine seed, and the random-init seed of a shipped config
    thinking_budgets: Mapping[str, int] = field(default_factory=default_thinking_budgets)  # tier -> tokens; < 0 = no cap
    default_tier: Tier = "high"  # when a request names no thinking budget
    max_n: int = 8  # largest `n` accepted
    served_names: tuple[str, ...] = ()  # model names the server answers to (repeat the flag for aliases); default: the config or checkpoint directory name
    token_cache_entries: int = 4096  # completions remembered for token reuse across turns
    cache_dir: str | None = None  # where shipped configs are materialised (default: $JOINTRL_CACHE/serve)
    max_body_bytes: int = 4 << 20  # larger request bodies get 413
    max_messages: int = 1024  # more messages in one request get 400
    max_tokens_limit: int | None = None  # largest max_tokens accepted (400 above), also the default; None: the context room
    max_running: int = 256  # requests generating at once
    max_queue: int = 256  # requests waiting for a running slot; more get 429 with Retry-After
    rate_limit_per_s: float = 100.0  # requests per second one client address may sustain (a token bucket; 429 with Retry-After past it, before the body is read); 0: no limit
    rate_limit_burst: int = 512  # requests one client address may send at once before its rate limit applies (default: the admission's room, max_running + max_queue)
    max_images: int = 4  # images one request may carry (a checkpoint with a vision tower, project chat format); 0: refuse images
    # The chat format, chosen as training chooses it (model.chat_codec / tool_parser / reasoning_parser, whose defaults these are):
    chat_codec: str = ModelSection.chat_codec  # auto: jointrl for the shipped tokenizer (or none), hf for a checkpoint with a chat template of its own; jointrl; hf
    tool_parser: str = ModelSection.tool_parser  # hf codec: vLLM's tool parser by its registered name (hermes, qwen3_coder, openai = harmony, ...)
    reasoning_parser: str = ModelSection.reasoning_parser  # hf codec: vLLM's reasoning parser by its registered name (qwen3, deepseek_r1, ...); empty: the model has no reasoning format (tiers then cap the reply)

    def __post_init__(self) -> None:
        if self.max_model_len <= 0:
            raise ServeError(f"ServeSettings.max_model_len must be > 0, got {self.max_model_len}")
        missing = [t for t in TIERS if t not in self.thinking_budgets]
        if missing:
            raise ServeError(f"ServeSettings.thinking_budgets lacks tiers {missing} (needs {list(TIERS)})")
        if self.default_tier not in TIERS:
            raise ServeError(f"ServeSettings.default_tier {self.default_tier!r} is not one of {TIERS}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ServeError(f"ServeSettings.dtype {self.dtype!r} is not one of auto, float32, bfloat16")
        for key in ("max_n", "max_body_bytes", "max_messages", "max_running"):
            if getattr(self, key) < 1:
                raise ServeError(f"ServeSettings.{key} must be >= 1, got {getattr(self, key)}")
        from jointrl.limits import MAX_IMAGES_PER_PROMPT

        if not 0 <= self.max_images <= MAX_IMAGES_PER_PROMPT:
            raise ServeError(f"ServeSettings.max_images must be in [0, {MAX_IMAGES_PER_PROMPT}], got {self.max_images}")
        if self.max_queue < 0:
            raise ServeError(f"ServeSettings.max_queue must be >= 0, got {self.max_queue}")
        if not (self.rate_limit_per_s >= 0 and math.isfinite(self.rate_limit_per_s)):
            raise ServeError(f"ServeSettings.rate_limit_per_s must be a finite number >= 0 (0: no limit), got {self.rate_limit_per_s}")
        if self.rate_limit_burst < 1:
            raise ServeError(f"ServeSettings.rate_limit_burst must be >= 1, got {self.rate_limit_burst}")
        if self.kv_cache_gib <= 0:
            raise ServeError(f"ServeSettings.kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ServeError(f"ServeSettings.max_tokens_limit must be >= 1 or None, got {self.max_tokens_limit}")
        if any(not isinstance(n, str) or not n for n in self.served_names):
            raise ServeError("ServeSettings.served_names: names must be non-empty strings")
        from rl.rollout import codec  # light: vLLM loads only to check a parser name

        allowed = (codec.AUTO, *codec.codec_names())
        if self.chat_codec not in allowed:
            raise ServeError(f"--chat-codec {self.chat_codec!r} is not allowed; allowed values: {', '.join(allowed)}")
        # The defaults are registered names; any other value is checked against vLLM's registries (a few seconds).
        for flag, kind, value in (("--tool-parser", "tool", self.tool_parser), ("--reasoning-parser", "reasoning", self.reasoning_parser)):
            if value != getattr(ModelSection, flag[2:].replace("-", "_")):
                problem = codec.parser_name_problem(kind, value)
                if problem:
                    raise ServeError(f"{flag}: {problem}")

    def tier_budget(self, tier: str) -> int | None:
        return tier_budget(tier, self.thinking_budgets)


def _help(name: str) -> str:
    """The field's trailing comment in this file, as the flag's help."""
    import inspect

    for line in inspect.getsource(ServeSettings).splitlines():
        s = line.strip()
        if s.startswith(f"{name}:") and "#" in s:
            return s.split("#", 1)[1].strip().replace("%", "%%")
    return ""


def _budgets(text: str) -> dict[str, int]:
    out = default_thinking_budgets()
    for item in text.split(","):
        k, _, v = item.partition("=")
        if k not in TIERS or not v.strip().lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"{item!r} is not TIER=INT with TIER in {list(TIERS)}")
        out[k] = int(v)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `serve` flags: the model, where to listen, recording, the API key, and one flag per ServeSettings field."""
    p.add_argument("model", help="checkpoint dir (or a run's, with hf/), a pullable model (`jointrl models list`), a file:// / s3:// URL of exported weights, or a shipped model config name (e.g. tiny: random weights)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; anything but loopback needs an API key")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--record-dir", default=None, help="record every request/response as token episodes here")
    p.add_argument("--api-key", default=None, help=f"require this key (Authorization: Bearer / x-api-key) on every route; default ${API_KEY_ENV}")
    d = ServeSettings()
    for f in fields(ServeSettings):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(d, f.name)
        h = _help(f.name)
        if f.name == "served_names":
            p.add_argument("--served-name", dest="served_names", metavar="NAME", action="append", default=None, help=h)
        elif f.name == "thinking_budgets":
            p.add_argument(flag, type=_budgets, default=None, help=f"{h}, e.g. low=64,high=256,max=-1 (default {dict(default)})")
        elif f.name == "dtype":
            p.add_argument(flag, choices=["auto", "float32", "bfloat16"], default=default, help=h)
        elif f.name == "default_tier":
            p.add_argument(flag, choices=list(TIERS), default=default, help=h)
        elif isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=h)
        elif f.name == "chat_codec":
            from rl.rollout.codec import AUTO, codec_names

            p.add_argument(flag, choices=[AUTO, *codec_names()], default=default, help=h)
        elif f.name in ("cache_dir",):
            p.add_argument(flag, default=default, help=h)
        elif f.name == "max_tokens_limit":
            p.add_argument(flag, type=int, default=default, help=h)
        else:
            p.add_argument(flag, type=type(default), default=default, help=f"{h} (default {default})")


@dataclass(frozen=True)
class ServeArgs:
    model: str
    host: str
    port: int
    record_dir: str | None
    api_key: str | None
    settings: ServeSettings


def from_args(a: argparse.Namespace) -> ServeArgs:
    """Parsed flags -> ServeArgs; raises ServeError naming the flag when a value is not allowed."""
    kw: dict[str, Any] = {}
    for f in fields(ServeSettings):
        v = getattr(a, f.name)
        if f.name == "served_names":
            v = tuple(v or ())
        if f.name == "thinking_budgets" and v is None:
            continue
        kw[f.name] = v
    settings = ServeSettings(**kw)
    key = a.api_key if a.api_key is not None else os.environ.get(API_KEY_ENV)
    key = check_api_key(key, "--api-key" if a.api_key is not None else f"${API_KEY_ENV}")
    if a.host not in LOOPBACK_HOSTS and not key:
        raise ServeError(f"--host {a.host}: binding a non-loopback address needs an API key (--api-key or ${API_KEY_ENV})")
    return ServeArgs(a.model, a.host, a.port, a.record_dir, key, settings)


def key_in_headers(headers: list[tuple[bytes, bytes]], key: str | None) -> bool:
    """Whether raw ASGI `headers` carry `key` as `x-api-key` or `Authorization: Bearer` (True when `key` is None),
    compared in constant time; an empty value never passes, whatever the key."""
    import hmac

    if key is None:
        return True
    want = key.encode()
    for k, v in headers:
        given = v.strip() if k == b"x-api-key" else v[7:].strip() if k == b"authorization" and v[:7].lower() == b"bearer " else b""
        if given and hmac.compare_digest(given, want):
            return True
    return False


def check_api_key(key: str | None, where: str = "the API key") -> str | None:
    """A usable API key or None (no key). An empty or blank key is refused: it would make an empty
    `x-api-key` header pass the gate. Surrounding whitespace is refused too (headers are compared stripped)."""
    if key is None:
        return None
    if not isinstance(key, str) or not key.strip():
        raise ServeError(f"{where} is empty or blank; give a real key, or leave it unset for no authentication (loopback only)")
    if key != key.strip() or any(ord(c) < 0x21 or ord(c) > 0x7E for c in key):
        raise ServeError(f"{where} must be printable ASCII without spaces (it travels in an HTTP header)")
    return key
