"""Sparse upcycling: a dense Llama checkpoint -> a Mixtral-architecture MoE that computes the same function.

Sparse Upcycling (Komatsuzaki et al. 2022, arXiv:2212.05055): every MoE layer's experts start as copies of
the dense MLP and the router is new; attention, norms and embeddings are copied. Here the result is a
`MixtralForCausalLM` checkpoint (Llama + routed SwiGLU experts), which transformers and vLLM both serve
natively (vLLM with its fused-MoE kernels, on CPU the grouped-GEMM `CPUUnquantizedExperts`).

Why the MoE equals the dense model at step 0, exactly: Mixtral's router takes softmax over all experts,
keeps the top k and renormalises them to sum to 1 (`MixtralTopKRouter`), so a token's output is
sum_i w_i MLP_i(x) with sum_i w_i = 1; with MLP_i = MLP for every i that is MLP(x), whatever the router
says. Only fp32 rounding of the weighted sum differs (measured in docs/models.md).

Why the router is small and random, not zero: with equal experts a zero router ties all logits, top-k
then always picks the same k experts, the others never see a token, and the experts chosen get the
same gradient up to their weights 1/k: they would stay copies of each other. Small random router rows
(std `router_init_std`) send different tokens to different experts from the first step, so their
gradients differ and the experts diverge; the output is unchanged because the experts are equal. At
step 0 the router's own gradient from the loss is exactly zero (d out / d logit_j = w_j (MLP_j(x) -
out) = 0 when all experts are equal); it becomes non-zero as soon as the experts differ, and the
load-balance loss drives it from the start.

What it does not do: fine-grained or partial upcycling (splitting the MLP, upcycling some layers),
shared experts, or dense models other than Llama-architecture ones with SwiGLU MLPs and no biases.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

# Files of a dense checkpoint that are not weights or config and travel to the MoE unchanged.
_CARRIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
_MLP_TO_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # Mixtral's on-disk expert names


class UpcycleError(ValueError):
    """The dense checkpoint or the spec cannot be upcycled; the message names the field."""


@dataclass(frozen=True)
class UpcycleSpec:
    """How to upcycle. Sizing for 2 CPU cores / 24 GiB (4 experts, top-2): docs/models.md, "Why this size"."""

    num_experts: int = 4
    top_k: int = 2  # >= 2: with top-1 the renormalised weight is always 1 and the loss never reaches the router
    router_init_std: float = 0.02  # small random router rows break the experts' symmetry (module docstring)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_experts < 2:
            raise UpcycleError(f"UpcycleSpec.num_experts must be >= 2, got {self.num_experts}")
        if not 2 <= self.top_k <= self.num_experts:
            raise UpcycleError(f"UpcycleSpec.top_k must be in [2, num_experts={self.num_experts}], got {self.top_k} "
                               "(top-1 with renormalised weights gives the router no gradient from the loss)")
        if not self.router_init_std > 0:
            raise UpcycleError(f"UpcycleSpec.router_init_std must be > 0, got {self.router_init_std} "
                               "(a zero router ties every expert: top-k always picks the same ones)")


def mixtral_config_for(dense: dict, spec: UpcycleSpec):
    """The `MixtralConfig` whose attention, norms and embeddings are those of the dense Llama `config.json` dict."""
    from transformers import MixtralConfig

    if dense.get("model_type") != "llama":
        raise UpcycleError(f"config.json model_type is {dense.get('model_type')!r}; upcycling handles 'llama'")
    for key, want in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if dense.get(key, want) != want:
            raise UpcycleError(f"config.json {key}={dense[key]!r}: Mixtral has {key}={want!r}, the MoE would not equal the dense model")
    rope = dense.get("rope_parameters") or {"rope_type": "default", "rope_theta": dense.get("rope_theta", 10000.0)}
    heads = dense["num_attention_heads"]
    return MixtralConfig(
        vocab_size=dense["vocab_size"], hidden_size=dense["hidden_size"], intermediate_size=dense["intermediate_size"],
        num_hidden_layers=dense["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=dense.get("num_key_value_heads", heads),
        head_dim=dense.get("head_dim") or dense["hidden_size"] // heads,
        max_position_embeddings=dense["max_position_embeddings"], rms_norm_eps=dense["rms_norm_eps"],
        rope_parameters=dict(rope), hidden_act="silu", attention_dropout=dense.get("attention_dropout", 0.0),
        tie_word_embeddings=bool(dense.get("tie_word_embeddings", False)), initializer_range=dense.get("initializer_range", 0.02),
        bos_token_id=dense.get("bos_token_id"), eos_token_id=dense.get("eos_token_id"), pad_token_id=dense.get("pad_token_id"),
        num_local_experts=spec.num_experts, num_experts_per_tok=spec.top_k, sliding_window=None,
        dtype=dense.get("dtype") or dense.get("torch_dtype") or "float32", architectures=["MixtralForCausalLM"],
    )


def _dense_tensors(dense_dir: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(dense_dir.glob("*.safetensors"))
    if not files:
        raise UpcycleError(f"{dense_dir}: no *.safetensors files")
    out: dict = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def upcycle_llama_to_mixtral(dense_dir: str | Path, out_dir: str | Path, spec: UpcycleSpec = UpcycleSpec()) -> Path:
    """Write the upcycled Mixtral checkpoint of the dense Llama checkpoint `dense_dir` into `out_dir`.

    Tensors are written in Mixtral's checkpoint layout (`block_sparse_moe.gate`, `experts.{e}.w1/w3/w2`),
    which transformers 5 fuses on load and vLLM's Mixtral loader reads directly; dtype as in the dense files.
    Tied embeddings stay tied (both libraries' Mixtral honour `tie_word_embeddings`), so no `lm_head` is added.
    """
    import torch
    from safetensors.torch import save_file

    dense_dir, out = Path(dense_dir), Path(out_dir)
    dense_cfg = json.loads((dense_dir / "config.json").read_text())
    config = mixtral_config_for(dense_cfg, spec)
    src = _dense_tensors(dense_dir)
    gen = torch.Generator().manual_seed(spec.seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, w in src.items():
        parts = name.split(".")
        if len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[3] == "mlp":  # model.layers.{i}.mlp.{proj}.weight
            i, proj = parts[2], parts[4]
            if proj not in _MLP_TO_EXPERT:
                raise UpcycleError(f"dense tensor {name!r}: unknown MLP projection {proj!r}")
            for e in range(spec.num_experts):
                tensors[f"model.layers.{i}.block_sparse_moe.experts.{e}.{_MLP_TO_EXPERT[proj]}.weight"] = w.clone()
        else:
            tensors[name] = w
    for i in range(config.num_hidden_layers):
        missing = [p for p in _MLP_TO_EXPERT if f"model.layers.{i}.mlp.{p}.weight" not in src]
        if missing:
            raise UpcycleError(f"dense checkpoint has no model.layers.{i}.mlp.{missing[0]}.weight")
        router_EH = torch.randn(spec.num_experts, config.hidden_size, generator=gen) * spec.router_init_std
        dtype = src[f"model.layers.{i}.mlp.gate_proj.weight"].dtype
        tensors[f"model.layers.{i}.block_sparse_moe.gate.weight"] = router_EH.to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    for f in _CARRIED_FILES:
        if (dense_dir / f).is_file():
            shutil.copy(dense_dir / f, out / f)
    return out
