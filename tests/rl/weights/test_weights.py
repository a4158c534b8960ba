"""rl/weights (names, encode, wire): trainer (fused) names -> checkpoint names, bucketing, the zero-copy wire format; engine update validation.

CPU-only and fast: no vLLM engine is started here. The oracle for the name mapping is transformers'
own `save_pretrained` (what vLLM's loader reads), plus a from-the-formula expert MLP.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rl.rollout.engine_platform import EngineError, check_update_complete
from rl.weights import (
    Segment,
    SyncStaging,
    TensorEntry,
    WeightBucket,
    WeightSyncError,
    entries_from_wire,
    entries_to_wire,
    export_buckets,
    layout_key,
    make_buckets,
    pack_bucket,
    plan_buckets,
    plan_sync,
    tensor_bytes,
    to_checkpoint_format,
    total_bytes,
    unit_of,
    unpack_bucket,
)


def _tiny_qwen3_moe(tie: bool = False):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, intermediate_size=48, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                         tie_word_embeddings=tie)
    torch.manual_seed(0)
    m = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()  # distinct values everywhere, so a wrong slice cannot pass by accident
    return m


def _tiny_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(1)
    m = MixtralForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    return m


def _assert_matches_save_pretrained(model, tmp_path, model_type: str, tie: bool) -> None:
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    ours = to_checkpoint_format(model.state_dict(), model_type, tie_word_embeddings=tie)
    assert set(ours) == set(saved), (sorted(set(ours) ^ set(saved)))[:6]
    for name, t in saved.items():
        assert ours[name].shape == t.shape, name
        assert torch.equal(ours[name], t), name


def test_qwen3_moe_names_and_values_match_save_pretrained(tmp_path):
    m = _tiny_qwen3_moe()
    assert "model.layers.0.mlp.experts.gate_up_proj" in m.state_dict()  # transformers 5 keeps experts fused
    _assert_matches_save_pretrained(m, tmp_path, "qwen3_moe", tie=False)


def test_tied_embeddings_drop_lm_head_like_save_pretrained(tmp_path):
    m = _tiny_qwen3_moe(tie=True)
    assert "lm_head.weight" in m.state_dict()
    _assert_matches_save_pretrained(m, tmp_path, "qwen3_moe", tie=True)


def test_mixtral_w1_w3_w2_names_match_save_pretrained(tmp_path):
    m = _tiny_mixtral()
    _assert_matches_save_pretrained(m, tmp_path, "mixtral", tie=False)


def test_split_experts_compute_the_fused_expert_mlp():
    """From the formula: expert e of a SwiGLU MoE computes down_e(silu(gate_e x) * up_e x)."""
    m = _tiny_qwen3_moe()
    experts = m.model.layers[1].mlp.experts
    ckpt = to_checkpoint_format(m.state_dict(), "qwen3_moe")
    torch.manual_seed(3)
    x_ND = torch.randn(5, 32)
    for e in range(4):
        p = f"model.layers.1.mlp.experts.{e}."
        g, u, d = ckpt[p + "gate_proj.weight"], ckpt[p + "up_proj.weight"], ckpt[p + "down_proj.weight"]
        ref_ND = (torch.nn.functional.silu(x_ND @ g.T) * (x_ND @ u.T)) @ d.T
        idx_NK = torch.full((5, 1), e)
        w_NK = torch.ones(5, 1)
        with torch.no_grad():
            got_ND = experts(x_ND, idx_NK, w_NK)
        torch.testing.assert_close(got_ND, ref_ND, rtol=1e-5, atol=1e-5)


def test_dtype_cast_and_bad_fused_shape():
    m = _tiny_qwen3_moe()
    out = to_checkpoint_format(m.state_dict(), "qwen3_moe", dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in out.values())
    with pytest.raises(WeightSyncError, match="gate_up_proj"):
        to_checkpoint_format({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 8)}, "qwen3_moe")
    with pytest.raises(WeightSyncError, match="2 x moe_intermediate_size"):
        to_checkpoint_format({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 7, 8)}, "qwen3_moe")


def test_buckets_cover_everything_once_keep_units_whole_and_respect_the_size():
    m = _tiny_qwen3_moe()
    ckpt = to_checkpoint_format(m.state_dict(), "qwen3_moe")
    unit_bytes: dict[str, int] = {}
    for n, t in ckpt.items():
        unit_bytes[unit_of(n)] = unit_bytes.get(unit_of(n), 0) + tensor_bytes(t)
    limit_mb = 0.03  # ~31 KB: smaller than a layer (several units per bucket impossible), larger than most lone tensors
    plan = plan_buckets(ckpt, limit_mb)
    flat = [n for b in plan for n in b]
    assert flat == list(ckpt)  # every tensor once, order preserved
    seen_units: dict[str, int] = {}
    for i, names in enumerate(plan):
        for n in names:
            assert seen_units.setdefault(unit_of(n), i) == i, f"unit {unit_of(n)} split across buckets"
        size = sum(tensor_bytes(ckpt[n]) for n in names)
        units = {unit_of(n) for n in names}
        assert size <= limit_mb * 2**20 or len(units) == 1, (i, size, units)
    assert unit_of("model.layers.12.mlp.experts.3.up_proj.weight") == "model.layers.12"
    assert unit_of("model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert len(plan_buckets(ckpt, 1000.0)) == 1
    with pytest.raises(WeightSyncError):
        plan_buckets(ckpt, 0)


@pytest.mark.parametrize("copy", [True, False])
def test_pack_unpack_roundtrip_is_exact_and_bytes_are_counted(copy):
    m = _tiny_qwen3_moe()
    buckets = make_buckets(m.state_dict(), "qwen3_moe", bucket_mb=0.05, copy=copy)
    assert len(buckets) > 1
    ckpt = to_checkpoint_format(m.state_dict(), "qwen3_moe")
    got: dict[str, torch.Tensor] = {}
    for b in buckets:
        assert isinstance(b, WeightBucket)
        pairs = unpack_bucket(b)
        assert [n for n, _ in pairs] == list(b.names)
        assert b.num_bytes == sum(t.numel() * t.element_size() for _, t in pairs)
        got.update(pairs)
    assert list(got) == list(ckpt)  # checkpoint order kept across buckets
    for n in ckpt:
        assert got[n].shape == ckpt[n].shape and torch.equal(got[n], ckpt[n]), n
    assert total_bytes(buckets) == sum(p.numel() * 4 for p in m.parameters())
    with pytest.raises(WeightSyncError, match="expected a WeightBucket"):
        unpack_bucket(123)  # type: ignore[arg-type]
    one = pack_bucket({"a": torch.ones(3), "b": torch.arange(4), "c": torch.zeros(0, 2)})
    assert one.names == ("a", "b", "c") and one.num_bytes == 12 + 32
    a, b, c = (t for _, t in unpack_bucket(one))
    assert torch.equal(a, torch.ones(3)) and torch.equal(b, torch.arange(4)) and c.shape == (0, 2)


def test_safetensors_bytes_still_decode(tmp_path):
    from safetensors.torch import save

    t = {"x.weight": torch.randn(3, 4), "y.bias": torch.randn(2).to(torch.bfloat16)}
    got = dict(unpack_bucket(save(t)))
    assert got.keys() == t.keys() and all(torch.equal(got[k], t[k]) for k in t)


def test_copy_false_aliases_the_source_and_copy_true_snapshots_it():
    """Zero-copy export: per-expert entries are byte ranges of the fused source; unpack gives views, not copies."""
    m = _tiny_qwen3_moe()
    sd = {n: t for n, t in m.state_dict().items()}
    fused = sd["model.layers.0.mlp.experts.gate_up_proj"]  # [E, 2I, H]
    (alias,) = make_buckets(sd, "qwen3_moe", bucket_mb=64, copy=False)
    (snap,) = make_buckets(sd, "qwen3_moe", bucket_mb=64, copy=True)
    assert len(snap.buffers) == 1  # one flat buffer + an index
    assert any(np.shares_memory(buf, fused.numpy()) for buf in alias.buffers)
    assert not np.shares_memory(snap.buffers[0], fused.numpy())
    up1 = dict(unpack_bucket(alias))["model.layers.0.mlp.experts.1.up_proj.weight"]
    inter = fused.shape[1] // 2
    assert up1.data_ptr() == fused[1, inter:].data_ptr()  # a view of expert 1's up rows, no copy
    before = dict(unpack_bucket(snap))["model.layers.0.mlp.experts.1.up_proj.weight"].clone()
    with torch.no_grad():
        fused[1, inter:] += 1.0
    assert torch.equal(up1, before + 1.0)  # the alias sees the change ...
    assert torch.equal(dict(unpack_bucket(snap))["model.layers.0.mlp.experts.1.up_proj.weight"], before)  # ... the snapshot does not
    for e in snap.entries:  # 64-byte aligned parts in the flat buffer
        assert all(p.offset % 64 == 0 for p in e.parts) or ".experts." in e.name


def test_staging_is_reused_across_exports_and_casts_in_the_gather():
    m = _tiny_qwen3_moe()
    sd = dict(m.state_dict())
    staging = SyncStaging()
    first = make_buckets(sd, "qwen3_moe", bucket_mb=0.05, fmt="bf16", staging=staging)
    ptrs = [b.buffers[0].ctypes.data for b in first]
    size = staging.nbytes
    ckpt = to_checkpoint_format(sd, "qwen3_moe")
    for b in first:
        for n, t in unpack_bucket(b):
            assert t.dtype == torch.bfloat16 and torch.equal(t, ckpt[n].to(torch.bfloat16)), n
    with torch.no_grad():
        sd = {n: t + 1.0 for n, t in sd.items()}
    second = make_buckets(sd, "qwen3_moe", bucket_mb=0.05, fmt="bf16", staging=staging)
    assert [b.buffers[0].ctypes.data for b in second] == ptrs and staging.nbytes == size  # same memory, no new allocation
    w = first[-1].names[0]
    assert torch.equal(dict(unpack_bucket(first[-1]))[w], dict(unpack_bucket(second[-1]))[w])  # the old buckets alias it
    assert torch.equal(dict(unpack_bucket(second[-1]))[w], to_checkpoint_format(sd, "qwen3_moe")[w].to(torch.bfloat16))
    with pytest.raises(WeightSyncError, match="copy=True"):
        make_buckets(sd, "qwen3_moe", copy=False, staging=staging)


def test_bucket_validation_names_what_is_wrong():
    with pytest.raises(WeightSyncError, match="uint8"):
        WeightBucket(entries=(), buffers=(np.zeros(4, dtype=np.float32),))
    seg = Segment(buffer=0, offset=8, nbytes=16)
    with pytest.raises(WeightSyncError, match="outside"):
        WeightBucket(entries=(TensorEntry("w", "raw", "float32", (4,), (seg,)),), buffers=(np.zeros(16, dtype=np.uint8),))
    with pytest.raises(WeightSyncError, match="mxfp4 needs 2|raw needs 1"):
        WeightBucket(entries=(TensorEntry("w", "mxfp4", "float32", (32,), (seg,)),), buffers=(np.zeros(32, dtype=np.uint8),))
    m = _tiny_qwen3_moe()
    with pytest.raises(WeightSyncError, match="fp8"):
        make_buckets(m.state_dict(), "qwen3_moe", fmt="fp8")
    with pytest.raises(WeightSyncError, match="mxfp4_rest"):
        make_buckets(m.state_dict(), "qwen3_moe", fmt="mxfp4", mxfp4_rest="fp16")


def test_export_buckets_drops_non_persistent_buffers_and_casts():
    m = _tiny_qwen3_moe()
    named = list(m.named_parameters()) + [(n, b) for n, b in m.named_buffers()]
    assert any("inv_freq" in n for n, _ in named)  # a non-persistent buffer a trainer might yield
    buckets = export_buckets(m, named, bucket_mb=64, fmt="bf16")
    names = {n for b in buckets for n in b.names}
    assert not any("inv_freq" in n for n in names)
    ckpt = to_checkpoint_format(m.state_dict(), "qwen3_moe")
    assert names == set(ckpt)
    for b in buckets:
        for n, t in unpack_bucket(b):
            assert t.dtype == torch.bfloat16 and torch.equal(t, ckpt[n].to(torch.bfloat16)), n
    assert total_bytes(buckets) == sum(p.numel() * 2 for p in m.parameters())
    with pytest.raises(WeightSyncError, match="'fp8'"):
        export_buckets(m, named, fmt="fp8")


def test_update_validation_refuses_partial_fused_parameters():
    full_layer = [f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    check_update_complete(full_layer + ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                                        "model.layers.0.self_attn.v_proj.weight", "model.norm.weight"], num_experts=4)
    with pytest.raises(EngineError, match=r"only part of MoE layer 'model\.layers\.0\.mlp\.experts'"):
        check_update_complete(full_layer[:-3], num_experts=4)
    with pytest.raises(EngineError, match="send all experts"):
        check_update_complete([n for n in full_layer if "down_proj" not in n], num_experts=4)
    with pytest.raises(EngineError, match="k_proj"):
        check_update_complete(["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight"], num_experts=None)
    with pytest.raises(EngineError, match="gate_proj"):
        check_update_complete(["model.layers.1.mlp.up_proj.weight"], num_experts=None)
    with pytest.raises(EngineError, match="no expert count"):
        check_update_complete(full_layer, num_experts=None)


# ----------------------------------------------------------------------------- the cached layout
def _buckets_equal(got: list[WeightBucket], want: list[WeightBucket]) -> None:
    assert [b.entries for b in got] == [b.entries for b in want]
    for g, w in zip(got, want):
        for (n, a), (m, b) in zip(unpack_bucket(g), unpack_bucket(w)):
            assert n == m and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), n


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "mxfp4"])
def test_a_layout_is_reused_while_names_shapes_and_dtypes_match_and_rebuilt_when_they_change(fmt):
    """The cached plan gives exactly what a fresh plan gives, and any change of name, shape, dtype or format arguments rebuilds it."""
    sd = dict(_tiny_qwen3_moe().state_dict())
    first = plan_sync(sd, "qwen3_moe", 0.05, fmt=fmt)
    with torch.no_grad():
        sd2 = {n: t * 0.5 + 1.0 for n, t in sd.items()}  # new values (and new tensor objects), same signature
    again = plan_sync(sd2, "qwen3_moe", 0.05, fmt=fmt, reuse=first.layout)
    assert again.layout is first.layout
    for copy in (True, False):
        _buckets_equal(again.to_buckets(copy=copy), make_buckets(sd2, "qwen3_moe", 0.05, fmt=fmt, copy=copy))

    gate_up = "model.layers.1.mlp.experts.gate_up_proj"
    changes = {
        "shape": sd2 | {gate_up: torch.randn(4, 96, 32)},  # wider experts under the same name
        "dtype": sd2 | {"model.norm.weight": sd2["model.norm.weight"].to(torch.bfloat16)},
        "name": {("model.final_norm.weight" if n == "model.norm.weight" else n): t for n, t in sd2.items()},
        "dropped": {n: t for n, t in sd2.items() if n != "lm_head.weight"},
        "order": dict(reversed(list(sd2.items()))),
    }
    for what, state in changes.items():
        p = plan_sync(state, "qwen3_moe", 0.05, fmt=fmt, reuse=first.layout)
        assert p.layout is not first.layout, what
        _buckets_equal(p.to_buckets(), make_buckets(state, "qwen3_moe", 0.05, fmt=fmt))
    for kw in ({"bucket_mb": 0.1}, {"mxfp4_rest": "bf16"}, {"fmt": "keep" if fmt != "keep" else "fp32"}):
        args = {"bucket_mb": 0.05, "fmt": fmt} | kw
        assert plan_sync(sd2, "qwen3_moe", reuse=first.layout, **args).layout is not first.layout, kw
    assert plan_sync(sd2, "mixtral", 0.05, fmt=fmt, reuse=first.layout).layout is not first.layout
    assert plan_sync(sd2, "qwen3_moe", 0.05, fmt=fmt, tie_word_embeddings=True, reuse=first.layout).layout is not first.layout
    assert layout_key(sd2, "qwen3_moe", 0.05, fmt, "fp32") == first.layout.key


def test_staging_reuses_its_gather_targets_and_follows_a_new_layout():
    sd = dict(_tiny_qwen3_moe().state_dict())
    staging = SyncStaging()
    p1 = plan_sync(sd, "qwen3_moe", 0.05, fmt="bf16")
    b1 = p1.to_buckets(staging=staging)
    targets = [staging.targets(i, p1.layout)[1] for i in range(len(p1.layout.buckets))]
    assert all(staging.targets(i, p1.layout)[1] is t for i, t in enumerate(targets))  # built once per buffer and layout
    with torch.no_grad():
        sd = {n: t - 2.0 for n, t in sd.items()}
    _buckets_equal(plan_sync(sd, "qwen3_moe", 0.05, fmt="bf16", reuse=p1.layout).to_buckets(staging=staging),
                   make_buckets(sd, "qwen3_moe", 0.05, fmt="bf16"))
    assert [b.buffers[0].ctypes.data for b in b1]  # the old buckets alias the same staging memory (documented)
    grown = sd | {"model.layers.1.mlp.experts.gate_up_proj": torch.randn(4, 96, 32)}
    p2 = plan_sync(grown, "qwen3_moe", 0.05, fmt="bf16", reuse=p1.layout)
    assert p2.layout is not p1.layout
    _buckets_equal(p2.to_buckets(staging=staging), make_buckets(grown, "qwen3_moe", 0.05, fmt="bf16"))


def test_the_index_pickles_as_one_interned_blob_and_unpack_reuses_its_views():
    import pickle

    m = _tiny_qwen3_moe()
    (b,) = make_buckets(m.state_dict(), "qwen3_moe", bucket_mb=64, fmt="fp32")
    r1, r2 = pickle.loads(pickle.dumps(b, protocol=5)), pickle.loads(pickle.dumps(b, protocol=5))
    assert r1.entries == b.entries and r1.entries is r2.entries  # interned: one tuple of entries for one index
    assert r1.wire_index() == entries_to_wire(b.entries) and entries_from_wire(r1.wire_index()) is r1.entries
    _buckets_equal([r1], [b])
    first, second = unpack_bucket(r1), unpack_bucket(r1)
    assert all(x is y for (_, x), (_, y) in zip(first, second))  # the same views, not rebuilt
    assert first is not second  # ... in a fresh list each time
    (q,) = make_buckets(m.state_dict(), "qwen3_moe", bucket_mb=64, fmt="mxfp4")
    d1, d2 = dict(unpack_bucket(q)), dict(unpack_bucket(q))
    w = "model.layers.0.mlp.experts.1.up_proj.weight"
    assert torch.equal(d1[w], d2[w]) and d1[w].data_ptr() != d2[w].data_ptr()  # dequantized anew on every call
    assert d1["model.norm.weight"] is d2["model.norm.weight"]  # raw entries of an mxfp4 bucket are cached views
