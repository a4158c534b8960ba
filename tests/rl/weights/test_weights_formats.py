"""Weight-sync formats (fp32 / bf16 / MXFP4) and the zero-copy wire format, end to end.

CPU part (fast): MXFP4 buckets against the reference path `model.mxfp4_export.pack_for_sync` /
`unpack_from_sync` applied to each checkpoint tensor, byte accounting against `count_sync_bytes`,
and a Ray round trip proving the receiving side reads the object store in place.

Engine part (slow, one vLLM engine for the module): a real `RolloutWorkerImpl` on a tiny Qwen3-MoE
receives syncs as Ray object refs. Oracles are HF logprobs computed in a child process
(`tests.helpers.reference.run_reference`): after an fp32 sync the engine serves the trainer's weights;
after an MXFP4 sync it serves exactly the *dequantized* weights (HF on a checkpoint whose expert
weights went through `model.mxfp4.fake_quantize_mxfp4`), which proves the sync path adds nothing
beyond the quantisation itself. The gap to the unquantized trainer weights is measured and printed.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from rl.weights import WeightBucket, WeightSyncError, make_buckets, sync_bytes, to_checkpoint_format, unpack_bucket

from tests.rl.rollout.rollout_helpers import fixed_sequences, max_abs_diff, random_qwen3_moe


def _reference_decode(ckpt: dict[str, torch.Tensor], rest: str, dtype: torch.dtype | None = None):
    """The slow, obvious path: pack_for_sync / unpack_from_sync on each checkpoint tensor on its own."""
    from model.mxfp4_export import pack_for_sync, unpack_from_sync

    payloads = {n: pack_for_sync(n, t, "mxfp4", include="experts", fallback=rest) for n, t in ckpt.items()}
    return payloads, {n: unpack_from_sync(p, dtype=dtype if p.fmt == "mxfp4" else None) for n, p in payloads.items()}


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("moe_inter", [32, 24])  # 24: down_proj's last dim is not a multiple of 32 -> stays high precision
def test_mxfp4_buckets_decode_like_pack_for_sync_and_count_bytes_like_it(copy, moe_inter):
    from model.mxfp4_export import count_sync_bytes

    m = random_qwen3_moe(moe_inter=moe_inter)
    ckpt = to_checkpoint_format(m.state_dict(), "qwen3_moe")
    payloads, want = _reference_decode(ckpt, "fp32")
    buckets = make_buckets(m.state_dict(), "qwen3_moe", bucket_mb=0.05, fmt="mxfp4", copy=copy)
    assert len(buckets) > 1
    got = dict(p for b in buckets for p in unpack_bucket(b))
    assert list(got) == list(ckpt)
    for n, t in got.items():
        assert t.dtype == torch.float32 and t.shape == ckpt[n].shape, n
        assert torch.equal(t, want[n]), n  # bit-exact: quantizing the fused tensor == quantizing each expert
    enc = {e.name: e.encoding for b in buckets for e in b.entries}
    quantized = {n for n in ckpt if ".experts." in n and ckpt[n].shape[-1] % 32 == 0}
    assert {n for n, e in enc.items() if e == "mxfp4"} == quantized
    assert any("down_proj" in n for n in quantized) == (moe_inter == 32)
    for n in ckpt:  # routers, norms, embeddings, attention: exact
        if n not in quantized:
            assert torch.equal(got[n], ckpt[n]), n
            assert ".mlp.gate." not in n or enc[n] == "raw"
    ours, ref = sync_bytes(buckets), count_sync_bytes(payloads.values())
    assert ours == ref
    n_q = sum(ckpt[n].numel() for n in quantized)
    n_rest = sum(t.numel() for n, t in ckpt.items() if n not in quantized)
    assert ours.sent == n_q * 17 // 32 + 4 * n_rest  # 16 bytes of codes + 1 scale byte per 32 weights
    assert ours.fp32 == 4 * (n_q + n_rest) and ours.vs_fp32 < 0.75


def test_mxfp4_dequantizes_to_the_requested_dtype_and_rest_can_be_bf16():
    m = random_qwen3_moe()
    ckpt = to_checkpoint_format(m.state_dict(), "qwen3_moe")
    _, want = _reference_decode(ckpt, "bf16", dtype=torch.bfloat16)
    buckets = make_buckets(m.state_dict(), "qwen3_moe", fmt="mxfp4", mxfp4_rest="bf16")
    got = dict(p for b in buckets for p in unpack_bucket(b, dequant_dtype=torch.bfloat16))
    for n, t in got.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, want[n]), n
    s = sync_bytes(buckets)
    assert s.sent < sync_bytes(make_buckets(m.state_dict(), "qwen3_moe", fmt="mxfp4")).sent
    assert s.vs_bf16 < 0.75


def test_mxfp4_refuses_non_finite_expert_weights_naming_the_tensor():
    m = random_qwen3_moe()
    sd = dict(m.state_dict())
    sd["model.layers.1.mlp.experts.down_proj"] = sd["model.layers.1.mlp.experts.down_proj"].clone()
    sd["model.layers.1.mlp.experts.down_proj"][2, 3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.down_proj"):
        make_buckets(sd, "qwen3_moe", fmt="mxfp4")


def test_buckets_cross_ray_and_are_read_in_place():
    """ray.get hands back read-only views of the object store; unpack builds tensors over them without copying."""
    import ray

    m = random_qwen3_moe()
    ckpt = to_checkpoint_format(m.state_dict(), "qwen3_moe")
    buckets = make_buckets(m.state_dict(), "qwen3_moe", bucket_mb=64, copy=False)
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        (b,) = ray.get([ray.put(bk) for bk in buckets])
        assert isinstance(b, WeightBucket)
        assert all(not buf.flags.writeable for buf in b.buffers if buf.size >= 1024)  # shared memory, not a private copy
        for n, t in unpack_bucket(b):
            assert torch.equal(t, ckpt[n]), n
            seg = next(e for e in b.entries if e.name == n).parts[0]
            base = b.buffers[seg.buffer].ctypes.data
            assert t.data_ptr() == base + seg.offset, n  # a view of the received buffer
    finally:
        ray.shutdown()
    with pytest.raises(WeightSyncError, match="sync format"):
        make_buckets(m.state_dict(), "qwen3_moe", fmt="int4")


# ----------------------------------------------------------------------------- engine (slow)
SEQS = fixed_sequences(4, 32, seed=0)
FP32_TOL = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """ckpt (engine start), trainer state 1 (fp32, perturbed), HF logprobs of state 1 and of its MXFP4-dequantized twin."""
    from safetensors.torch import save_file

    from model.mxfp4 import fake_quantize_mxfp4
    from model.mxfp4_export import plan_tensor
    from tests.helpers.checkpoints import TinyModelSpec, build_tiny_checkpoint
    from tests.helpers.reference import ReferenceJob, run_reference

    ckpt = build_tiny_checkpoint(tmp_path_factory.mktemp("moe"), TinyModelSpec(kind="qwen3_moe"))
    ref = run_reference(ReferenceJob(checkpoint=str(ckpt), out_dir=str(tmp_path_factory.mktemp("ref")), sequences=SEQS,
                                     num_steps=1, perturb_scale=0.1))
    state1 = torch.load(ref[1]["state_path"])
    # Independent construction of the weights an MXFP4 sync should produce: fake-quantize the fused
    # expert tensors (codec round trip), then the checkpoint conversion tested against save_pretrained.
    fq = {n: fake_quantize_mxfp4(t) if plan_tensor(n, t, "experts").quantize else t for n, t in state1.items()}
    assert sum(plan_tensor(n, t, "experts").quantize for n, t in state1.items()) == 4  # gate_up + down, 2 layers
    dq_dir = tmp_path_factory.mktemp("dq")
    for f in ckpt.iterdir():
        if f.suffix == ".json" or f.name.startswith("tokenizer"):
            shutil.copy(f, dq_dir / f.name)
    save_file({k: v.contiguous() for k, v in to_checkpoint_format(fq, "qwen3_moe").items()}, str(dq_dir / "model.safetensors"),
              metadata={"format": "pt"})
    dq_ref = run_reference(ReferenceJob(checkpoint=str(dq_dir), out_dir=str(tmp_path_factory.mktemp("dqref")), sequences=SEQS))
    return {"ckpt": ckpt, "state1": state1, "fp32_lp": ref[1]["logprobs"], "dq_lp": dq_ref[0]["logprobs"], "ckpt_lp": ref[0]["logprobs"]}


@pytest.fixture(scope="module")
def worker_and_ray(setup):
    import ray

    from rl.rollout.engine import EngineConfig
    from rl.rollout.worker import RolloutWorkerImpl

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    w = RolloutWorkerImpl(EngineConfig(model_path=str(setup["ckpt"]), dtype="float32", max_model_len=256, kv_cache_gib=0.25, seed=0))
    yield w
    w.shutdown()
    ray.shutdown()


def _sync(worker, state, fmt: str, version: int):
    import ray

    buckets = make_buckets(state, "qwen3_moe", bucket_mb=0.5, fmt=fmt, copy=False)  # several buckets, whole layers each
    assert len(buckets) > 1
    refs = [ray.put(b) for b in buckets]  # what TrainerWorker.export_weights returns
    stats = worker.update_weights(refs, version=version)
    return stats, sync_bytes(buckets)


@pytest.mark.slow
def test_fp32_then_mxfp4_then_bf16_syncs_serve_what_was_sent(worker_and_ray, setup):
    w = worker_and_ray
    eng = w.engine
    assert max_abs_diff(eng.score(SEQS), setup["ckpt_lp"]) <= FP32_TOL  # fresh engine == HF on the checkpoint

    st32, b32 = _sync(w, setup["state1"], "fp32", 1)
    gap32 = max_abs_diff(eng.score(SEQS), setup["fp32_lp"])
    assert gap32 <= FP32_TOL, f"fp32 sync: engine vs HF(trainer) {gap32:.3g}"
    assert st32.num_bytes == b32.sent == b32.fp32 and st32.repacked_moe_layers == 2 and st32.policy_version == 1

    stq, bq = _sync(w, setup["state1"], "mxfp4", 2)
    lp_q = eng.score(SEQS)
    exact = max_abs_diff(lp_q, setup["dq_lp"])
    gap = max_abs_diff(lp_q, setup["fp32_lp"])
    mean_gap = float(np.mean(np.concatenate([np.abs(a - b) for a, b in zip(lp_q, setup["fp32_lp"])])))
    assert exact <= FP32_TOL, f"mxfp4 sync: engine vs HF(dequantized weights) {exact:.3g} > {FP32_TOL}"
    assert gap > 10 * FP32_TOL, "the MXFP4 sync did not change the served model (quantisation should)"
    assert stq.num_bytes == bq.sent and stq.repacked_moe_layers == 2 and stq.policy_version == 2
    assert bq.sent < 0.5 * b32.sent  # experts dominate this model's bytes

    st16, b16 = _sync(w, setup["state1"], "bf16", 3)
    lp16 = eng.score(SEQS)
    gap16 = max_abs_diff(lp16, setup["fp32_lp"])
    mean16 = float(np.mean(np.concatenate([np.abs(a - b) for a, b in zip(lp16, setup["fp32_lp"])])))
    assert st16.num_bytes == b16.sent == b16.bf16
    print(f"\n[sync formats] bytes: fp32 {b32.sent}  bf16 {b16.sent} ({b16.vs_fp32:.3f}x fp32)  "
          f"mxfp4 {bq.sent} ({bq.vs_fp32:.3f}x fp32, {bq.vs_bf16:.3f}x bf16)\n"
          f"[sync formats] engine vs HF: fp32 sync max {gap32:.2e}; mxfp4 sync vs dequantized max {exact:.2e}; "
          f"mxfp4 gap to trainer max {gap:.3f} mean {mean_gap:.4f}; bf16 gap to trainer max {gap16:.4f} mean {mean16:.5f}")

    _sync(w, setup["state1"], "fp32", 4)  # and back: every sync reloads in place and re-applies the MoE repack
    assert max_abs_diff(eng.score(SEQS), setup["fp32_lp"]) <= FP32_TOL
