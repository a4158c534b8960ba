#!/usr/bin/env python
"""Training-side benchmark, figures side by side in one run (ratios: this machine is shared and noisy).

1. Trainer tokens/s: `PolicyTrainer.train_step` (DeepSpeed engine, RL objective, R2 routing replay,
   micro-batching) vs a bare forward + backward + AdamW step of the same model on the same batch.
   Goal >= 0.85x.
2. Weight-sync bytes/s: export to checkpoint-named buckets -> unpack (what a rollout worker hands to
   vLLM), through Ray's object store and through the same-node /dev/shm transport (only the index
   crosses Ray), per sync format and against a safetensors encoding, vs this machine's memcpy
   bandwidth on the same bytes; one shm row rebuilds the layout every sync to show what caching it
   saves. Goals (shm, fp32): >= 0.8x memcpy on `small`, >= 0.5x on `tiny`. `--sync-only` runs just this.
3. (--breakdown) Step-time breakdown of the real driver loop, sync vs async mode, on a tiny
   Qwen3-MoE over the terminal domain: rollout (generation / tools / grading), training, weight
   sync, trainer idle, rollout idle (rl.observe.telemetry.time_breakdown). Starts vLLM + DeepSpeed twice.
4. (--cross-node, alone) Weight sync to a reader on another node (Ray's object store between two
   raylets of a `ray.cluster_utils.Cluster` on this machine) vs a reader on the trainer's node
   (/dev/shm), both as `transport="auto"` chooses them in a run.
5. (--scale, alone) 1 vs 2 DeepSpeed ranks, the KL reference and critic overhead, and per-rank
   memory under ZeRO-3: scripts/bench_train_scale.py.

    .venv/bin/python scripts/bench_train.py [--model tiny|small] [--breakdown] [--sync-only] [--cross-node] [--scale]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _batch(vocab: int, B: int, T: int, seed: int = 0):
    import random

    from rl.algos import aggregation_weights
    from rl.trainer.batch import collate
    from rl.types import Episode

    rng = random.Random(seed)
    eps = [Episode(task_id=f"t{i}", domain="d", group_id=f"g{i // 4}", token_ids=tuple(rng.randrange(11, vocab) for _ in range(T)),
                   loss_mask=tuple([0] * (T // 4) + [1] * (T - T // 4)), rollout_logprobs=tuple([-2.0] * T), messages=(), reward=float(i % 2))
           for i in range(B)]
    b = collate(eps, [(-1.0) ** i for i in range(B)], domains=("d",))
    w, _ = aggregation_weights("token_mean", b.loss_mask_BT > 0)
    return b.with_(loss_weights_BT=w)


def bench_trainer(model: str, B: int, T: int, iters: int) -> dict:
    os.environ.setdefault("JOINTRL_CACHE", str(ROOT / ".cache"))
    from rl.paths import setup_cache_env

    setup_cache_env()
    import torch

    from model.modeling import HybridMoeForCausalLM
    from model.shipped import load_shipped_config
    from rl.objective import RLObjective
    from rl.trainer.batch import logits_window, token_logprobs
    from rl.trainer.policy import PolicyTrainer, TrainerSpec

    torch.manual_seed(0)
    cfg = load_shipped_config(model)
    tmp = tempfile.mkdtemp()
    HybridMoeForCausalLM(cfg).save_pretrained(tmp)
    batch = _batch(cfg.vocab_size, B, T)
    tokens = int(batch.attention_mask_BT.sum())

    # bare: forward + backward + AdamW on the same model, same batch, same micro-batch size
    bare = HybridMoeForCausalLM.from_pretrained(tmp)
    bare.train()
    opt = torch.optim.AdamW(bare.parameters(), lr=1e-5)
    def bare_step(window: bool = False):
        opt.zero_grad(set_to_none=True)
        for s in range(0, B, 4):
            keep = logits_window(batch.loss_mask_BT[s:s + 4]) if window else 0
            out = bare(input_ids=batch.input_ids_BT[s:s + 4], attention_mask=batch.attention_mask_BT[s:s + 4], logits_to_keep=keep)
            lp = token_logprobs(out.logits, batch.input_ids_BT[s:s + 4])
            (-(lp * batch.loss_mask_BT[s:s + 4]).sum() / tokens).backward()
        opt.step()
    tr = PolicyTrainer(tmp, TrainerSpec(zero_stage=1, lr=1e-5, micro_batch_size=4), RLObjective())
    def ours_step():
        old, routes = tr.compute_logprobs(batch)
        b = batch.with_(old_logprobs_BT=old, routed_experts_BTLK=routes, routes_from="trainer")
        tr.train_step(b)

    res = {}
    # The trainer computes logits only over the loss window (the prompt's are never needed); the
    # second bare row does the same, so the ratio against it is the framework's own overhead.
    for name, fn in (("bare fwd+bwd+AdamW", bare_step), ("bare fwd+bwd+AdamW, logits over the loss window", lambda: bare_step(True)),
                     ("PolicyTrainer.train_step (incl. old-logprob pass)", ours_step)):
        fn()  # warm-up
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        res[name] = tokens * iters / (time.perf_counter() - t0)
    # the update alone (old logprobs precomputed), the like-for-like comparison
    old, routes = tr.compute_logprobs(batch)
    b = batch.with_(old_logprobs_BT=old, routed_experts_BTLK=routes, routes_from="trainer")
    t0 = time.perf_counter()
    for _ in range(iters):
        tr.train_step(b)
    res["PolicyTrainer.train_step (update only)"] = tokens * iters / (time.perf_counter() - t0)
    return {"tokens_per_step": tokens, "params": sum(p.numel() for p in bare.parameters()), "tok_per_s": res}


def bench_sync(model: str, bucket_mb: float, reps: int) -> dict:
    """Trainer weights -> buckets -> (object store | /dev/shm + index through Ray) -> what a rollout worker hands to vLLM.

    All variants and both memcpy baselines run interleaved, rep by rep, and report medians: on this
    shared machine the load changes within seconds, so timing variants one after another would
    compare different machines. Each transport keeps what it keeps across syncs in a real run (the
    object-store path its staging area; the shm path its slot files and the worker's mapping).
    Not included: vLLM's own copy into its parameters (the same for all).
    """
    import pickle

    import numpy as np
    import ray
    import torch
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    from model.modeling import HybridMoeForCausalLM
    from model.shipped import load_shipped_config
    from rl.weights import ShmReader, WeightExporter, export_buckets, sync_bytes, to_checkpoint_format, unpack_bucket

    # The trainer actor runs torch with one thread (JOINTRL_TRAINER_THREADS, default 1); so does this.
    # With two threads on this oversubscribed machine every copy_ pays an OpenMP wake-up (measured:
    # a 141-tensor gather 10x slower), which would measure the machine's load, not the sync.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    m = HybridMoeForCausalLM(load_shipped_config(model))
    named = [(n, p.detach()) for n, p in m.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)

    def legacy():  # safetensors bytes per bucket (one bucket here), for comparison
        ck = to_checkpoint_format(dict(named), m.config.model_type)
        got = ray.get(ray.put(st_save(ck)))
        return list(st_load(bytes(got)).items())

    exporters: list[WeightExporter] = []

    def via(transport: str, fmt: str, cached_layout: bool = True):
        # One exporter per variant, reused across reps as the trainer actor reuses its own across syncs.
        ex = WeightExporter(node_id="")
        exporters.append(ex)
        reader = ShmReader("")

        def run():
            if not cached_layout:
                ex.layout = None  # plan from scratch: names, encodings, offsets, bucket indexes, gather views
            out = ex.export(m, iter(named), bucket_mb=bucket_mb, fmt=fmt, transport=transport)
            assert ex.last_transport == transport
            if transport == "object_store":  # what TrainerWorker.export_weights / RolloutWorkerImpl.update_weights do
                return [unpack_bucket(ray.get(r), dequant_dtype=torch.float32) for r in [ray.put(b) for b in out]]
            # Only the index crosses Ray. In a run it rides inline in the actor return / the worker call
            # (Ray inlines values < 100 KB), whose RPC the object-store rows do not time either: so the
            # crossing is timed as its serialisation round trip. The row "shm index alone through
            # ray.put + ray.get" shows what a trip through the object store would add instead.
            index = pickle.loads(pickle.dumps(out, protocol=5))
            with reader.open(index) as views:
                return [unpack_bucket(v, dequant_dtype=torch.float32) for v in views]
        return run

    index_ex = WeightExporter(node_id="")
    exporters.append(index_ex)
    fp32_index = index_ex.export(m, iter(named), bucket_mb=bucket_mb, fmt="fp32", transport="shm")

    flat = torch.cat([t.reshape(-1) for _, t in named])
    dst = torch.empty_like(flat)
    dst.copy_(flat)
    variants = {
        "memcpy into a warm buffer (baseline)": lambda: dst.copy_(flat),
        "memcpy into a fresh buffer (clone)": lambda: flat.clone(),
        "legacy: safetensors bytes": legacy,
        "object store, fp32 (aliasing, ray.put copies)": via("object_store", "fp32"),
        "object store, bf16 (staged)": via("object_store", "bf16"),
        "object store, mxfp4 experts + fp32 rest": via("object_store", "mxfp4"),
        "shm, fp32": via("shm", "fp32"),
        "shm, bf16": via("shm", "bf16"),
        "shm, mxfp4 experts + fp32 rest": via("shm", "mxfp4"),
        "shm, fp32, layout rebuilt every sync": via("shm", "fp32", cached_layout=False),
        "shm index alone through ray.put + ray.get": lambda: ray.get(ray.put(fp32_index)),
    }
    moved = {k: nbytes for k in variants}
    moved["shm index alone through ray.put + ray.get"] = len(pickle.dumps(fp32_index, protocol=5))
    for fmt in ("bf16", "mxfp4"):
        sent = sync_bytes(export_buckets(m, iter(named), bucket_mb=bucket_mb, fmt=fmt)).sent
        moved.update({k: sent for k in variants if f", {fmt}" in k})
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # its own, even if another is running
    times: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for _ in range(2):  # warm-up: lazy imports, first touches of the object store and of both shm slots
            for fn in variants.values():
                fn()
        for _ in range(reps):
            for k, fn in variants.items():
                t0 = time.perf_counter()
                out = fn()
                times[k].append(time.perf_counter() - t0)
                del out
    finally:
        ray.shutdown()
        for ex in exporters:
            ex.close()
    med = {k: float(np.median(v)) for k, v in times.items()}
    base = med["memcpy into a warm buffer (baseline)"]
    rows = {k: {"ms": med[k] * 1e3, "GBps": nbytes / med[k] / 1e9, "vs_memcpy": base / med[k], "bytes_moved": moved[k]} for k in variants}
    rows["shm index alone through ray.put + ray.get"].update(GBps=None, vs_memcpy=None)  # a part of a sync, not one
    return {"bytes": nbytes, "reps": reps, "rows": rows}


def print_sync(s: dict, model: str) -> None:
    print(f"== weight sync: {model}, {s['bytes'] / 1e6:.1f} MB fp32, export -> transport -> worker-side tensors; "
          f"median of {s['reps']} interleaved reps; GB/s = fp32 model bytes / time")
    print(f"  {'variant':<46} {'ms':>8} {'GB/s':>7} {'vs memcpy':>10} {'bytes moved':>14}")
    for k, r in s["rows"].items():
        if r["vs_memcpy"] is None:
            print(f"  {k:<46} {r['ms']:>8.1f} {'-':>7} {'-':>10} {r['bytes_moved']:>14,}")
        else:
            print(f"  {k:<46} {r['ms']:>8.1f} {r['GBps']:>7.2f} {r['vs_memcpy']:>9.2f}x {r['bytes_moved']:>14,}")


def bench_cross_node(model: str, bucket_mb: float, reps: int) -> dict:
    """Weight sync to a reader on the trainer's node (/dev/shm) and on another node (Ray's object store).

    One machine, Ray's multi-node test cluster (`ray.cluster_utils.Cluster`): node A runs the
    exporting actor (the trainer's side: `WeightExporter` with transport "auto", as
    `TrainerWorker.export_weights` runs it) and a reader; node B, its own raylet and object store,
    runs the other reader. Each row times, from the driver, one export call plus one reader call that
    ends with worker-side tensors (what `RolloutWorkerImpl.update_weights` hands to vLLM, vLLM's own
    copy excluded), variants interleaved rep by rep, medians. The cross-node rows move the bytes
    between the two object stores over loopback TCP (Ray's object manager), so they measure Ray's
    transfer path, not a network; on a real cluster the network bandwidth bounds them too.
    """
    import shutil

    import numpy as np
    import ray
    import torch
    from ray.cluster_utils import Cluster

    from model.modeling import HybridMoeForCausalLM
    from model.shipped import load_shipped_config
    from rl.weights import sync_bytes, export_buckets

    class Source:
        """The trainer's side: one WeightExporter per variant, reused across its syncs like the trainer's."""

        def __init__(self, model: str) -> None:
            from rl.weights import WeightExporter

            torch.set_num_threads(1)  # as the trainer actor (JOINTRL_TRAINER_THREADS, default 1)
            torch.manual_seed(0)
            self.m = HybridMoeForCausalLM(load_shipped_config(model))
            self.named = [(n, p.detach()) for n, p in self.m.named_parameters()]
            self.exporters: dict[str, WeightExporter] = {}
            self.make = WeightExporter

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def export(self, variant: str, transport: str, fmt: str, reader_nodes: list[str]) -> list:
            from rl.weights import WeightBucket

            ex = self.exporters.setdefault(variant, self.make())
            out = ex.export(self.m, iter(self.named), bucket_mb=bucket_mb, fmt=fmt, transport=transport, reader_nodes=reader_nodes)
            self.last = (ex.last_transport, ex.last_reason)
            return [ray.put(b) if isinstance(b, WeightBucket) else b for b in out]  # as TrainerWorker.export_weights

        def last_choice(self) -> tuple[str, str]:
            return self.last

        def nbytes(self) -> int:
            return sum(t.numel() * t.element_size() for _, t in self.named)

        def close(self) -> None:
            for ex in self.exporters.values():
                ex.close()

    class Reader:
        """A rollout worker's side of `update_weights`, without the engine."""

        def __init__(self) -> None:
            from rl.weights import ShmReader, local_node_id

            torch.set_num_threads(1)
            self.shm = ShmReader(local_node_id())

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def load(self, buckets: list) -> int:
            from rl.weights import ShmBucket, unpack_bucket

            refs = [i for i, b in enumerate(buckets) if isinstance(b, ray.ObjectRef)]
            items = list(buckets)
            for i, v in zip(refs, ray.get([items[i] for i in refs])):  # a cross-node ref is pulled into this node's store here
                items[i] = v
            shm = [b for b in items if isinstance(b, ShmBucket)]
            with self.shm.open(shm) as views:
                by_id = {id(b): v for b, v in zip(shm, views)}
                return sum(len(unpack_bucket(by_id.get(id(b), b), dequant_dtype=torch.float32)) for b in items)

        def nothing(self, x: list) -> int:
            return len(x)

    tmp = Path(tempfile.mkdtemp(prefix="xn-", dir=ROOT / ".cache"))  # short: Ray's socket paths live under it
    # The test cluster records its address in $RAY_TMPDIR/ray/ray_current_cluster (default /tmp/ray), where
    # a plain `ray.init()` of any process on this machine would join it; this process only, so set it here.
    os.environ["RAY_TMPDIR"] = str(tmp)
    (tmp / "ray").mkdir()
    store = 1536 * 2**20
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "temp_dir": str(tmp), "include_dashboard": False})
    cluster.add_node(num_cpus=2, resources={"sync_a": 1}, object_store_memory=store)
    cluster.add_node(num_cpus=1, resources={"sync_b": 1}, object_store_memory=store)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    on = lambda r: {"num_cpus": 0, "resources": {r: 0.001}}  # noqa: E731
    try:
        src = ray.remote(Source).options(**on("sync_a")).remote(model)
        near, far = ray.remote(Reader).options(**on("sync_a")).remote(), ray.remote(Reader).options(**on("sync_b")).remote()
        a, na, nb = ray.get([src.node_id.remote(), near.node_id.remote(), far.node_id.remote()])
        assert a == na != nb, (a, na, nb)
        nbytes = ray.get(src.nbytes.remote())
        # (reader, transport asked for, format, the reader's node as the dispatcher reports it, transport expected)
        specs = {
            "same node, /dev/shm, fp32 (auto)": (near, "auto", "fp32", na, "shm"),
            "same node, /dev/shm, bf16 (auto)": (near, "auto", "bf16", na, "shm"),
            "same node, object store, fp32 (forced)": (near, "object_store", "fp32", na, "object_store"),
            "cross node, object store, fp32 (auto)": (far, "auto", "fp32", nb, "object_store"),
            "cross node, object store, bf16 (auto)": (far, "auto", "bf16", nb, "object_store"),
        }
        choice: dict[str, tuple[str, str]] = {}

        def sync(name: str):
            reader, transport, fmt, node, want = specs[name]

            def run() -> int:
                n = ray.get(reader.load.remote(ray.get(src.export.remote(name, transport, fmt, [node]))))
                choice[name] = ray.get(src.last_choice.remote())
                assert choice[name][0] == want, (name, choice[name])
                return n
            return run

        torch.set_num_threads(1)
        m = HybridMoeForCausalLM(load_shipped_config(model))  # the same shapes, for the baseline and the byte counts
        named = [(n, p.detach()) for n, p in m.named_parameters()]
        sent = {fmt: sync_bytes(export_buckets(m, iter(named), bucket_mb=bucket_mb, fmt=fmt)).sent for fmt in ("fp32", "bf16")}
        flat = torch.cat([t.reshape(-1) for _, t in named])
        dst = torch.empty_like(flat)
        dst.copy_(flat)
        variants = {"memcpy into a warm buffer (baseline)": lambda: dst.copy_(flat), **{k: sync(k) for k in specs},
                    "two empty actor calls (in every sync row)": lambda: ray.get(far.nothing.remote(ray.get(src.last_choice.remote())))}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(2):  # warm-up: imports, first touches of both shm slots and of each object store
            for fn in variants.values():
                fn()
        for _ in range(reps):
            for k, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        ray.get(src.close.remote())
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: float(np.median(v)) for k, v in times.items()}
    base, shm = med["memcpy into a warm buffer (baseline)"], med["same node, /dev/shm, fp32 (auto)"]
    rows = {}
    for k, t in med.items():
        fmt = specs[k][2] if k in specs else "fp32"
        rows[k] = {"ms": t * 1e3, "GBps": nbytes / t / 1e9, "vs_memcpy": base / t, "vs_shm": shm / t,
                   "bytes_moved": sent[fmt] if k in specs or k.startswith("memcpy") else 0, "why": choice.get(k, ("", ""))[1]}
    rows["two empty actor calls (in every sync row)"].update(GBps=None, vs_memcpy=None, vs_shm=None)
    return {"bytes": nbytes, "reps": reps, "rows": rows}


def print_cross_node(s: dict, model: str) -> None:
    print(f"== weight sync across nodes: {model}, {s['bytes'] / 1e6:.1f} MB fp32, Ray test cluster on one machine "
          f"(2 raylets, 2 object stores); export -> transport -> worker-side tensors; median of {s['reps']} interleaved reps; "
          "GB/s = fp32 model bytes / time")
    print(f"  {'variant':<44} {'ms':>8} {'GB/s':>7} {'vs memcpy':>10} {'vs shm':>7} {'bytes moved':>14}")
    for k, r in s["rows"].items():
        if r["vs_memcpy"] is None:
            print(f"  {k:<44} {r['ms']:>8.1f} {'-':>7} {'-':>10} {'-':>7} {'-':>14}")
        else:
            print(f"  {k:<44} {r['ms']:>8.1f} {r['GBps']:>7.2f} {r['vs_memcpy']:>9.2f}x {r['vs_shm']:>6.2f}x {r['bytes_moved']:>14,}")
    why = {r["why"] for k, r in s["rows"].items() if k.startswith("cross node")}
    print(f"  the exporter's choice for the cross-node reader: {'; '.join(sorted(why))}")


def bench_breakdown(steps: int) -> dict:
    from rl.config import load_config
    from rl.observe.sink import read_metrics
    from tests.helpers.checkpoints import build_test_checkpoint
    from rl.run import run

    tmp = Path(tempfile.mkdtemp())
    build_test_checkpoint(tmp / "m")
    out = {}
    for mode in ("false", "true"):
        run_dir = tmp / f"run_{mode}"
        cfg = load_config(None, [f"model.arch={tmp / 'm'}", f"run_dir={run_dir}", "envs.weights={terminal: 1.0}",
                                 "rollout.max_new_tokens_per_turn=64", "envs.max_turns=3", "algorithm.dynamic_sampling=off",
                                 "trainer.sft_steps=0", "trainer.tasks_per_step=4", f"trainer.steps={steps}",
                                 f"trainer.async_mode={mode}", "logging.wandb_mode=disabled"])
        run(cfg)
        rows = [r for r in read_metrics(run_dir) if "time/step_s" in r][1:]  # first step warms up
        keys = ("step", "rollout", "rollout_generate", "rollout_tools", "rollout_grade", "train", "sync", "trainer_idle", "rollout_idle")
        out["async" if mode == "true" else "sync"] = {k: sum(r.get(f"time/{k}_s", 0.0) for r in rows) / len(rows) for k in keys}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--breakdown", action="store_true")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--sync-only", action="store_true", help="only the weight-sync benchmark (seconds instead of minutes)")
    p.add_argument("--sync-reps", type=int, default=15)
    p.add_argument("--cross-node", action="store_true",
                   help="only the cross-node vs same-node weight-sync benchmark (its own Ray test cluster)")
    p.add_argument("--scale", action="store_true", help="only the trainer-at-scale figures (scripts/bench_train_scale.py)")
    a = p.parse_args()
    if a.scale:
        from bench_train_scale import run as run_scale  # scripts/ is this script's import root

        run_scale(a.iters)
        return 0
    ctx = mp.get_context("spawn")  # torch.distributed is process-global: one process per measurement
    if a.cross_node:
        with ctx.Pool(1) as pool:
            c = pool.apply(bench_cross_node, (a.model, 64.0, a.sync_reps))
        print_cross_node(c, a.model)
        return 0
    if not a.sync_only:
        with ctx.Pool(1) as pool:
            t = pool.apply(bench_trainer, (a.model, a.batch, a.seq, a.iters))
        print(f"== trainer throughput: {a.model} ({t['params'] / 1e6:.1f}M params), {t['tokens_per_step']} tokens/step")
        base = t["tok_per_s"]["bare fwd+bwd+AdamW"]
        base_w = t["tok_per_s"]["bare fwd+bwd+AdamW, logits over the loss window"]
        for k, v in t["tok_per_s"].items():
            print(f"  {k:<52} {v:>9.0f} tok/s   {v / base:5.2f}x bare   {v / base_w:5.2f}x bare-window")
    with ctx.Pool(1) as pool:
        s = pool.apply(bench_sync, (a.model, 64.0, a.sync_reps))
    print_sync(s, a.model)
    if a.breakdown:
        with ctx.Pool(1) as pool:
            b = pool.apply(bench_breakdown, (a.steps,))
        print("== step-time breakdown (mean over steps after the first, seconds; rollout = generate + tools + grade)")
        keys = list(next(iter(b.values())))
        print("  " + f"{'mode':<6}" + "".join(f"{k:>17}" for k in keys))
        for mode, r in b.items():
            print("  " + f"{mode:<6}" + "".join(f"{r[k]:>17.2f}" for k in keys))
        print(f"  async / sync step time: {b['async']['step'] / b['sync']['step']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
