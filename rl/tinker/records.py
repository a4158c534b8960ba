"""The JSON request bodies of the Tinker routes this service answers, as the `tinker` SDK 0.38.0 sends them.

Each is a frozen pydantic model that ignores fields it does not read (the SDK adds telemetry-ish
fields such as `type`, `user_metadata`, `ttl_seconds` that change nothing here) and refuses wrong
types with 400 through the app's validation handler. Only the fields the service acts on are named;
docs/tinker.md lists which request options are refused.

What this module does not do: decode the protobuf `forward_backward` body (rl/tinker/wire.py) or
check meaning against the model (rl/tinker/service.py).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, protected_namespaces=())


class SessionBody(_Body):
    session_id: str


class CreateModelBody(_Body):
    class Lora(_Body):
        rank: int
        seed: Optional[int] = None
        train_unembed: bool = True
        train_mlp: bool = True
        train_attn: bool = True

    class Optimizer(_Body):
        type: str = "adamw"

    session_id: str
    model_seq_id: int = Field(ge=0, lt=1 << 31)
    base_model: str
    lora_config: Optional[Lora] = None
    optimizer_config: Optimizer = Optimizer()


class ModelBody(_Body):
    model_id: str


class AdamBody(_Body):
    learning_rate: float = 1e-4
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0)
    type: Optional[str] = None  # non-Adam families carry their name here


class OptimStepBody(_Body):
    model_id: str
    adam_params: Optional[AdamBody] = None
    optimizer_params: Optional[dict[str, Any]] = None


class SaveWeightsBody(_Body):
    model_id: str
    path: Optional[str] = None
    overwrite: bool = False


class SaveForSamplerBody(_Body):
    model_id: str
    path: Optional[str] = None
    kind: str = "snapshot"


class LoadWeightsBody(_Body):
    model_id: Optional[str] = None
    session_id: Optional[str] = None
    model_seq_id: Optional[int] = None
    path: str
    optimizer: bool = False


class CreateSamplingBody(_Body):
    session_id: str
    sampling_session_seq_id: int = 0
    model_path: Optional[str] = None
    base_model: Optional[str] = None


class Chunk(_Body):
    type: str = "encoded_text"
    tokens: list[int] = []


class ModelInputBody(_Body):
    chunks: list[Chunk]


class SamplingParamsBody(_Body):
    max_tokens: Optional[int] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], list[int], None] = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class SampleBody(_Body):
    num_samples: int = 1
    prompt: ModelInputBody
    sampling_params: SamplingParamsBody
    base_model: Optional[str] = None
    model_path: Optional[str] = None
    sampling_session_id: Optional[str] = None
    seq_id: Optional[int] = None
    prompt_logprobs: Optional[bool] = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: Optional[dict[str, Any]] = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: Optional[int] = None
    record_stability_info: Optional[bool] = None


class RetrieveBody(_Body):
    request_id: str
    allow_metadata_only: bool = False


Status = Literal["active", "paused_capacity", "paused_rate_limit"]
