"""`jointrl serve`: the OpenAI chat-completions and Responses APIs and Anthropic's Messages API over one in-process vLLM engine.

Modules, by concern:
- `settings`: `ServeSettings` and the CLI flags generated from it (light; the top-level CLI imports it).
- `core`: the internal request/reply model both protocols translate to and from, errors, token reuse across turns.
- `codec`: the checkpoint's chat format (rl/rollout/codec, picked as training picks it) seen from serving:
  prompts, parsing, the stream split, tool-call forcing, defusing client text.
- `engine`: `StreamingEngine`, the rollout engine plus incremental outputs and abort.
- `service`: `ChatService` (streamed generation, tool_choice forcing, recording).
- `capacity`: `Admission` (the bounded queue in front of the engine, 429 past it) and `ServeMetrics` (Prometheus).
- `records`: the token-level JSONL records and the readers that rebuild RL sequences from them.
- `openai`, `anthropic`, `responses`: the wire protocols (chat completions, Messages, Responses).
- `app`: the HTTP app, auth and body limits, model preparation, the entry points.

Names are imported lazily (`from rl.serve import X` loads only the module that defines X).
"""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ServeSettings": "settings", "ServeError": "settings", "TIERS": "settings", "add_arguments": "settings", "from_args": "settings",
    "ApiError": "core", "ChatRequest": "core", "ToolChoice": "core", "Completion": "core", "Choice": "core", "TokenHistory": "core",
    "PromptTokens": "core", "encode_prompt": "core", "finish_choice": "core", "token_text_ends": "core",
    "ServeCodec": "codec", "StreamFields": "codec", "build_codec": "codec",
    "ServeRecord": "records", "RecordedChoice": "records", "Recorder": "records", "read_records": "records",
    "recorded_sequence": "records", "RecordedSequence": "records", "RecordedImage": "records", "load_image": "records",
    "recorded_episode": "records", "RecordedEpisode": "records", "training_episode": "records",
    "StreamingEngine": "engine", "StreamDelta": "engine",
    "ChatService": "service", "Admission": "capacity", "ServeMetrics": "capacity", "Prepared": "service", "TextDelta": "service", "Finished": "service",
    "parse_chat_request": "openai", "completion_json": "openai", "stream_chunks": "openai", "message_json": "records",
    "usage_json": "openai", "parse_message": "openai",
    "parse_messages_request": "anthropic", "nearest_tier": "anthropic",
    "parse_responses_request": "responses", "ResponseStore": "responses",
    "create_app": "app", "prepare_model": "app", "build_service": "app", "engine_config": "app", "main": "app",
    "main_from_args": "app", "serve": "app",
}


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'rl.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rl.serve.{mod}"), name)


__all__ = sorted(_WHERE)
