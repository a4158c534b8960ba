"""Trainer knobs on 2 CPU cores, side by side in one run: tokens/s of one supervised step (forward,
backward, optimizer) through the project's own trainer (rl.trainer.policy.PolicyTrainer, DeepSpeed
ZeRO-1) on the upcycled SmolLM2-MoE, for each knob setting, as a ratio to the fp32 / 1-thread row.

Rows: torch threads (trainer.threads_per_rank), bf16 weights (model.dtype=bfloat16, DeepSpeed's bf16
mode), frozen bottom layers (trainer.frozen_layers), LoRA adapters (trainer.lora.*). The batch is
shaped like a terminal-basics episode batch: B sequences of T tokens whose last `--gen` tokens carry
the loss (the trainer computes logits only over that window). Settings run round-robin (`--rounds`),
so load swings on this shared machine hit every row alike; the median per row is printed. Each setting
runs in a fresh process (two fp32 trainers of the real model do not fit in 24 GB together, and the peak
resident size per row is then its own).

    .venv/bin/python scripts/bench_knobs.py [--model smollm2-135m-moe|tiny] [--batch 8] [--tokens 448] [--gen 96]

It measures speed only: which knob helps *learning* is a training-run question (docs/training.md).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts._spawn import in_fresh_process  # noqa: E402


@dataclass(frozen=True)
class Knob:
    name: str
    threads: int
    dtype: str = "float32"
    frozen_layers: int = 0
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ("attention",)


def _batch(B: int, T: int, gen: int, vocab: int, seed: int = 0):
    import torch

    from rl.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab - 10, (B, T), generator=g)
    mask = torch.zeros(B, T)
    mask[:, T - gen:] = 1.0
    z = torch.zeros(B, T)
    return TrainBatch(input_ids_BT=ids, attention_mask_BT=torch.ones(B, T, dtype=torch.long), loss_mask_BT=mask,
                      rollout_logprobs_BT=z, advantages_BT=z.clone(), group_ids_B=torch.arange(B), domain_ids_B=torch.zeros(B, dtype=torch.long),
                      domains=("terminal",), rewards_B=torch.zeros(B), step_tokens=B * T, step_seqs=B, step_loss_tokens=float(B * gen))


def _trainer(model_dir: str, k: Knob, micro: int):
    import torch

    from rl.trainer.lora import LoraSpec
    from rl.trainer.policy import PolicyTrainer, TrainerSpec

    torch.set_num_threads(k.threads)
    lora = LoraSpec(rank=k.lora_rank, alpha=2.0 * max(k.lora_rank, 1), targets=k.lora_targets, sync="merged") if k.lora_rank else LoraSpec()
    spec = TrainerSpec(zero_stage=1, lr=1e-5, micro_batch_size=micro, dtype=k.dtype, frozen_layers=k.frozen_layers, lora=lora)
    return PolicyTrainer(model_dir, spec, objective=None)


def _row(k: Knob, model_dir: str, args, out) -> None:
    import resource

    from rl.trainer.actor import trim_heap

    t = _trainer(model_dir, k, args.micro)
    vocab = t.module.config.vocab_size
    batch = _batch(args.batch, args.tokens, args.gen, vocab)
    t.sft_step(batch)  # warm-up: allocator, optimizer state
    trim_heap()
    t0 = time.perf_counter()
    t.sft_step(batch)
    dt = time.perf_counter() - t0
    out.put({"step_s": dt, "trainable": sum(p.numel() for p in t.module.parameters() if p.requires_grad),
             "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0 ** 2})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-moe", help="a pullable model name, a checkpoint dir, or 'tiny' (the shipped HybridMoe)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=448, help="sequence length (prompt + generated)")
    ap.add_argument("--gen", type=int, default=96, help="loss-masked tail of each sequence")
    ap.add_argument("--micro", type=int, default=8, help="micro-batch size")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated row names to run")
    args = ap.parse_args(argv)

    os.environ.setdefault("JOINTRL_PROGRESS", "0")
    import json

    if args.model == "tiny":
        import tempfile

        from model.modeling import HybridMoeForCausalLM
        from model.shipped import load_shipped_config

        model_dir = tempfile.mkdtemp()
        HybridMoeForCausalLM(load_shipped_config("tiny")).save_pretrained(model_dir)
    else:
        from model import hub

        model_dir = str(hub.pull(args.model)) if args.model in hub.names() else args.model
    n_layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
    knobs = [Knob("fp32, 1 thread", 1), Knob("fp32, 2 threads", 2), Knob("bf16 weights, 2 threads", 2, dtype="bfloat16"),
             Knob(f"fp32, 2 threads, bottom {n_layers // 2} of {n_layers} layers frozen", 2, frozen_layers=n_layers // 2),
             Knob("fp32, 2 threads, LoRA r16 attention", 2, lora_rank=16),
             Knob("fp32, 2 threads, LoRA r16 attention+experts", 2, lora_rank=16, lora_targets=("attention", "experts"))]
    if args.only:
        keep = {s.strip() for s in args.only.split(",")}
        knobs = [k for k in knobs if k.name in keep]
    times: dict[str, list[float]] = {k.name: [] for k in knobs}
    peaks: dict[str, list[float]] = {k.name: [] for k in knobs}
    trainable: dict[str, int] = {}
    for r in range(args.rounds):
        for k in knobs:
            res = in_fresh_process(_row, (k, model_dir, args), f"row {k.name!r}", "bench_knobs")
            times[k.name].append(res["step_s"])
            peaks[k.name].append(res["peak_gb"])
            trainable[k.name] = res["trainable"]
            print(f"  round {r} {k.name}: {res['step_s']:.2f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    tokens = args.batch * args.tokens
    base = statistics.median(times[knobs[0].name])
    print(f"\nsupervised step, {args.batch} x {args.tokens} tokens (loss on the last {args.gen}), {Path(model_dir).name}, "
          f"median of {args.rounds}; load average at the end {os.getloadavg()[0]:.1f}")
    print(f"{'setting':<52} {'trainable':>11} {'step s':>8} {'tok/s':>8} {'vs first':>9} {'peak GB':>8}")
    for k in knobs:
        s = statistics.median(times[k.name])
        print(f"{k.name:<52} {trainable[k.name] / 1e6:>10.1f}M {s:>8.2f} {tokens / s:>8.1f} {base / s:>8.2f}x {max(peaks[k.name]):>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
