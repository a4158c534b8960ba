"""One RL update on one long episode, per sequence length and trainer setting: peak memory and tokens/s.

    .venv/bin/python scripts/bench_long.py --lengths 2048,4096,8192 [--model .cache/models/smollm2-135m-moe]

For each length L (one episode of L random tokens, the loss on its last half) and each setting, a fresh
subprocess builds the trainer, then runs one step: the `PolicyTrainer` update (fp32, AdamW, the setting's ZeRO
stage) for the jointrl settings, TRL's for `trl`, and for the floor a bare transformers fwd + bwd + AdamW step
with gradient checkpointing and the logprobs in 1,024-token tiles. Reported: the step's peak resident memory
above the process once the model is loaded (Linux VmHWM, reset with /proc/self/clear_refs after loading), the
whole process's peak (`total GB`: what the trainer is loaded with, a ZeRO-1 engine's flat fp32 copy included,
plus the step), tokens/s (L / step time) and the step's CPU seconds (process time, all threads: on a shared
machine it varies far less than the wall time).

Settings: `today` (full logits, no checkpointing, ZeRO-1: the trainer before these knobs), `tiles`
(`trainer.logprob_tile_tokens=1024`), `checkpointing` (`trainer.activation_checkpointing=on`), `zero-auto`
(`trainer.zero_stage=auto`: ZeRO-0 on this one rank), each alone on today's; `default` (tiles + checkpointing
`auto` + ZeRO `auto`, the shipped config), `default-zero1` (the same on ZeRO-1), `all` (the default with
checkpointing on + `trainer.max_tokens_per_micro_batch=L`; with one episode the budget changes nothing, it shows
it costs nothing), `bare` (the floor), `trl` (TRL's `GRPOTrainer` loss, backward and AdamW step on the same
episode with GRPOConfig's defaults, gradient checkpointing on, generation skipped; in TRL's own venv, which
scripts/bench_trl.py builds on first use; not counted in `longest trainable`).

A case whose resident memory passes --max-rss-gb is killed (the machine is shared) and reported as such; one
that passes --timeout, or that leaves the machine less than --min-free-gb available (default 3), likewise.
The last line is `longest trainable: N tokens`: the longest length at which some jointrl setting completed.
Threads: --threads (default 2).

    .venv/bin/python scripts/bench_long.py --dsa --lengths 4096,16384,32768 [--settings dense,sparse]

`--dsa`: one Gated DSA layer of the tiny HybridMoe (model/dsa.py; hidden 128, 2 heads of 64, indexer 2 x 64),
forward + backward over one sequence of L tokens with its indexer loss: `sparse` (top-2048 keys) against
`dense` (every visible key), attending in blocks of 1,024 queries (`model.dsa.QUERY_BLOCK`), and at the
lengths where it fits (`--oneshot-upto`, default 4096) all queries at once (`*-oneshot`, the layer without
blocks). Same columns; peak above the process after building the layer.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {
    "today": dict(logprob_tile_tokens=0, activation_checkpointing="off", zero_stage=1),
    "tiles": dict(logprob_tile_tokens=1024, activation_checkpointing="off", zero_stage=1),
    "checkpointing": dict(logprob_tile_tokens=0, activation_checkpointing="on", zero_stage=1),
    "zero-auto": dict(logprob_tile_tokens=0, activation_checkpointing="off", zero_stage="auto"),
    "default-zero1": dict(logprob_tile_tokens=1024, activation_checkpointing="auto", zero_stage=1),
    "default": dict(logprob_tile_tokens=1024, activation_checkpointing="auto", zero_stage="auto"),
    "all": dict(logprob_tile_tokens=1024, activation_checkpointing="on", max_tokens_per_micro_batch=-1, zero_stage="auto"),
    "bare": {},
    "trl": {},
}


def _status_kb(field: str, pid: str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


@contextmanager
def _measured(L: int) -> Iterator[dict]:
    """The block's figures, written into the dict it yields when the block ends: peak resident memory above the
    process at its start (VmHWM reset) and of the whole process, tokens/s (L over the wall time), CPU seconds."""
    base_kb = _status_kb("VmRSS")
    _reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    res: dict = {}
    yield res
    dt = time.perf_counter() - t0
    hwm_kb = _status_kb("VmHWM")
    res.update(peak_gb=(hwm_kb - base_kb) / 2**20, total_gb=hwm_kb / 2**20, tokens_per_s=L / dt, step_s=dt,
               cpu_s=time.process_time() - c0, loaded_gb=base_kb / 2**20)


def _episode_batch(L: int, vocab: int):
    import torch

    from rl.algos import aggregation_weights
    from rl.trainer.batch import collate
    from rl.types import Episode

    g = torch.Generator().manual_seed(0)
    ids = tuple(torch.randint(11, vocab, (L,), generator=g).tolist())
    mask = tuple([0] * (L // 2) + [1] * (L - L // 2))
    ep = Episode(task_id="t", domain="d", group_id="g", token_ids=ids, loss_mask=mask,
                 rollout_logprobs=tuple(-3.0 * m for m in mask), messages=(), reward=1.0)
    batch = collate([ep], [1.0], domains=("d",))
    w, _ = aggregation_weights("seq_mean_token_mean", batch.loss_mask_BT > 0)
    return batch.with_(loss_weights_BT=w)


def _case_jointrl(model: str, L: int, setting: str) -> dict:
    from rl.objective import RLObjective
    from rl.trainer.policy import PolicyTrainer, TrainerSpec

    fields = dict(SETTINGS[setting])
    if fields.get("max_tokens_per_micro_batch") == -1:
        fields["max_tokens_per_micro_batch"] = L
    tr = PolicyTrainer(model, TrainerSpec(lr=1e-6, micro_batch_size=1, routing_replay="off", **fields),
                       RLObjective())
    batch = _episode_batch(L, int(tr.module.config.vocab_size))
    with _measured(L) as res:
        m = tr.train_step(batch)
    res["loss"] = m.get("loss/total")
    return res


def _case_bare(model: str, L: int) -> dict:
    import torch

    from rl.trainer.engine import load_policy  # transformers' Auto classes, with the HybridMoe registered
    from rl.trainer.tiled import head_inputs, tiled_token_logprobs

    m = load_policy(model, "float32")
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-6)
    batch = _episode_batch(L, int(m.config.vocab_size))
    ids, mask = batch.input_ids_BT, batch.loss_mask_BT
    with _measured(L) as res:
        W = L - L // 2 + 1
        with head_inputs(m) as (head, seen):
            m(input_ids=ids, logits_to_keep=W)
        lp = tiled_token_logprobs(head, seen[0], ids, 1024)
        loss = -(lp * mask).sum() / mask.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    res["loss"] = float(loss)
    return res


def _case_trl(model: str, L: int) -> dict:
    """TRL's GRPOTrainer on the same episode, in TRL's own venv (imports nothing of this repository): its loss
    (`compute_loss`: the completion's full-vocabulary logits, then `selective_log_softmax`), accelerate's backward
    and its AdamW step, with GRPOConfig's defaults (gradient checkpointing on) except the loss type (`grpo`, jointrl's
    `seq_mean_token_mean`) and no KL. Generation is skipped: the prompt is the first half, the completion the last."""
    import tempfile as tf

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model)
    args = GRPOConfig(output_dir=tf.mkdtemp(), per_device_train_batch_size=2, num_generations=2, loss_type="grpo",
                      beta=0.0, learning_rate=1e-6, adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, use_cpu=True,
                      bf16=False, max_completion_length=L - L // 2, report_to="none", save_strategy="no",
                      disable_tqdm=True)
    tr = GRPOTrainer(model=m, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
                     train_dataset=Dataset.from_list([{"prompt": "x"}] * 2), processing_class=tok)
    if args.gradient_checkpointing:  # what transformers' Trainer does when train() starts
        tr.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs or None)
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1
    opt = tr.create_optimizer()
    g = torch.Generator().manual_seed(0)  # the ids _episode_batch draws
    ids = torch.randint(11, int(m.config.vocab_size), (L,), generator=g)[None]
    half = L // 2
    inputs = {"prompt_ids": ids[:, :half], "prompt_mask": torch.ones_like(ids[:, :half]),
              "completion_ids": ids[:, half:], "completion_mask": torch.ones_like(ids[:, half:]),
              "advantages": torch.tensor([1.0])}
    with _measured(L) as res:
        loss = tr.compute_loss(tr.model, inputs)
        tr.accelerator.backward(loss)
        torch.nn.utils.clip_grad_norm_(tr.model.parameters(), args.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    res["loss"] = float(loss)
    res["gradient_checkpointing"] = bool(args.gradient_checkpointing)
    return res


def _case_dsa(L: int, setting: str) -> dict:
    import torch

    from model.dsa import GatedIndexedAttention, RotaryEmbedding
    from model.shipped import load_shipped_config

    cfg = load_shipped_config("tiny")
    cfg.index_topk = 2048 if setting.startswith("sparse") else L + 1
    torch.manual_seed(0)
    layer = GatedIndexedAttention(cfg, 3).train()
    if setting.endswith("oneshot"):
        layer.query_block = L
    x = torch.randn(1, L, cfg.hidden_size, requires_grad=True)
    cos, sin = RotaryEmbedding(cfg.rotary_dim, cfg.rope_parameters["rope_theta"])(torch.arange(L)[None], torch.float32)
    with _measured(L) as res:
        out, idx_loss = layer(x, cos, sin, compute_indexer_loss=True)
        (out.square().mean() + idx_loss).backward()
    res["loss"] = float(idx_loss)
    return res


DSA_SETTINGS = ("sparse", "dense", "sparse-oneshot", "dense-oneshot")


def _trl_python() -> Path:
    """TRL's own venv (scripts/bench_trl.py builds it on first use from its pins)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_trl import ensure_trl_venv

    return ensure_trl_venv()


def _available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return float("inf")


def run_case(model: str, L: int, setting: str, threads: int, timeout: float, max_rss_gb: float,
             min_free_gb: float = 0.0) -> dict:
    """One case in a fresh subprocess, killed past `max_rss_gb` resident or `timeout` seconds, or when the
    machine's available memory falls under `min_free_gb` (other jobs share it)."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        python = str(_trl_python()) if setting == "trl" else sys.executable
        cmd = [python, __file__, "--case", setting, "--length", str(L), "--model", model,
               "--threads", str(threads), "--out", out.name]
        p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        t0, peak, why = time.time(), 0.0, None
        while p.poll() is None:
            try:
                rss = _status_kb("VmRSS", str(p.pid)) / 2**20
            except (FileNotFoundError, ProcessLookupError):
                rss = 0.0
            peak = max(peak, rss)
            if rss > max_rss_gb:
                why = f"over {max_rss_gb:g} GB"
            elif _available_gb() < min_free_gb:
                why = f"machine's available memory under {min_free_gb:g} GB"
            elif time.time() - t0 > timeout:
                why = f"over {timeout:g} s"
            if why:
                p.kill()
                p.wait()
                return {"status": why, "rss_gb": peak}
            time.sleep(0.2)
        err = p.stderr.read() if p.stderr else ""
        if p.returncode != 0:
            tail = err.strip().splitlines()[-1:] if err.strip() else [f"exit {p.returncode}"]
            return {"status": "failed: " + tail[0][:120], "rss_gb": peak}
        res = json.loads(Path(out.name).read_text())
        return {"status": "ok", "rss_gb": peak, **res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    ap.add_argument("--model", default=str(REPO / ".cache/models/smollm2-135m-moe"))
    ap.add_argument("--settings", default=None, help=f"default: {','.join(SETTINGS)}; with --dsa: {','.join(DSA_SETTINGS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per case")
    ap.add_argument("--max-rss-gb", type=float, default=16.0, help="kill a case whose resident memory passes this")
    ap.add_argument("--min-free-gb", type=float, default=3.0,
                    help="kill a case when the machine's available memory falls under this (it is shared)")
    ap.add_argument("--dsa", action="store_true", help="one Gated DSA layer instead of the whole trainer step")
    ap.add_argument("--oneshot-upto", type=int, default=4096, help="--dsa: run the block-free layer up to this length")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case == "trl":  # TRL's venv: nothing of this repository
        import torch

        torch.set_num_threads(a.threads)
        Path(a.out).write_text(json.dumps(_case_trl(a.model, a.length)))
        return
    if a.case:  # the subprocess of one case
        os.environ.setdefault("JOINTRL_CACHE", str(REPO / ".cache"))
        sys.path.insert(0, str(REPO))
        from rl.paths import setup_cache_env

        setup_cache_env()
        import torch

        torch.set_num_threads(a.threads)
        if a.case in DSA_SETTINGS:
            res = _case_dsa(a.length, a.case)
        else:
            res = _case_bare(a.model, a.length) if a.case == "bare" else _case_jointrl(a.model, a.length, a.case)
        Path(a.out).write_text(json.dumps(res))
        return
    lengths = [int(x) for x in a.lengths.split(",") if x]
    default = DSA_SETTINGS if a.dsa else SETTINGS
    settings = [s for s in (a.settings or ",".join(default)).split(",") if s]
    unknown = [s for s in settings if s not in default]
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; allowed: {', '.join(default)}")
    print(f"model {a.model}, {a.threads} threads, one episode of L tokens, loss on the last half; "
          "peak = resident memory above the loaded model")
    print(f"{'length':>7} {'setting':<14} {'peak GB':>8} {'total GB':>8} {'tokens/s':>9} {'step s':>8} {'cpu s':>8}  status")
    longest = 0
    if a.dsa:
        print("one Gated DSA layer (tiny HybridMoe), forward + backward with its indexer loss")
    for L in lengths:
        for s in settings:
            if s.endswith("oneshot") and L > a.oneshot_upto:
                continue
            r = run_case(a.model, L, s, a.threads, a.timeout, a.max_rss_gb, a.min_free_gb)
            ok = r["status"] == "ok"
            if ok and s in SETTINGS and s not in ("bare", "trl"):
                longest = max(longest, L)
            peak = f"{r['peak_gb']:8.2f}" if ok else f"{'>' + format(r['rss_gb'], '.1f'):>8}"
            total = f"{r['total_gb']:8.2f}" if ok else f"{'-':>8}"
            tps = f"{r['tokens_per_s']:9.1f}" if ok else f"{'-':>9}"
            step = f"{r['step_s']:8.1f}" if ok else f"{'-':>8}"
            cpu = f"{r['cpu_s']:8.1f}" if ok else f"{'-':>8}"
            print(f"{L:>7} {s:<14} {peak} {total} {tps} {step} {cpu}  {r['status']}", flush=True)
    if not a.dsa:
        print(f"longest trainable: {longest} tokens")


if __name__ == "__main__":
    main()
