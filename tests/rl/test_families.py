"""Model families beyond HybridMoe (model/families.py): routing replay through router hooks, the router
terms and telemetry from each family's own router, the weight-sync names, and one RL step + sync per
family against a real vLLM engine.

Fast tests build tiny random HF models in-process. The slow test runs, per family, the trainer (real
DeepSpeed, gloo) in a spawned child process (torch.distributed is process-global, and vLLM patches HF
classes in the process that starts an engine), and one real vLLM engine in this process: the engine
must score the trainer's starting weights, and after one RL step and a sync the trainer's new weights,
within the family's measured tolerance.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest
import torch

from model.families import FAMILIES, RouterHooks, family_problem, gate_weights, supported_model_types
from rl.config import ConfigError, load_config
from tests import REPO
from tests.helpers.checkpoints import TinyModelSpec, _config

MOE_KINDS = ("qwen3_moe", "mixtral", "olmoe", "qwen3_next", "gpt_oss", "deepseek_v3")


def _tiny_model(kind: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(_config(TinyModelSpec(kind=kind), vocab_size=512, eos_id=0), dtype=torch.float32)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    return m.eval()


# ----------------------------------------------------------------------------- the table
def test_every_supported_moe_family_names_real_modules_and_sync_names():
    import importlib

    from rl.weights.names import expert_family

    for kind in MOE_KINDS:
        fam = FAMILIES[kind]
        assert fam.replay == "hooks" and fam.supported == (kind != "deepseek_v3")
        mod = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
        assert hasattr(mod, fam.router_class), (kind, fam.router_class)
        assert expert_family(kind) == fam.sync_names, kind
        m = _tiny_model(kind)
        blocks = [getattr(layer.mlp, fam.router_attr, None) for layer in m.model.layers]
        assert any(type(b).__name__ == fam.router_class for b in blocks), kind
        assert getattr(m.config, fam.num_experts_key) == 8


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_sync_names_equal_what_save_pretrained_writes(kind, tmp_path):
    """The trainer's in-memory state dict, renamed for sync, is exactly the checkpoint vLLM loads."""
    from safetensors.torch import load_file

    from rl.weights.names import to_checkpoint_format

    m = _tiny_model(kind)
    m.save_pretrained(tmp_path)
    disk = load_file(tmp_path / "model.safetensors")
    synced = to_checkpoint_format(m.state_dict(), kind, tie_word_embeddings=m.config.tie_word_embeddings)
    assert sorted(synced) == sorted(disk)
    for name, t in disk.items():
        assert torch.equal(synced[name], t), name


def test_unsupported_families_are_refused_by_name_at_config_time(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "jamba"}))
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"model.arch={d}"])
    msg = str(e.value)
    assert "model.arch" in msg and "'jamba'" in msg
    for t in supported_model_types():
        assert t in msg
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "scoring_func": "sigmoid", "topk_method": "noaux_tc"}))
    with pytest.raises(ConfigError, match="DeepSeek-V3.*not supported here"):
        load_config(None, [f"model.arch={d}"])
    (d / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    assert load_config(None, [f"model.arch={d}"]).model.arch == str(d)
    assert family_problem("qwen3_moe") == "" and family_problem(None) != ""


# ----------------------------------------------------------------------------- replay hooks
def _slow_gate_weights(kind: str, router, logits_NE: torch.Tensor, idx_NK: torch.Tensor) -> torch.Tensor:
    """Token-by-token reference of each family's gate weights (transformers 5.19 modeling_<family>.py)."""
    out = torch.empty(idx_NK.shape, dtype=torch.float64)
    for n in range(idx_NK.shape[0]):
        z = logits_NE[n].double()
        if kind == "gpt_oss":
            chosen = torch.stack([z[e] for e in idx_NK[n]])
            out[n] = torch.exp(chosen - chosen.max()) / torch.exp(chosen - chosen.max()).sum()
        elif kind == "deepseek_v3":
            s = torch.stack([1 / (1 + torch.exp(-z[e])) for e in idx_NK[n]])
            out[n] = s / (s.sum() + 1e-20) * router.routed_scaling_factor
        else:
            p = torch.exp(z - z.max()) / torch.exp(z - z.max()).sum()
            w = torch.stack([p[e] for e in idx_NK[n]])
            out[n] = w / w.sum() if getattr(router, "norm_topk_prob", True) else w
    return out


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_replay_reproduces_the_forward_and_forces_other_routes(kind):
    m = _tiny_model(kind)
    fam = FAMILIES[kind]
    hooks = RouterHooks(m, fam)
    ids = torch.randint(10, 500, (2, 12))
    with torch.no_grad():
        free = m(input_ids=ids).logits
        used = hooks.used_LNK()
        L, N, K = used.shape
        assert N == 24 and K == 2 and L == (1 if kind == "deepseek_v3" else 2)  # DeepSeek-V3's first layer is dense
        assert torch.equal(hooks.fresh_LNK(), used)
        hooks.set_replay(used)
        again = m(input_ids=ids).logits
        assert torch.equal(again, free)  # replaying recorded routes is bit-exact
        other = (used + 1) % 8  # different experts on every slot
        hooks.set_replay(other)
        forced = m(input_ids=ids).logits
    assert torch.equal(hooks.used_LNK(), other)
    assert not torch.equal(hooks.fresh_LNK(), other)  # the router's own choice is still what it would pick
    assert (forced - free).abs().max() > 1e-3
    # the gate weights under replay follow the family's formula from the current logits
    router = next(mod for mod in m.modules() if type(mod).__name__ == fam.router_class)
    lg = hooks.router_logits()[0]
    w = gate_weights(fam.gate, router, lg, other[0])
    torch.testing.assert_close(w.double(), _slow_gate_weights(kind, router, lg, other[0]), atol=1e-6, rtol=1e-5)
    # padding (-1) takes the router's own choice
    hooks.set_replay(torch.full_like(used, -1))
    with torch.no_grad():
        assert torch.equal(m(input_ids=ids).logits, free)


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_router_gets_gradient_under_replay_and_vllm_layer_rows_are_selected(kind):
    m = _tiny_model(kind).train()
    fam = FAMILIES[kind]
    hooks = RouterHooks(m, fam)
    ids = torch.randint(10, 500, (1, 10))
    with torch.no_grad():
        m(input_ids=ids)
    routes = (hooks.used_LNK() + 3) % 8
    n_dec = m.config.num_hidden_layers
    # vLLM reports one row per decoder layer (dense ones too): the MoE layers' rows are replayed
    rows = torch.full((n_dec, *routes.shape[1:]), 7, dtype=routes.dtype)
    rows[list(hooks.moe_layer_ids)] = routes
    hooks.set_replay(rows)
    m(input_ids=ids).logits.sum().backward()
    assert torch.equal(hooks.used_LNK(), routes)
    router = next(mod for mod in m.modules() if type(mod).__name__ == fam.router_class)
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- one RL step + sync per family
ENGINE_KINDS = ("qwen3_moe", "mixtral", "olmoe", "qwen3_next", "gpt_oss")
FP32_GAP = 1e-4  # fp32 engine vs fp32 trainer (measured <= 3e-6 on every fp32 family)
BF16_MEAN_GAP = 0.1  # bf16 engine (Qwen3-Next on CPU) vs fp32 trainer: mean |gap| per token
PROMPT_LEN, NEW_TOKENS, N_EPISODES = 16, 16, 4


def _trainer_server(inbox, outbox) -> None:
    """Spawned once per module: real PolicyTrainers, one per family, in turn. Messages: ("load", ckpt), then
    ("step", episodes, out_dir): one R2 RL step on the engine's episodes and the sync export; None ends."""
    os.environ["JOINTRL_CACHE"] = str(REPO / ".cache")
    from rl.paths import setup_cache_env

    setup_cache_env()
    import pickle
    import time

    import torch

    from rl.algos import aggregation_weights
    from rl.objective import RLObjective
    from rl.trainer.batch import collate
    from rl.trainer.policy import PolicyTrainer, TrainerSpec
    from rl.weights.exporter import export_buckets

    tr = None
    while (msg := inbox.get()) is not None:
        try:
            if msg[0] == "load":
                t0 = time.perf_counter()
                tr = PolicyTrainer(msg[1], TrainerSpec(lr=2e-3, micro_batch_size=2, routing_replay="auto"),
                                   RLObjective(router_aux_coef=0.01, router_z_coef=0.001))
                outbox.put({"load_s": time.perf_counter() - t0})
                continue
            _, episodes, out_dir = msg
            t0 = time.perf_counter()
            batch = collate(episodes, [1.0, -1.0] * (len(episodes) // 2), domains=("a", "b"))
            w, _ = aggregation_weights("domain_token_mean", batch.loss_mask_BT > 0, domain_ids_B=batch.domain_ids_B)
            batch = batch.with_(loss_weights_BT=w)
            mask = batch.loss_mask_BT > 0
            old_lp, routes = tr.compute_logprobs(batch)
            lp_replayed, _ = tr.compute_logprobs(batch.with_(routed_experts_BTLK=routes, routes_from="engine"))
            before = {n: t.clone() for n, t in tr.named_weights()}
            m = tr.train_step(batch.with_(old_logprobs_BT=old_lp, routed_experts_BTLK=routes, routes_from="trainer"))
            after = dict(tr.named_weights())
            router_names = [n for n in before if n.endswith((".gate.weight", ".router.weight"))]
            new_lp, _ = tr.compute_logprobs(batch)
            buckets = export_buckets(tr.module, tr.named_weights(), bucket_mb=0.25, fmt="fp32")
            with open(f"{out_dir}/buckets.pkl", "wb") as f:
                pickle.dump(buckets, f)
            outbox.put({
                "old_lp": old_lp[mask].tolist(), "new_lp": new_lp[mask].tolist(),
                "replay_diff": float((old_lp - lp_replayed)[mask].abs().max()),
                "routes_shape": tuple(routes.shape), "n_buckets": len(buckets),
                "router_changed": bool(router_names) and all(not torch.equal(before[n], after[n]) for n in router_names),
                "metrics": {k: v for k, v in m.items() if isinstance(v, float)}, "step_s": time.perf_counter() - t0,
            })
        except BaseException as e:  # the test waits on the queue: report instead of hanging
            import traceback

            outbox.put({"error": f"{e!r}\n{traceback.format_exc()}"})


@pytest.fixture(scope="module")
def trainer_server():
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_trainer_server, args=(inbox, outbox), daemon=True)
    proc.start()

    class Server:
        def send(self, *msg) -> None:
            inbox.put(msg)

        def recv(self, timeout: float = 600.0) -> dict:
            out = outbox.get(timeout=timeout)
            assert "error" not in out, out["error"]
            return out

    yield Server()
    inbox.put(None)
    proc.join(timeout=60)
    if proc.is_alive():
        proc.kill()


@pytest.fixture(scope="module")
def family_ckpts(tmp_path_factory):
    """All tiny checkpoints, built before any engine starts in this process (vLLM patches HF classes)."""
    from tests.helpers.checkpoints import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("families")
    return {k: build_tiny_checkpoint(root / k, TinyModelSpec(kind=k)) for k in ENGINE_KINDS}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ENGINE_KINDS)
def test_rl_step_and_sync_against_a_real_engine(kind, family_ckpts, trainer_server, tmp_path):
    import pickle
    import random

    import numpy as np

    from rl.rollout.engine import EngineConfig, GenerateRequest, RolloutEngine
    from rl.types import Episode
    from rl.weights import unpack_bucket

    from vllm import ModelRegistry

    fam = FAMILIES[kind]
    ckpt = str(family_ckpts[kind])
    assert json.loads((family_ckpts[kind] / "config.json").read_text())["architectures"] == [fam.vllm_arch]
    assert fam.vllm_arch in ModelRegistry.get_supported_archs()
    trainer_server.send("load", ckpt)  # the trainer loads while the engine starts
    eng = RolloutEngine(EngineConfig(model_path=ckpt, dtype="auto", max_model_len=128, kv_cache_gib=0.25, seed=0))
    try:
        assert eng.dtype == fam.cpu_engine_dtype  # "auto" picks what the family's CPU kernels need
        rng = random.Random(0)
        prompts = [tuple(rng.randrange(10, 500) for _ in range(PROMPT_LEN)) for _ in range(N_EPISODES)]
        res = eng.generate([GenerateRequest(prompt_token_ids=p, max_tokens=NEW_TOKENS, temperature=1.0, seed=i, ignore_eos=True)
                            for i, p in enumerate(prompts)])
        episodes = [Episode(task_id=f"t{i // 2}", domain=("a", "b")[i % 2], group_id=f"g{i // 2}", token_ids=p + r.token_ids,
                            loss_mask=(0,) * len(p) + (1,) * len(r.token_ids), rollout_logprobs=(0.0,) * len(p) + tuple(r.logprobs),
                            messages=(), reward=float(i % 2)) for i, (p, r) in enumerate(zip(prompts, res))]
        load_s = trainer_server.recv()["load_s"]
        trainer_server.send("step", episodes, str(tmp_path))
        out = trainer_server.recv()
        rollout_lp = np.concatenate([np.asarray(r.logprobs) for r in res])
        gap0 = np.abs(rollout_lp - np.asarray(out["old_lp"]))
        # routing replay: the recorded routes replayed reproduce the old-policy pass exactly
        assert out["replay_diff"] < 1e-6
        assert out["routes_shape"][0] == N_EPISODES and out["routes_shape"][-1] == 2
        m = out["metrics"]
        assert m["train/routing_replay_r2"] == 1.0 and out["router_changed"]
        # router terms and per-domain telemetry come from the family's own router
        assert m["router/aux_loss"] > 0 and m["router/z_loss"] > 0 and np.isfinite(m["loss/total"])
        for d in ("a", "b", "all"):
            assert m[f"moe/tokens/{d}"] > 0 and f"moe/max_vio/{d}" in m
        # the sync: the trainer's exported buckets, loaded in place
        with open(tmp_path / "buckets.pkl", "rb") as f:
            buckets = pickle.load(f)
        assert len(buckets) > 1
        for b in buckets:
            eng.update_weights(unpack_bucket(b), version=1)
        full = [e.token_ids for e in episodes]
        scored = np.concatenate([s[PROMPT_LEN - 1:] for s in eng.score(full)])
        new_lp = np.asarray(out["new_lp"])
        gap1 = np.abs(scored - new_lp)
        moved = float(np.abs(new_lp - np.asarray(out["old_lp"])).max())
        print(f"\n{kind} ({fam.cpu_engine_dtype} engine): gap before max {gap0.max():.3g} mean {gap0.mean():.3g}; "
              f"after the step + sync max {gap1.max():.3g} mean {gap1.mean():.3g}; the step moved logprobs by {moved:.3g}; "
              f"engine up {eng.startup_s:.1f} s, trainer load {load_s:.1f} s, step + export {out['step_s']:.1f} s")
        assert moved > 0.05  # the step changed the policy enough for a stale engine to show
        if fam.cpu_engine_dtype == "float32":
            assert gap0.max() < FP32_GAP and gap1.max() < FP32_GAP
        else:
            assert gap0.mean() < BF16_MEAN_GAP and gap1.mean() < BF16_MEAN_GAP
    finally:
        eng.shutdown()
