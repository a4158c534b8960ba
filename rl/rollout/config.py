"""The `rollout` section of the run config: the vLLM rollout workers and the agent loop's settings.

Declared here, once, with every key's default; rl/config.py composes it into RunConfig (YAML, dotted
overrides, coercion, cross-section checks). The engine's `EngineConfig`, the agent loop's `LoopSettings` and
`jointrl serve`'s settings take their defaults from these fields. Nothing here starts an engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

def default_thinking_budgets() -> dict[str, int]:
    """Tokens of thinking per tier (`rollout.thinking_budgets`'s default; -1 = no cap)."""
    return {"low": 64, "high": 256, "max": -1}


@dataclass
class RolloutSection:
    """vLLM rollout workers."""

    num_workers: int = 1
    dtype: Literal["float32", "bfloat16", "auto"] = "auto"  # auto: float32 where vLLM's kernels allow it
    max_model_len: int = 2048
    max_new_tokens_per_turn: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    enforce_eager: bool = True
    kv_cache_gib: float = 1.0
    thinking_budgets: dict[str, int] = field(default_factory=lambda: default_thinking_budgets())  # -1 = no cap
    max_concurrent_episodes: int = 32
    gpu_memory_utilization: float = 0.85
    # Per-request sampling seeds derived from (run seed, step, task, sample, turn), so a resumed run
    # replays the same rollouts. On CPU this turns chunked prefill off (and prefix caching for hybrid
    # models: ~1.2x slower rollouts there); see docs/rollout.md "Determinism".
    seeded_requests: bool = True
    # GPU paths (docs/training.md "GPU paths"; untested on a GPU in this project so far). GPUs each
    # worker asks Ray for: 0 = a CPU engine; whole numbers give each worker GPUs of its own, apart from
    # the trainer's (trainer.gpus_per_rank); a fraction lets roles share one GPU (not with NCCL sync).
    gpus_per_worker: float = 0.0
    # torch / OpenMP threads of each CPU engine. Ray starts a num_cpus=1 actor with OMP_NUM_THREADS=1;
    # in sync mode the engines idle while the trainer steps, so a 2-core machine can give each phase both
    # cores (docs/models.md, "RolloutWorker vs bare vLLM"). More threads than free cores make OpenMP's
    # spin-waiting threads slower than one thread, so the default stays 1.
    threads_per_worker: int = 1
    tensor_parallel_size: int = 1  # vLLM TP ranks per worker; > 1 is GPU only and needs gpus_per_worker = tensor_parallel_size
    # A custom Ray resource every rollout worker requires ("" = none): only nodes started with it
    # (`ray start --resources '{"rollout_node": 1}'`) host workers. Each worker takes
    # NODE_RESOURCE_UNIT of it, so the node's amount does not limit how many it hosts.
    node_resource: str = ""
    # Images one episode may show the policy (task views, tool results; docs/multimodal.md). 0: text only,
    # and messages' images reach the policy as a one-line text note. > 0 needs a model with a vision tower
    # (HybridMoe) and the jointrl chat codec; at most jointrl.limits.MAX_IMAGES_PER_PROMPT.
    max_images_per_prompt: int = 0
    # What an image shows the policy: "real" pixels, or "blank" (every pixel mid-grey, same size and
    # placeholders): the control arm that measures whether the policy uses what it sees.
    image_pixels: Literal["real", "blank"] = "real"
    # Long episodes (docs/rollout.md, "Long episodes"). What an episode keeps in context once its history passes
    # context_budget_tokens: full (everything; the episode ends as truncated when max_model_len is reached),
    # window (drop the oldest whole turns) or summarize (the policy writes a summary of its progress, and the
    # episode goes on from the system prompt, the task and that summary); rl/rollout/context.py's registry.
    context: str = "full"
    context_domains: dict[str, str] = field(default_factory=dict)  # domain -> strategy, overriding rollout.context
    context_budget_tokens: int = 0  # 0: max_model_len - max_new_tokens_per_turn (twice that for summarize)
    context_keep_turns: int = 0  # window: keep the most recent N turns; 0: the turns that fit half the budget
    # Partial rollouts: a step stops generating once its episodes have generated step_token_budget tokens or its
    # generation has run step_time_budget_s seconds, whichever comes first; the episodes still running pause and
    # continue in the next step under the new weights (rl/rollout/partial.py).
    partial: Literal["on", "off"] = "off"
    step_token_budget: int = 0  # 0 = off; with partial on, this or step_time_budget_s must be on
    step_time_budget_s: float | None = None  # seconds of generation per step; 0 or null = off; read with partial on only
