"""Benchmark MXFP4: codec throughput, and (with --model) what MXFP4 experts cost a model.

    .venv/bin/python scripts/bench_mxfp4.py                      # codec + model report
    .venv/bin/python scripts/bench_mxfp4.py --only codec --numel 67108864
    .venv/bin/python scripts/bench_mxfp4.py --only model --model-config configs/model/small.json

Codec: GB/s of float32 input for quantize and dequantize of one big tensor, side by side with a
float32 -> bfloat16 cast and a plain copy of the same tensor (memory-bandwidth yardsticks) and
with transformers' gpt-oss dequantizer (`convert_moe_packed_tensors`) on the same blocks.

Model: a random-weight model of the given config is saved with save_pretrained, exported with
`export_mxfp4`, loaded back with `load_mxfp4_model`, and compared on a fixed text set (bytes on
disk, logit error, next-token agreement, logprob gap); then the trainer->rollout sync payloads are
measured against bf16 and fp32. Random weights: the numbers describe quantization noise on this
architecture, not the accuracy of a trained model.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model.mxfp4 import dequantize_mxfp4, quantize_mxfp4  # noqa: E402


def _best_of(fn, reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_codec(numel: int, reps: int) -> None:
    rows = numel // 4096
    x = torch.randn(rows, 4096, generator=torch.Generator().manual_seed(0))
    gb = x.numel() * 4 / 1e9
    b, s = quantize_mxfp4(x)
    t_q = _best_of(lambda: quantize_mxfp4(x), reps)
    t_dq = _best_of(lambda: dequantize_mxfp4(b, s), reps)
    t_cast = _best_of(lambda: x.to(torch.bfloat16), reps)
    t_copy = _best_of(lambda: x.clone(), reps)
    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        b3, s3 = b.view(1, rows, -1, 16), s.view(1, rows, -1)
        t_hf = _best_of(lambda: convert_moe_packed_tensors(b3, s3, dtype=torch.float32), reps)
    except ImportError:
        t_hf = float("nan")
    print(f"# codec: {x.numel() / 2**20:.0f}M float32 values ({gb * 1e3:.0f} MB), torch threads={torch.get_num_threads()}, best of {reps}")
    print(f"{'operation':<44}{'time s':>9}{'GB/s fp32':>11}{'vs quantize':>13}")
    base = t_q
    for name, t in (("quantize_mxfp4", t_q), ("dequantize_mxfp4 -> float32", t_dq),
                    ("transformers gpt-oss dequant -> float32", t_hf),
                    ("float32 -> bfloat16 cast", t_cast), ("float32 copy (clone)", t_copy)):
        print(f"{name:<44}{t:>9.3f}{gb / t:>11.2f}{base / t:>12.2f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["codec", "model"], default=None)
    ap.add_argument("--numel", type=int, default=64 * 2**20, help="codec tensor size (default 64M)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model-config", default=None, help="HF config.json of the model to measure")
    ap.add_argument("--texts", type=int, default=16, help="number of fixed texts for the model report")
    args = ap.parse_args(argv)
    if args.only in (None, "codec"):
        bench_codec(args.numel, args.reps)
    if args.only in (None, "model"):
        from model.mxfp4_export import bench_model_report

        with tempfile.TemporaryDirectory() as tmp:
            print(bench_model_report(args.model_config, Path(tmp), n_texts=args.texts))


if __name__ == "__main__":
    main()
