"""Memory and time of one RL update with `trainer.sequence_parallel_size` 1 vs 2 (rl/trainer/ulysses.py).

Usage: .venv/bin/python scripts/bench_sequence_parallel.py [--lengths 4096,8192] [--model mixtral|hybrid] [--threads 1]

For each length: one episode of that many tokens (loss on its last half), one PolicyTrainer update (ZeRO-1, AdamW,
fp32, tiled logprobs, activation checkpointing off so the activations show), first on 1 rank, then on 2 ranks that
share the sequence (world 2, one sequence-parallel group), each setting in fresh processes run one after the other.
Prints one row per length and setting: each rank's peak resident memory during the update above the process with
its model, optimizer and engine loaded (`train/peak_rss_gb` less the resident memory before the update), and the
update's wall time. Models (random weights, built in a temporary directory):
- mixtral: transformers' Mixtral, hidden 512, 4 layers, 8 heads (2 KV), 4 experts top-2, vocab 32k (~0.1B);
- hybrid: the project's shipped `tiny` HybridMoe (3 gated delta layers, 1 Gated DSA layer, top-2048 keys).
What it does not do: start Ray or an engine, or compare numbers (tests/rl/trainer/test_sequence_parallel.py does).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.http_io import free_port  # noqa: E402 - after the path set-up


def _build(kind: str, out: str) -> str:
    import torch

    torch.manual_seed(0)
    if kind == "hybrid":
        from model.modeling import HybridMoeForCausalLM
        from model.shipped import load_shipped_config

        HybridMoeForCausalLM(load_shipped_config("tiny")).save_pretrained(out)
        return out
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=65536, sliding_window=None, attn_implementation="sdpa")
    MixtralForCausalLM(cfg).save_pretrained(out)
    return out


def _rank(rank: int, world: int, port: int, init: str, length: int, vocab: int, threads: int, q) -> None:
    try:
        import torch

        torch.set_num_threads(threads)
        from rl.objective import RLObjective
        from rl.trainer.actor import _rss_mb
        from rl.trainer.batch import collate
        from rl.trainer.policy import PolicyTrainer, TrainerSpec
        from rl.types import Episode

        spec = TrainerSpec(zero_stage=1, lr=1e-5, micro_batch_size=1, logprob_tile_tokens=1024,
                           activation_checkpointing="off", sequence_parallel_size=world, prefix_sharing="off")
        tr = PolicyTrainer(init, spec, RLObjective(router_aux_coef=0.0), rank=rank, world_size=world, master_port=port)
        g = torch.Generator().manual_seed(0)
        ids = tuple(int(x) for x in torch.randint(11, vocab, (length,), generator=g))
        mask = tuple([0] * (length // 2) + [1] * (length - length // 2))
        ep = Episode(task_id="t", domain="a", group_id="g", token_ids=ids, loss_mask=mask,
                     rollout_logprobs=tuple(-3.0 * m for m in mask), messages=(), reward=1.0)
        batch = collate([ep], [1.0])
        before = _rss_mb() / 1024.0
        t0 = time.perf_counter()
        m = tr.train_step(batch)
        q.put((rank, {"peak_above_gb": m["train/peak_rss_gb"] - before, "step_s": time.perf_counter() - t0}))
    except BaseException as e:  # noqa: BLE001  (reported by the parent)
        import traceback

        q.put((rank, {"error": traceback.format_exc() + repr(e)}))


def _run(world: int, init: str, length: int, vocab: int, threads: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, init, length, vocab, threads, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get() for _ in procs)
    for p in procs:
        p.join()
    return [got[r] for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,8192")
    ap.add_argument("--model", choices=("mixtral", "hybrid"), default="mixtral")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    a = ap.parse_args()
    os.environ.setdefault("JOINTRL_CACHE", str(Path(__file__).resolve().parents[1] / ".cache"))
    from rl.paths import setup_cache_env

    setup_cache_env()
    vocab = 8192 if a.model == "hybrid" else 32000
    with tempfile.TemporaryDirectory() as tmp:
        init = _build(a.model, f"{tmp}/model")
        print("| length | setting | rank | peak above loaded (GB) | update s |")
        print("| --- | --- | --- | --- | --- |")
        for length in (int(x) for x in a.lengths.split(",")):
            for world in (1, 2):
                for r, res in enumerate(_run(world, init, length, vocab, a.threads)):
                    setting = "1 rank" if world == 1 else "2 ranks, sequence_parallel_size=2"
                    if "error" in res:
                        print(f"| {length} | {setting} | {r} | failed: {res['error'].strip().splitlines()[-1]} | - |")
                    else:
                        print(f"| {length} | {setting} | {r} | {res['peak_above_gb']:.2f} | {res['step_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
