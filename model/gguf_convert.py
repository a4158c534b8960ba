"""GGUF Llama file -> plain HF Llama checkpoint directory (fp32 safetensors, config, tokenizer, generation config).

What it does
- Dequantises every tensor with the `gguf` package (`gguf.quants.dequantize`: Q4_0/Q4_1/Q8_0/K-quants/F16/...
  to float32 numpy) and renames it from llama.cpp's names (`blk.N.attn_q.weight`) to transformers' Llama names.
- Undoes the row permutation llama.cpp's converter applies to `attn_q` / `attn_k` (it interleaves the two
  rotary halves of each head for its own RoPE kernel; llama.cpp `convert_hf_to_gguf.py`, `LlamaModel.permute`).
- Builds `LlamaConfig` from the file's `llama.*` metadata; embeddings are tied when the file has no
  `output.weight` (llama.cpp writes none for tied models).
- The tokenizer (vocab, merges, special tokens, the model's own `chat_template`) goes through transformers'
  GGUF tokenizer conversion (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) and is saved next to the
  weights; `generation_config.json` carries the file's bos / eos / pad ids.

What it does not do
- Architectures other than `llama`, RoPE scaling variants, or keeping the quantised weights: the result is a
  dense fp32 checkpoint any HF / vLLM loader reads. It does not download anything (model/hub.py does).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# llama.cpp tensor names -> transformers' Llama names (per-layer ones carry `{i}`).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(?P<i>\d+)\.(?P<part>[a-z_]+)\.weight$")


class GGUFConvertError(ValueError):
    """The GGUF file is not one this converter handles; the message names the field."""


@dataclass(frozen=True)
class ConvertStats:
    """What a conversion wrote: tensor and parameter counts, and the quantisation types it dequantised."""

    num_tensors: int
    num_params: int
    quant_types: tuple[str, ...]
    seconds: float


def unpermute_rotary_rows(w_OI: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_head)`: rows (h, 2, d/2) were written as (h, d/2, 2)."""
    d_half = w_OI.shape[0] // n_head // 2
    return w_OI.reshape(n_head, d_half, 2, *w_OI.shape[1:]).swapaxes(1, 2).reshape(w_OI.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise GGUFConvertError(f"GGUF metadata has no {key!r}")
        return default
    return f.contents()


def read_llama_config(reader, tensor_names: set[str]):
    """`LlamaConfig` from a GGUF file's metadata (refuses other architectures and RoPE scaling by name)."""
    from transformers import LlamaConfig

    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFConvertError(f"general.architecture is {arch!r}; this converter handles only 'llama'")
    for key in reader.fields:
        if key.startswith("llama.rope.scaling."):
            raise GGUFConvertError(f"GGUF metadata {key!r}: RoPE scaling is not supported by this converter")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    vocab = int(_field(reader, "llama.vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data)))
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0))},
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", eos)),
        eos_token_id=eos,
        pad_token_id=int(_field(reader, "tokenizer.ggml.padding_token_id", eos)),
        dtype="float32",
        architectures=["LlamaForCausalLM"],
    )


def hf_name(gguf_name: str) -> str:
    """transformers' Llama name of a llama.cpp tensor name (GGUFConvertError for one it does not know)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if not m or m.group("part") not in _LAYER_NAMES:
        raise GGUFConvertError(f"GGUF tensor {gguf_name!r} has no Llama counterpart in this converter")
    return f"model.layers.{m.group('i')}.{_LAYER_NAMES[m.group('part')]}.weight"


def convert_gguf_llama(gguf_path: str | Path, out_dir: str | Path) -> ConvertStats:
    """Write a HF Llama checkpoint for `gguf_path` into `out_dir` (created; existing files are overwritten)."""
    import time

    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig

    t0 = time.perf_counter()
    gguf_path, out = Path(gguf_path), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(gguf_path)
    names = {t.name for t in reader.tensors}
    config = read_llama_config(reader, names)
    tensors: dict[str, torch.Tensor] = {}
    quant_types: set[str] = set()
    for t in reader.tensors:
        # a copy: F32 tensors come back as read-only views of the reader's memory map
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        quant_types.add(t.tensor_type.name)
        if ".attn_q." in t.name:
            w = unpermute_rotary_rows(w, config.num_attention_heads)
        elif ".attn_k." in t.name:
            w = unpermute_rotary_rows(w, config.num_key_value_heads)
        tensors[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    want = 3 + 9 * config.num_hidden_layers - (1 if config.tie_word_embeddings else 0)
    if len(tensors) != want:
        raise GGUFConvertError(f"{gguf_path.name}: {len(tensors)} tensors, a Llama of {config.num_hidden_layers} layers has {want}")
    emb = tensors["model.embed_tokens.weight"]
    if tuple(emb.shape) != (config.vocab_size, config.hidden_size):
        raise GGUFConvertError(f"token_embd.weight is {tuple(emb.shape)}, metadata says vocab {config.vocab_size} x hidden {config.hidden_size}")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tok.chat_template:
        raise GGUFConvertError(f"{gguf_path.name} carries no tokenizer.chat_template")
    tok.model_max_length = config.max_position_embeddings
    tok.save_pretrained(out)
    # vLLM and the trainer stop at config / generation_config eos ids, the chat codec at the tokenizer's: they must agree.
    if tok.convert_tokens_to_ids(tok.eos_token) != config.eos_token_id:
        raise GGUFConvertError(f"tokenizer eos {tok.eos_token!r} is not tokenizer.ggml.eos_token_id {config.eos_token_id}")
    return ConvertStats(num_tensors=len(tensors), num_params=sum(v.numel() for v in tensors.values()),
                        quant_types=tuple(sorted(quant_types)), seconds=time.perf_counter() - t0)
