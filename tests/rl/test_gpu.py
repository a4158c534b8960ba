"""The GPU paths: NCCL weight sync, tensor-parallel rollout engines, trainer and rollout on their own GPUs.

`@pytest.mark.gpu` tests need CUDA and are skipped (with the reason) on machines without it; none of
them has run on a GPU in this project so far. `bash scripts/gpu_smoke.sh` runs them (and prints the
figures they record) on a machine with one GPU or more:
- one GPU: the engine builds with vLLM's NCCL weight-transfer engine; a 2-step RL run on the `small`
  HybridMoe with trainer and rollout sharing the GPU (NCCL needs two GPUs: it refuses two ranks of one
  communicator on one device, so the NCCL tests skip);
- two or more: NCCL sync from the trainer's GPU into the engine's, then the engine-vs-trainer logprob
  gap; a tensor-parallel (TP=2) engine; the 2-step run with trainer and rollout on separate GPUs, NCCL sync.

The unmarked tests check, on CPU, what the GPU paths decide before any GPU is touched: config and
start-up refusals, the placement shown by `--dry-run`, and that the NCCL stream carries exactly the
tensors (names, dtypes, shapes, bytes) the bucket transports carry.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO


def _cuda_devices() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as none
        return 0


GPUS = _cuda_devices()
NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False on this machine)"
NEEDS_TWO = "needs 2 GPUs: NCCL refuses two ranks of one communicator on one GPU, and TP=2 needs two"


def _record(name: str, **figures: float | str) -> None:
    """Print a test's figures; also append them to $JOINTRL_GPU_FIGURES (scripts/gpu_smoke.sh prints that file)."""
    line = {"test": name, **figures}
    print("FIGURES " + json.dumps(line))
    path = os.environ.get("JOINTRL_GPU_FIGURES")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


# ----------------------------------------------------------------------------- CPU: decided before any GPU is touched
@pytest.mark.parametrize("overrides, needles", [
    (["rollout.tensor_parallel_size=2"], ["rollout.tensor_parallel_size", "on CPU it must be 1", "rollout.gpus_per_worker=2"]),
    (["rollout.tensor_parallel_size=2", "rollout.gpus_per_worker=1"], ["rollout.gpus_per_worker", "one whole GPU per TP rank"]),
    (["trainer.sync_transport=nccl"], ["trainer.sync_transport", "GPU only", "trainer.gpus_per_rank", "rollout.gpus_per_worker"]),
    (["trainer.sync_transport=nccl", "trainer.gpus_per_rank=1", "rollout.gpus_per_worker=0.5"], ["two ranks on one GPU"]),
    (["trainer.sync_transport=nccl", "trainer.gpus_per_rank=1", "rollout.gpus_per_worker=1", "trainer.sync_format=mxfp4"],
     ["trainer.sync_format", "mxfp4"]),
    (["rollout.gpus_per_worker=-1"], ["rollout.gpus_per_worker", "-1"]),
    (["rollout.tensor_parallel_size=0"], ["rollout.tensor_parallel_size", ">= 1"]),
])
def test_gpu_settings_are_refused_at_config_time_naming_the_key(overrides, needles):
    from rl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as ei:
        load_config(None, overrides)
    for n in needles:
        assert n in str(ei.value), (n, str(ei.value))


def test_gpu_settings_that_fit_validate_and_dry_run_shows_the_gpus():
    from rl.config import load_config
    from rl.placement import describe_placement

    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        "trainer.gpus_per_rank=1", "rollout.gpus_per_worker=2", "rollout.tensor_parallel_size=2", "rollout.num_workers=2",
        "trainer.sync_transport=nccl"])
    lines = dict(line.split(": ", 1) for line in describe_placement(cfg))
    assert "GPU: 1.0" in lines["trainer"]
    assert "GPUs: 2 per worker (tensor_parallel_size=2)" in lines["rollout"]
    assert "apart from the trainer's (2 x 2 + 1 x 1 whole GPUs)" in lines["rollout"] and "over NCCL" in lines["rollout"]
    shared = dict(line.split(": ", 1) for line in describe_placement(
        load_config(None, ["trainer.gpus_per_rank=0.5", "rollout.gpus_per_worker=0.5"])))
    assert "possibly sharing a GPU with the trainer" in shared["rollout"] and "/dev/shm" in shared["rollout"]
    cpu = dict(line.split(": ", 1) for line in describe_placement(load_config(None, [])))
    assert "GPU" not in cpu["rollout"]  # CPU runs print what they printed before


def test_start_up_refuses_gpus_ray_does_not_have(monkeypatch, caplog):
    import ray

    from rl.config import ConfigError, load_config
    from rl.placement import check_gpu_resources

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config(None, ["trainer.gpus_per_rank=1", "rollout.gpus_per_worker=1", "trainer.sync_transport=nccl"])
    with pytest.raises(ConfigError) as ei:
        check_gpu_resources(cfg)
    assert "2 GPU(s)" in str(ei.value) and "Ray sees 0" in str(ei.value) and "rollout.gpus_per_worker=1" in str(ei.value)
    check_gpu_resources(load_config(None, []))  # CPU runs ask for none
    monkeypatch.setenv("RAY_ADDRESS", "auto")  # a cluster may still add them: warn only
    check_gpu_resources(cfg)


def test_cpu_engines_refuse_tensor_parallel_and_nccl_weight_transfer(tmp_path, monkeypatch):
    from rl.rollout.engine import EngineConfig, EngineError
    from rl.rollout.engine_platform import gpu_llm_kwargs

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    assert gpu_llm_kwargs(EngineConfig(model_path=str(tmp_path)), is_cpu=True) == {}  # CPU engines: vLLM's arguments as before
    with pytest.raises(EngineError, match="CPU build runs one engine process"):
        gpu_llm_kwargs(EngineConfig(model_path=str(tmp_path), tensor_parallel_size=2), is_cpu=True)
    with pytest.raises(EngineError, match="needs a CUDA build of vLLM"):
        gpu_llm_kwargs(EngineConfig(model_path=str(tmp_path), weight_transfer="nccl"), is_cpu=True)
    kw = gpu_llm_kwargs(EngineConfig(model_path=str(tmp_path), tensor_parallel_size=2), is_cpu=False)
    assert kw == {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    with pytest.raises(EngineError):
        EngineConfig(model_path=str(tmp_path), tensor_parallel_size=0)


def test_nccl_stream_carries_what_the_bucket_transports_carry(tmp_path):
    """Names, order, dtypes, shapes and bytes of the NCCL stream equal the checkpoint tensors of an
    fp32 / bf16 bucket sync of the same module; a stream that drifts from the ticket raises."""
    import torch

    from model.shipped import build_random_checkpoint
    from rl.weights.nccl import NcclGroupInfo, NcclSyncError, NcclSyncTicket, TrainerNcclSender, trainer_pairs
    from rl.trainer.policy import load_policy
    from rl.weights import export_buckets, unpack_bucket

    module = load_policy(build_random_checkpoint("tiny", tmp_path / "m", seed=0))

    class _Spec:
        zero_stage = 1

    class _Trainer:  # what trainer_pairs reads of a PolicyTrainer
        spec, rank = _Spec(), 0

        def __init__(self, m):
            self.module = m

    t = _Trainer(module)
    named = list(module.named_parameters()) + [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
    for fmt, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        pairs = list(trainer_pairs(t, fmt, "cpu"))
        buckets = export_buckets(module, named, bucket_mb=1024.0, fmt=fmt)
        want = [(n, x.dtype, tuple(x.shape)) for b in buckets for n, x in unpack_bucket(b)]
        assert [(n, x.dtype, tuple(x.shape)) for n, x in pairs] == want
        assert all(x.dtype == dtype for _, x in pairs)
        ticket = NcclSyncTicket("g", tuple(n for n, _ in pairs), tuple(str(x.dtype).split(".")[-1] for _, x in pairs),
                                tuple(tuple(x.shape) for _, x in pairs))
        assert ticket.num_bytes == sum(x.numel() * x.element_size() for _, x in pairs) == sum(b.num_bytes for b in buckets)
    with pytest.raises(NcclSyncError, match="not supported over NCCL"):
        next(trainer_pairs(t, "mxfp4", "cpu"))
    sender = TrainerNcclSender(None, NcclGroupInfo("g", "127.0.0.1", 1, 2, 1 << 20), ticket, 0)
    assert len(list(sender._checked(iter(pairs)))) == len(pairs)
    with pytest.raises(NcclSyncError, match="the workers expect"):
        list(sender._checked(iter(pairs[1:])))
    with pytest.raises(NcclSyncError, match="sent .* tensors"):
        list(sender._checked(iter(pairs[:-1])))


def test_a_worker_outside_the_group_refuses_a_ticket_loudly():
    from rl.rollout.nccl_sync import receive_nccl_sync
    from rl.weights.nccl import NcclSyncError, NcclSyncTicket

    class _Impl:  # a rollout worker that never joined (e.g. one the dispatcher restarted)
        engine = None

    with pytest.raises(NcclSyncError, match="not in the run's NCCL group"):
        receive_nccl_sync(_Impl(), [NcclSyncTicket("g", ("a",), ("float32",), ((2,),))], 1)


# ----------------------------------------------------------------------------- GPU
@pytest.fixture(scope="module")
def tiny_qwen_moe(tmp_path_factory) -> Path:
    from tests.helpers.checkpoints import build_test_checkpoint

    return build_test_checkpoint(tmp_path_factory.mktemp("qmoe"))


def _cfg(model_dir: Path, run_dir: Path, extra: list[str]):
    from rl.config import load_config

    return load_config(None, [
        f"model.arch={model_dir}", f"run_dir={run_dir}", "name=gpu", "rollout.max_model_len=1024",
        "rollout.gpu_memory_utilization=0.3", "envs.weights={terminal: 1.0}", "logging.wandb_mode=disabled", *extra])


def _episodes(n: int, length: int, seed: int):
    """Sequences to score (the gap needs tokens, not an environment)."""
    import random

    from rl.types import Episode, RolloutGroup

    rng = random.Random(seed)
    eps = []
    for i in range(n):
        ids = tuple(rng.randrange(11, 8000) for _ in range(length))
        mask = tuple([0] * 16 + [1] * (length - 16))
        eps.append(Episode(task_id=f"t{i}", domain="terminal", group_id=f"g{i}", token_ids=ids, loss_mask=mask,
                           rollout_logprobs=tuple(0.0 for _ in mask), messages=(), reward=0.0))
    return [RolloutGroup(task_id="t", domain="terminal", episodes=tuple(eps))]


def _perturb(trainer, scale: float, seed: int) -> None:
    """Move every >= 2-D trainer weight by `scale` x its std (in place, on the trainer's device)."""
    import ray

    def move(w, scale, seed):
        import torch

        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in w.t.module.parameters():
                if p.dim() >= 2:
                    p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * (scale * float(p.float().std())))

    ray.get([w.__ray_call__.remote(move, scale, seed) for w in trainer.workers])


def _sync_and_gap(parts, label: str) -> dict[str, float]:
    """Gap on the loaded weights, after moving the trainer's (stale engine), after a sync, and after a second move + sync."""
    groups = _episodes(4, 96, seed=0)
    same = parts.sync.gap(groups).as_metrics()
    _perturb(parts.policy.trainer, 0.05, seed=1)
    stale = parts.sync.gap(groups).as_metrics()
    m1 = parts.sync.push().as_metrics()
    gap1 = parts.sync.gap(groups).as_metrics()
    _perturb(parts.policy.trainer, 0.05, seed=2)
    m2 = parts.sync.push().as_metrics()
    gap2 = parts.sync.gap(groups).as_metrics()
    fig = {"gap_mean_at_start": same["mismatch/logprob_abs_mean"], "gap_mean_stale": stale["mismatch/logprob_abs_mean"],
           "gap_mean_after_sync": gap1["mismatch/logprob_abs_mean"], "gap_max_after_sync": gap1["mismatch/logprob_abs_max"],
           "gap_mean_after_2nd_sync": gap2["mismatch/logprob_abs_mean"], "sync_s": m1["sync/seconds"], "sync2_s": m2["sync/seconds"],
           "sync_mb": m1["sync/bytes"] / 1e6, "sync_nccl": m1.get("sync/nccl", 0.0), "sync_shm": m1["sync/shm"]}
    _record(label, **fig)
    assert m1["sync/bytes"] > 0 and m2["sync/bytes"] == m1["sync/bytes"]
    # fp32 trainer and engine: after a sync they compute the same function (up to kernel rounding);
    # the stale engine is far off, so a sync that did not arrive cannot pass.
    for g in (gap1, gap2):
        assert g["mismatch/logprob_abs_mean"] < 5e-3 and g["mismatch/logprob_abs_max"] < 5e-2, fig
    assert stale["mismatch/logprob_abs_mean"] > 10 * max(gap1["mismatch/logprob_abs_mean"], 1e-6), fig
    return fig


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(GPUS == 0, reason=NO_CUDA)
def test_engine_builds_with_nccl_weight_transfer(tiny_qwen_moe):
    """One GPU: the engine's vLLM worker owns an NCCL weight-transfer engine (the installed vLLM takes
    `weight_transfer_config`), generates and scores."""
    import ray

    from rl.rollout.engine import EngineConfig, GenerateRequest
    from rl.rollout.worker import rollout_worker_actor

    ray.init(address="local", num_cpus=4, include_dashboard=False)
    try:
        ecfg = EngineConfig(model_path=str(tiny_qwen_moe), max_model_len=1024, gpu_memory_utilization=0.3, weight_transfer="nccl")
        h = rollout_worker_actor(num_gpus=1).remote(ecfg)
        kinds = ray.get(h.__ray_call__.remote(
            lambda impl: impl.engine.llm.collective_rpc(lambda w: type(getattr(w, "weight_transfer_engine", None)).__name__)))
        [res] = ray.get(h.generate.remote([GenerateRequest(prompt_token_ids=tuple(range(20, 60)), max_tokens=8)]))
        [lp] = ray.get(h.score.remote([tuple(range(20, 60))]))
        health = ray.get(h.health.remote())
    finally:
        ray.shutdown()
    _record("engine_builds_with_nccl_weight_transfer", startup_s=health.startup_s, weight_transfer_engine=",".join(kinds))
    assert not health.is_cpu and all("NCCL" in k for k in kinds), kinds
    assert len(res.token_ids) > 0 and lp.shape == (39,) and all(math.isfinite(x) for x in lp)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(GPUS < 2, reason=NO_CUDA if GPUS == 0 else NEEDS_TWO)
def test_nccl_sync_then_engine_matches_trainer(tiny_qwen_moe, tmp_path):
    """Trainer rank 0 on one GPU broadcasts over NCCL into the engine on another; the gap closes after each sync."""
    from rl.setup import start_run

    parts = start_run(_cfg(tiny_qwen_moe, tmp_path / "run", ["trainer.gpus_per_rank=1", "rollout.gpus_per_worker=1",
                                                              "trainer.sync_transport=nccl"]))
    try:
        fig = _sync_and_gap(parts, "nccl_sync_then_gap")
    finally:
        parts.close()
    assert fig["sync_nccl"] == 1.0


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(GPUS < 2, reason=NO_CUDA if GPUS == 0 else NEEDS_TWO)
def test_tensor_parallel_2_engine_matches_trainer_after_sync(tiny_qwen_moe, tmp_path):
    """A TP=2 engine on two GPUs serves what the trainer computes after a sync: over NCCL with a third GPU
    for the trainer, else through the bucket path (pickled to both TP ranks) with a trainer Ray gives no GPU."""
    from rl.setup import start_run

    placement = (["trainer.gpus_per_rank=1", "trainer.sync_transport=nccl"] if GPUS >= 3 else ["trainer.gpus_per_rank=0"])
    parts = start_run(_cfg(tiny_qwen_moe, tmp_path / "run", ["rollout.gpus_per_worker=2", "rollout.tensor_parallel_size=2",
                                                              *placement]))
    try:
        fig = _sync_and_gap(parts, f"tensor_parallel_2_{'nccl' if GPUS >= 3 else 'buckets'}")
    finally:
        parts.close()
    assert fig["sync_nccl"] == (1.0 if GPUS >= 3 else 0.0)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(GPUS == 0, reason=NO_CUDA)
def test_two_step_rl_run_on_gpus(tmp_path):
    """`jointrl train` on the small HybridMoe, 2 RL steps: trainer and rollout on separate GPUs with NCCL
    sync when there are two, else sharing one (fractional Ray GPUs, /dev/shm sync). Run dir:
    $JOINTRL_GPU_RUN_DIR if set (scripts/gpu_smoke.sh prints its figures), else a temporary one."""
    run_dir = Path(os.environ.get("JOINTRL_GPU_RUN_DIR") or tmp_path / "run")
    placement = (["trainer.gpus_per_rank=1", "rollout.gpus_per_worker=1", "trainer.sync_transport=nccl"] if GPUS >= 2 else
                 ["trainer.gpus_per_rank=0.5", "rollout.gpus_per_worker=0.5", "rollout.gpu_memory_utilization=0.3"])
    cmd = [sys.executable, "-m", "rl.cli", "train", "configs/tiny.yaml", "model.arch=small", "name=gpu-smoke",
           f"run_dir={run_dir}", "trainer.resume=false", "trainer.steps=2", "trainer.sft_steps=4", "trainer.tasks_per_step=2",
           "trainer.checkpoint_every=0", "algorithm.group_size=4", "algorithm.dynamic_sampling=off",
           "envs.weights={terminal: 1.0}", "envs.max_turns=3", "rollout.max_new_tokens_per_turn=96", "eval.n_per_domain=2",
           "logging.wandb_mode=disabled", *placement]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    from rl.observe.sink import read_metrics

    steps = [m for m in read_metrics(run_dir) if "sync/seconds" in m]
    assert len(steps) >= 2, steps
    keys = ("time/step_s", "time/rollout_s", "time/rollout_generate_s", "time/train_s", "time/sync_s", "sync/seconds",
            "sync/bytes", "mismatch/logprob_abs_mean", "mismatch/logprob_abs_max")
    for i, m in enumerate(steps[-2:]):
        _record(f"rl_run_step{i}", placement="separate GPUs, nccl" if GPUS >= 2 else "one shared GPU",
                **{k: float(m[k]) for k in keys if isinstance(m.get(k), (int, float))}, sync_nccl=float(m.get("sync/nccl") or 0.0))
        gap = m.get("mismatch/logprob_abs_mean")
        assert isinstance(gap, float) and math.isfinite(gap) and gap < 0.05, m
        assert m.get("sync/nccl", 0.0) == (1.0 if GPUS >= 2 else 0.0)
