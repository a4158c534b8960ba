"""MXFP4 checkpoints and MXFP4 weight-sync payloads, on top of the codec in `model.mxfp4`.

What it does
    * `export_mxfp4(src_dir, out_dir, include)` reads a `save_pretrained` checkpoint (config.json +
      one or several *.safetensors shards) and writes the same checkpoint with the selected weights
      stored as `<name>_blocks` (uint8 [..., G, 16]) and `<name>_scales` (uint8 [..., G]) — the
      gpt-oss layout — and a `quantization_config` ({"quant_method": "mxfp4", ...}) in config.json.
      Every other tensor is copied unchanged; non-weight files (tokenizer, generation config) too.
    * `load_mxfp4_state_dict(dir)` dequantizes back to a plain `{name: tensor}` in checkpoint names;
      `load_mxfp4_model(dir)` returns a working transformers model (for this project's
      `HybridMoeForCausalLM` or any Auto-registered causal LM), dequantized on CPU.
    * `pack_for_sync` / `unpack_from_sync` / `count_sync_bytes`: the trainer -> rollout sync option
      `trainer.sync_format = "mxfp4"`, with bytes-moved accounting against bf16 and fp32.
    * `compare_models`: logit error, next-token agreement and logprob gap between two models.

Which tensors are quantized (`include`)
    "experts":    tensors whose name contains "experts" (fused 3-D [E, out, in] or per-expert 2-D
                  [out, in]); this is what gpt-oss ships and what the seed articles describe.
    "all_linear": additionally every other 2-D `*.weight`, except HIGH_PRECISION_PATTERNS.
    Blocks always run along the last dimension, which for an nn.Linear weight [out, in] is the input
    (reduction) dimension, so one scale covers 32 products that are summed together.
    Always kept in high precision: the MoE router (`mlp.gate`), the shared-expert gate, the DSA
    indexer and the delta-rule decay/beta projection (they SELECT: a small error flips which
    experts or keys are chosen, a discrete change far larger than the error itself), embeddings and
    the LM head (one row per token, read directly into the residual stream / logits, and a small
    share of the parameters in a big MoE), norms, biases and other 1-D tensors (tiny, and they
    scale whole activations). A weight whose last dimension is not a multiple of 32 is also kept,
    and listed in the report with the reason (the codec refuses to pad, see `model.mxfp4`).

What it does not do
    No MXFP4 matmul: loading dequantizes to the requested float dtype. It does not register a
    transformers quantizer: `AutoModelForCausalLM.from_pretrained` on an exported directory would
    hand it to transformers' gpt-oss-specific MXFP4 quantizer; use `load_mxfp4_model`.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from model.mxfp4 import BLOCK_SIZE, BYTES_PER_BLOCK, MXFP4Error, dequantize_mxfp4, quantize_mxfp4

IncludeMode = Literal["experts", "all_linear"]
INCLUDE_MODES: tuple[str, ...] = ("experts", "all_linear")
SyncFormat = Literal["fp32", "bf16", "mxfp4"]

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
_META_KEY = "jointrl.mxfp4.dtypes"  # safetensors metadata: JSON {name: original dtype}

# Weights that stay in high precision under include="all_linear" (see the module docstring for why).
HIGH_PRECISION_PATTERNS: tuple[str, ...] = (
    r"(^|\.)embed_tokens\.", r"(^|\.)lm_head\.", r"(^|\.)patch_embed\.",  # token/patch embeddings, LM head
    r"\.mlp\.gate\.", r"\.router\.", r"shared_expert_gate\.", r"e_score_correction_bias",  # routers
    r"\.indexer\.",  # DSA lightning indexer: picks the top-k keys
    r"\.in_proj_ba\.",  # gated delta rule beta / decay projection
    r"norm",  # any normalisation weight
)
_HIGH_PRECISION_RE = re.compile("|".join(HIGH_PRECISION_PATTERNS))
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


class MXFP4ExportError(ValueError):
    """A checkpoint that cannot be exported or loaded; the message names the file or tensor."""


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


# ----------------------------------------------------------------------------- which tensors
@dataclass(frozen=True)
class TensorPlan:
    """What happens to one tensor: quantize or keep, and why it is kept."""

    quantize: bool
    reason: str  # "" when quantized


def plan_tensor(name: str, tensor: torch.Tensor, include: IncludeMode = "experts") -> TensorPlan:
    """Decide whether `name` is stored as MXFP4 under `include` (the policy shared by export and sync)."""
    if include not in INCLUDE_MODES:
        raise ValueError(f"include must be one of {INCLUDE_MODES}, got {include!r}")
    if not tensor.is_floating_point():
        return TensorPlan(False, f"dtype {_dtype_name(tensor.dtype)} is not floating")
    is_expert = "experts" in name
    if is_expert:
        if tensor.dim() not in (2, 3):
            return TensorPlan(False, f"expert tensor with {tensor.dim()} dims (expected 2-D or fused 3-D)")
    elif include == "experts":
        return TensorPlan(False, "not an expert weight")
    else:
        if tensor.dim() != 2 or not name.endswith(".weight"):
            return TensorPlan(False, "not a 2-D linear weight")
        if _HIGH_PRECISION_RE.search(name):
            return TensorPlan(False, "kept high precision (router / indexer / gate / embedding / norm)")
    k = tensor.shape[-1]
    if k % BLOCK_SIZE != 0:
        return TensorPlan(False, f"last dimension {k} is not a multiple of {BLOCK_SIZE}")
    return TensorPlan(True, "")


# ----------------------------------------------------------------------------- export
@dataclass(frozen=True)
class ExportReport:
    """What `export_mxfp4` wrote. Byte counts are tensor payload bytes (safetensors headers excluded)."""

    out_dir: str
    include: str
    quantized: tuple[str, ...]
    kept: tuple[tuple[str, str], ...]  # (name, reason) for every tensor left as it was
    params_total: int
    params_quantized: int
    bytes_in: int  # payload bytes of the source tensors as stored
    bytes_out: int  # payload bytes written
    bytes_fp16: int  # every tensor as 2-byte floats (the usual deployment baseline)
    file_bytes_out: int  # size on disk of the written safetensors files

    @property
    def ratio_vs_fp16(self) -> float:
        return self.bytes_out / self.bytes_fp16 if self.bytes_fp16 else float("nan")

    def summary(self) -> str:
        n_skip = sum(1 for _, r in self.kept if "multiple of" in r)
        return (f"MXFP4 export ({self.include}) -> {self.out_dir}\n"
                f"  tensors quantized: {len(self.quantized)} ({self.params_quantized / max(self.params_total, 1):.1%} "
                f"of {self.params_total:,} params); kept: {len(self.kept)} ({n_skip} for a last dim not divisible by 32)\n"
                f"  payload bytes: {self.bytes_out:,} vs source {self.bytes_in:,} and fp16 {self.bytes_fp16:,} "
                f"({self.ratio_vs_fp16:.3f}x fp16); safetensors on disk: {self.file_bytes_out:,}")


def _shard_files(src: Path) -> list[str]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted(set(weight_map.values()))
    files = sorted(p.name for p in src.glob("*.safetensors"))
    if not files:
        raise MXFP4ExportError(f"{src}: no *.safetensors files (expected a save_pretrained checkpoint)")
    return files


def _read_config(src: Path) -> dict:
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise MXFP4ExportError(f"{src}: no config.json (expected a save_pretrained checkpoint directory)")
    return json.loads(cfg_path.read_text())


def export_mxfp4(src_dir: str | Path, out_dir: str | Path, include: IncludeMode = "experts", *,
                 rest_dtype: torch.dtype | None = None) -> ExportReport:
    """Write an MXFP4 copy of the checkpoint in `src_dir` to `out_dir` (created; must be empty if it exists).

    `rest_dtype` (e.g. torch.bfloat16) casts the floating tensors that are NOT quantized, as gpt-oss
    ships them; None keeps them exactly as stored.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    if include not in INCLUDE_MODES:
        raise ValueError(f"include must be one of {INCLUDE_MODES}, got {include!r}")
    if rest_dtype is not None and rest_dtype not in _DTYPES.values():
        raise ValueError(f"rest_dtype must be one of {sorted(_DTYPES)} or None, got {rest_dtype}")
    src, out = Path(src_dir), Path(out_dir)
    config = _read_config(src)
    if config.get("quantization_config"):
        raise MXFP4ExportError(f"{src}: already quantized ({config['quantization_config'].get('quant_method')}); "
                               f"export from a full-precision checkpoint")
    if out.resolve() == src.resolve():
        raise MXFP4ExportError("out_dir must differ from src_dir")
    if out.exists() and any(out.iterdir()):
        raise MXFP4ExportError(f"{out}: exists and is not empty; refusing to overwrite")
    out.mkdir(parents=True, exist_ok=True)

    quantized: list[str] = []
    kept: list[tuple[str, str]] = []
    params_total = params_q = bytes_in = bytes_out = bytes_fp16 = 0
    shards = _shard_files(src)
    weight_map: dict[str, str] = {}
    for shard in shards:
        out_tensors: dict[str, torch.Tensor] = {}
        dtypes: dict[str, str] = {}
        with safe_open(str(src / shard), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                n = t.numel()
                params_total += n
                bytes_in += n * t.element_size()
                bytes_fp16 += n * 2
                if name.endswith(BLOCKS_SUFFIX) or name.endswith(SCALES_SUFFIX):
                    raise MXFP4ExportError(f"{src / shard}: tensor {name!r} already looks MXFP4-packed")
                plan = plan_tensor(name, t, include)
                if not plan.quantize:
                    kept.append((name, plan.reason))
                    if rest_dtype is not None and t.is_floating_point():
                        t = t.to(rest_dtype)
                    out_tensors[name] = t
                    bytes_out += n * t.element_size()
                    continue
                try:
                    blocks, scales = quantize_mxfp4(t, nonfinite="raise")
                except MXFP4Error as e:  # a NaN/Inf weight means a broken checkpoint: say which tensor
                    raise MXFP4ExportError(f"{src / shard}: tensor {name!r}: {e}") from e
                out_tensors[name + BLOCKS_SUFFIX] = blocks
                out_tensors[name + SCALES_SUFFIX] = scales
                dtypes[name] = _dtype_name(t.dtype)
                quantized.append(name)
                params_q += n
                bytes_out += n // BLOCK_SIZE * BYTES_PER_BLOCK
        save_file(out_tensors, str(out / shard), metadata={"format": "pt", _META_KEY: json.dumps(dtypes)})
        weight_map.update({k: shard for k in out_tensors})

    if (src / "model.safetensors.index.json").is_file():
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": bytes_out}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "format": "ocp_mx_v1.0",
        "block_size": BLOCK_SIZE,
        "element_dtype": "e2m1",
        "scale_dtype": "e8m0",
        "scale_bias": 127,
        "rounding": "nearest_even",
        "layout": "name_blocks uint8 [..., G, 16] (first element in the low nibble), name_scales uint8 [..., G]",
        "include": include,
        "rest_dtype": None if rest_dtype is None else _dtype_name(rest_dtype),
        "modules_to_not_convert": sorted({re.sub(r"\.\d+\.", ".*.", n) for n, _ in kept}),
        "num_quantized_tensors": len(quantized),
        "producer": "jointrl model.mxfp4_export",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=False) + "\n")
    for p in src.iterdir():  # tokenizer, generation config, chat template, ...
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(p, out / p.name)
    file_bytes = sum((out / s).stat().st_size for s in shards)
    return ExportReport(out_dir=str(out), include=include, quantized=tuple(quantized), kept=tuple(kept),
                        params_total=params_total, params_quantized=params_q, bytes_in=bytes_in,
                        bytes_out=bytes_out, bytes_fp16=bytes_fp16, file_bytes_out=file_bytes)


def resolve_checkpoint_dir(src: str | Path) -> Path:
    """A checkpoint dir as given, or in a run dir the newest sub-directory holding config.json + safetensors."""
    p = Path(src)
    if not p.exists():
        raise MXFP4ExportError(f"{p}: no such file or directory")
    if (p / "config.json").is_file():
        return p
    cands = [c.parent for c in p.rglob("config.json") if any(c.parent.glob("*.safetensors"))]
    if not cands:
        raise MXFP4ExportError(f"{p}: neither a checkpoint (config.json + *.safetensors) nor a run dir containing one")
    return max(cands, key=lambda d: max(f.stat().st_mtime for f in d.glob("*.safetensors")))


def main_export(src: str, out: str, include: str = "experts", rest_dtype: str | None = None) -> int:
    """`jointrl export --mxfp4 RUN_OR_CKPT OUT [--include experts|all_linear]`: export and print a summary.

    `rest_dtype` ("bfloat16", "float16", "float32" or None = as stored) for the tensors kept unquantized.
    """
    import sys

    try:
        if rest_dtype is not None and rest_dtype not in _DTYPES:
            raise MXFP4ExportError(f"rest_dtype must be one of {sorted(_DTYPES)}, got {rest_dtype!r}")
        if include not in INCLUDE_MODES:
            raise MXFP4ExportError(f"include must be one of {INCLUDE_MODES}, got {include!r}")
        ckpt = resolve_checkpoint_dir(src)
        if ckpt != Path(src):
            print(f"using checkpoint {ckpt}")
        report = export_mxfp4(ckpt, out, include, rest_dtype=None if rest_dtype is None else _DTYPES[rest_dtype])  # type: ignore[arg-type]
    except (MXFP4ExportError, MXFP4Error) as e:
        print(f"jointrl export: error: {e}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0


# ----------------------------------------------------------------------------- load
def is_mxfp4_checkpoint(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    return cfg.is_file() and (json.loads(cfg.read_text()).get("quantization_config") or {}).get("quant_method") == "mxfp4"


def load_mxfp4_state_dict(path: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors with every `X_blocks`/`X_scales` pair dequantized back to `X`.

    Dequantized tensors get their original dtype (recorded at export) unless `dtype` is given;
    other floating tensors are cast to `dtype` only when it is given.
    """
    from safetensors import safe_open

    src = Path(path)
    if not is_mxfp4_checkpoint(src):
        raise MXFP4ExportError(f"{src}: not an MXFP4 checkpoint (config.json has no quantization_config with "
                               f"quant_method 'mxfp4')")
    sd: dict[str, torch.Tensor] = {}
    for shard in _shard_files(src):
        with safe_open(str(src / shard), framework="pt") as f:
            meta = f.metadata() or {}
            dtypes = json.loads(meta.get(_META_KEY, "{}"))
            names = set(f.keys())
            for name in sorted(names):
                if name.endswith(SCALES_SUFFIX) and name[: -len(SCALES_SUFFIX)] + BLOCKS_SUFFIX in names:
                    continue
                if name.endswith(BLOCKS_SUFFIX):
                    base = name[: -len(BLOCKS_SUFFIX)]
                    if base + SCALES_SUFFIX not in names:
                        raise MXFP4ExportError(f"{src / shard}: {name!r} has no matching {base + SCALES_SUFFIX!r}")
                    want = dtype or _DTYPES.get(dtypes.get(base, "float32"), torch.float32)
                    sd[base] = dequantize_mxfp4(f.get_tensor(name), f.get_tensor(base + SCALES_SUFFIX), dtype=want)
                else:
                    t = f.get_tensor(name)
                    sd[name] = t.to(dtype) if (dtype is not None and t.is_floating_point()) else t
    return sd


def load_mxfp4_model(path: str | Path, dtype: torch.dtype | None = None):
    """A transformers causal LM with the dequantized weights of an MXFP4 checkpoint (eval mode, CPU).

    Goes through a plain temporary checkpoint and `from_pretrained`, so the model's own checkpoint
    conversion (per-expert tensors on disk -> fused experts in memory) is applied exactly as for a
    normal checkpoint. `import model` registers this project's HybridMoe with the Auto classes.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    import model  # noqa: F401  (registers hybrid_moe with AutoConfig / AutoModelForCausalLM)

    src = Path(path)
    sd = load_mxfp4_state_dict(src, dtype=dtype)
    config = _read_config(src)
    config.pop("quantization_config", None)
    with tempfile.TemporaryDirectory(prefix="mxfp4_load_") as tmp:
        t = Path(tmp)
        (t / "config.json").write_text(json.dumps(config))
        if (src / "generation_config.json").is_file():
            shutil.copy2(src / "generation_config.json", t / "generation_config.json")
        save_file({k: v.contiguous() for k, v in sd.items()}, str(t / "model.safetensors"), metadata={"format": "pt"})
        del sd
        kw = {"dtype": dtype} if dtype is not None else {}
        m = AutoModelForCausalLM.from_pretrained(str(t), **kw)
    return m.eval()


# ----------------------------------------------------------------------------- weight sync
@dataclass(frozen=True)
class SyncPayload:
    """One tensor on its way from trainer to rollout engine.

    fmt "mxfp4": `blocks` uint8 [..., G, 16] and `scales` uint8 [..., G]; "bf16" / "fp32": `data`.
    `dtype` is the trainer tensor's dtype, restored by `unpack_from_sync` unless overridden.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    fmt: SyncFormat
    blocks: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    data: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Tensor bytes moved (headers excluded)."""
        return sum(t.numel() * t.element_size() for t in (self.blocks, self.scales, self.data) if t is not None)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_bytes(self) -> bytes:
        """safetensors bytes (no pickle): crosses Ray's object store, a socket or vLLM's collective_rpc."""
        from safetensors.torch import save

        tensors = {k: v.contiguous() for k, v in (("blocks", self.blocks), ("scales", self.scales), ("data", self.data)) if v is not None}
        meta = {"name": self.name, "shape": json.dumps(list(self.shape)), "dtype": self.dtype, "fmt": self.fmt}
        return save(tensors, metadata=meta)

    @classmethod
    def from_bytes(cls, raw: bytes) -> "SyncPayload":
        from safetensors.torch import load

        tensors = load(raw)
        # safetensors format: u64 little-endian header length, then the JSON header with "__metadata__"
        hlen = int.from_bytes(raw[:8], "little")
        meta = json.loads(raw[8:8 + hlen]).get("__metadata__", {})
        return cls(name=meta["name"], shape=tuple(json.loads(meta["shape"])), dtype=meta["dtype"], fmt=meta["fmt"],
                   blocks=tensors.get("blocks"), scales=tensors.get("scales"), data=tensors.get("data"))


def pack_for_sync(name: str, tensor: torch.Tensor, fmt: SyncFormat = "mxfp4", *, include: IncludeMode = "experts",
                  fallback: Literal["fp32", "bf16"] = "fp32") -> SyncPayload:
    """Encode one trainer tensor for the rollout side.

    fmt "mxfp4": tensors selected by `plan_tensor(name, tensor, include)` go as MXFP4 (refusing
    NaN/Inf: diverged weights must not be shipped silently); all others go as `fallback`, so the
    router and norms reach the engine in full precision. fmt "bf16" / "fp32": everything in that dtype.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"pack_for_sync({name!r}): expected a torch.Tensor, got {type(tensor).__name__}")
    if fmt not in ("fp32", "bf16", "mxfp4"):
        raise ValueError(f"pack_for_sync({name!r}): fmt must be 'fp32', 'bf16' or 'mxfp4', got {fmt!r}")
    if fallback not in ("fp32", "bf16"):
        raise ValueError(f"pack_for_sync({name!r}): fallback must be 'fp32' or 'bf16', got {fallback!r}")
    t = tensor.detach()
    shape, dt = tuple(t.shape), _dtype_name(t.dtype)
    if fmt == "mxfp4" and plan_tensor(name, t, include).quantize:
        try:
            b, s = quantize_mxfp4(t, nonfinite="raise")
        except MXFP4Error as e:
            raise MXFP4Error(f"pack_for_sync({name!r}): {e}") from e
        return SyncPayload(name=name, shape=shape, dtype=dt, fmt="mxfp4", blocks=b, scales=s)
    raw_fmt = fallback if fmt == "mxfp4" else fmt
    if not t.is_floating_point():  # integer buffers travel as they are
        return SyncPayload(name=name, shape=shape, dtype=dt, fmt="fp32", data=t.cpu().contiguous())
    target = torch.bfloat16 if raw_fmt == "bf16" else torch.float32
    return SyncPayload(name=name, shape=shape, dtype=dt, fmt=raw_fmt, data=t.to(target).contiguous())


def unpack_from_sync(payload: SyncPayload, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor the rollout engine loads: dequantized / cast to `dtype` (default: the trainer's dtype)."""
    want = dtype or _DTYPES.get(payload.dtype)
    if payload.fmt == "mxfp4":
        if payload.blocks is None or payload.scales is None:
            raise MXFP4Error(f"sync payload {payload.name!r}: fmt mxfp4 without blocks/scales")
        out = dequantize_mxfp4(payload.blocks, payload.scales, dtype=want or torch.float32)
    else:
        if payload.data is None:
            raise MXFP4Error(f"sync payload {payload.name!r}: fmt {payload.fmt} without data")
        out = payload.data if (want is None or not payload.data.is_floating_point()) else payload.data.to(want)
    if tuple(out.shape) != payload.shape:
        raise MXFP4Error(f"sync payload {payload.name!r}: decoded shape {tuple(out.shape)} != declared {payload.shape}")
    return out


@dataclass(frozen=True)
class SyncBytes:
    """Bytes moved by one sync, and what the same tensors cost as bf16 / fp32."""

    sent: int
    bf16: int
    fp32: int
    n_tensors: int
    n_mxfp4: int

    @property
    def vs_bf16(self) -> float:
        return self.sent / self.bf16 if self.bf16 else float("nan")

    @property
    def vs_fp32(self) -> float:
        return self.sent / self.fp32 if self.fp32 else float("nan")


def count_sync_bytes(payloads: Iterable[SyncPayload]) -> SyncBytes:
    sent = n = nq = numel = 0
    for p in payloads:
        sent += p.nbytes
        numel += p.numel
        n += 1
        nq += p.fmt == "mxfp4"
    return SyncBytes(sent=sent, bf16=2 * numel, fp32=4 * numel, n_tensors=n, n_mxfp4=nq)


# ----------------------------------------------------------------------------- evaluation
@dataclass(frozen=True)
class LogitComparison:
    """Reference model vs test model on the same token ids (positions with attention only)."""

    max_abs_logit_err: float
    mean_abs_logit_err: float
    next_token_agreement: float  # fraction of positions where both argmax agree
    mean_abs_logprob_gap: float  # |log p_ref(x_{t+1}) - log p_test(x_{t+1})| on the actual next tokens
    max_abs_logprob_gap: float
    mean_kl: float  # KL(ref || test) of the next-token distributions, nats
    positions: int


@torch.no_grad()
def compare_models(ref, test, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None = None, *,
                   replay_routes: bool = False) -> LogitComparison:
    """Run both models on `input_ids_BT` and compare their next-token distributions.

    replay_routes: feed the reference's expert choices (`routed_experts` [moe_layers, B*T, k]) to the
    test model, as rollout routing replay (R3) does in training; this separates the error of the
    quantized expert weights from the discrete effect of routes that flip. Needs a model that
    accepts `routed_experts` (this project's HybridMoeForCausalLM).
    """
    out_ref = ref(input_ids=input_ids_BT, attention_mask=attention_mask_BT)
    lr_BTV = out_ref.logits.float()
    kw = {}
    if replay_routes:
        routes = getattr(out_ref, "routed_experts", None)
        if routes is None:
            raise ValueError("replay_routes=True needs a reference model that reports routed_experts")
        kw["routed_experts"] = routes
    lt_BTV = test(input_ids=input_ids_BT, attention_mask=attention_mask_BT, **kw).logits.float()
    mask_BT = torch.ones_like(input_ids_BT, dtype=torch.bool) if attention_mask_BT is None else attention_mask_BT.bool()
    diff_BTV = (lr_BTV - lt_BTV).abs()
    d_NV = diff_BTV[mask_BT]
    agree = (lr_BTV.argmax(-1) == lt_BTV.argmax(-1))[mask_BT].float().mean().item()
    lpr_BTV, lpt_BTV = lr_BTV.log_softmax(-1), lt_BTV.log_softmax(-1)
    kl_BT = (lpr_BTV.exp() * (lpr_BTV - lpt_BTV)).sum(-1)
    nxt_BT1 = input_ids_BT[:, 1:].unsqueeze(-1)
    gap_BT = (lpr_BTV[:, :-1].gather(-1, nxt_BT1) - lpt_BTV[:, :-1].gather(-1, nxt_BT1)).squeeze(-1).abs()
    gap_mask_BT = mask_BT[:, 1:] & mask_BT[:, :-1]
    gaps = gap_BT[gap_mask_BT]
    return LogitComparison(max_abs_logit_err=d_NV.max().item(), mean_abs_logit_err=d_NV.mean().item(),
                           next_token_agreement=agree, mean_abs_logprob_gap=gaps.mean().item(),
                           max_abs_logprob_gap=gaps.max().item(), mean_kl=kl_BT[mask_BT].mean().item(),
                           positions=int(mask_BT.sum()))


# A fixed text set for the model report (written for this file; not in the tokenizer's corpus).
EVAL_TEXTS: tuple[str, ...] = (
    "The expert weights are stored in blocks of thirty-two values that share one scale.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "$ ls -la /tmp && cat notes.txt | grep error",
    "Rotate the plate by ninety degrees and drill four holes of eight millimetres.",
    "A router picks two experts for every token; the others stay idle.",
    "git commit -m 'fix off-by-one in the tokenizer'",
    "Search results: three pages mention the treaty, one gives the year 1648.",
    "SELECT name, count(*) FROM users GROUP BY name ORDER BY 2 DESC;",
    "The sandbox has no network, a read-only root and a memory limit of one gigabyte.",
    "for i in range(10):\n    if i % 3 == 0:\n        continue\n    total += i",
    "Thinking budget: low for quick answers, high for long multi-step tasks.",
    "import torch\nx = torch.randn(4, 32)\nprint(x.abs().amax(-1))",
    "The test suite passed after the patch: 192 passed, 0 failed.",
    "Weights are synchronised from the trainer to the rollout engine after every step.",
    "curl -s http://localhost:8000/v1/models | python -m json.tool",
    "Each block of the delta layer keeps a recurrent state of size key by value.",
)


def bench_model_report(config: str | None, workdir: Path, n_texts: int = 16, seed: int = 0) -> str:
    """Random-weight model of `config` (default: shipped "small") -> export -> load -> compare; sync bytes and gap.

    Each quantized variant is compared twice: with its own routing, and with the reference's routes
    replayed ("R3"), which isolates the expert-weight error from routes that flip.
    """
    import time

    import model as jmodel
    from transformers import AutoModelForCausalLM

    from model.chat import load_tokenizer

    cfg = jmodel.load_shipped_config(config or "small")
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(cfg).eval()
    src = workdir / "src"
    ref.save_pretrained(src)
    tok = load_tokenizer()
    texts = list(EVAL_TEXTS[:n_texts])
    enc = tok(texts, return_tensors="pt", padding=True)
    ids_BT, mask_BT = enc["input_ids"], enc["attention_mask"]
    sd = ref.state_dict()
    fp16_bytes = sum(p.numel() for p in sd.values()) * 2
    w = 40

    def row(name: str, size: int | None, c: LogitComparison | None) -> str:
        sz = f"{size:>18,}{size / fp16_bytes:>9.3f}" if size is not None else f"{'':>27}"
        if c is None:
            return f"{name:<{w}}{sz}{0:>13.2e}{0:>14.2e}{1:>14.4f}{0:>13.2e}{0:>10.2e}"
        return (f"{name:<{w}}{sz}{c.max_abs_logit_err:>13.2e}{c.mean_abs_logit_err:>14.2e}"
                f"{c.next_token_agreement:>14.4f}{c.mean_abs_logprob_gap:>13.2e}{c.mean_kl:>10.2e}")

    def rollout_model(weights: Mapping[str, torch.Tensor]):
        m = AutoModelForCausalLM.from_config(cfg).eval()
        m.load_state_dict(dict(weights))
        return m

    lines = [f"# model: {config or 'small'} config, RANDOM weights (seed {seed}), {sum(p.numel() for p in ref.parameters()):,} "
             f"params; {len(texts)} fixed texts, {int(mask_BT.sum())} tokens; errors vs the fp32 model",
             f"{'variant':<{w}}{'safetensors bytes':>18}{'vs fp16':>9}{'max|dlogit|':>13}{'mean|dlogit|':>14}"
             f"{'argmax agree':>14}{'mean|dlogp|':>13}{'KL nats':>10}",
             row("fp32 source", sum(f.stat().st_size for f in src.glob("*.safetensors")), None)]
    bf16 = rollout_model({k: v.to(torch.bfloat16).to(v.dtype) for k, v in sd.items()})
    lines.append(row("bf16 weights (yardstick)", fp16_bytes, compare_models(ref, bf16, ids_BT, mask_BT)))
    lines.append(row("bf16 weights [R3 routes]", None, compare_models(ref, bf16, ids_BT, mask_BT, replay_routes=True)))
    del bf16
    for include, rest in (("experts", None), ("experts", torch.bfloat16), ("all_linear", torch.bfloat16)):
        label = f"mxfp4 {include}" + (", rest bf16" if rest is not None else "")
        out = workdir / label.replace(" ", "_").replace(",", "")
        rep = export_mxfp4(src, out, include, rest_dtype=rest)  # type: ignore[arg-type]
        q = load_mxfp4_model(out, dtype=torch.float32)
        lines.append(row(label, rep.file_bytes_out, compare_models(ref, q, ids_BT, mask_BT)))
        lines.append(row(label + " [R3 routes]", None, compare_models(ref, q, ids_BT, mask_BT, replay_routes=True)))
        del q

    lines.append("# trainer -> rollout weight sync of the whole state dict (in-memory names, fused experts); "
                 "logprob gap = rollout model (synced weights) vs trainer (fp32)")
    lines.append(f"{'sync format':<{w}}{'bytes moved':>14}{'vs bf16':>9}{'vs fp32':>9}{'pack+unpack s':>15}"
                 f"{'mean|dlogp|':>13}{'R3 mean|dlogp|':>16}")
    for fmt, fallback in (("fp32", "fp32"), ("bf16", "fp32"), ("mxfp4", "fp32"), ("mxfp4", "bf16")):
        t0 = time.perf_counter()
        payloads = [pack_for_sync(k, v, fmt, fallback=fallback) for k, v in sd.items()]  # type: ignore[arg-type]
        synced = {p.name: unpack_from_sync(p) for p in payloads}
        dt = time.perf_counter() - t0
        sb = count_sync_bytes(payloads)
        m = rollout_model(synced)
        c, cr = compare_models(ref, m, ids_BT, mask_BT), compare_models(ref, m, ids_BT, mask_BT, replay_routes=True)
        name = fmt + (f" (rest {fallback})" if fmt == "mxfp4" else "")
        lines.append(f"{name:<{w}}{sb.sent:>14,}{sb.vs_bf16:>9.3f}{sb.vs_fp32:>9.3f}{dt:>15.2f}"
                     f"{c.mean_abs_logprob_gap:>13.2e}{cr.mean_abs_logprob_gap:>16.2e}")
        del m, synced, payloads
    return "\n".join(lines)
