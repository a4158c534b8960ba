"""MXFP4 checkpoints and sync payloads (model/mxfp4_export.py) on real, tiny, random-weight models:
transformers' Qwen3-MoE and this project's HybridMoe. CPU only; ~30 s."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from model.mxfp4 import MXFP4Error, fake_quantize_mxfp4, quantize_mxfp4
from model.mxfp4_export import (
    MXFP4ExportError,
    SyncPayload,
    compare_models,
    count_sync_bytes,
    export_mxfp4,
    load_mxfp4_model,
    load_mxfp4_state_dict,
    main_export,
    pack_for_sync,
    plan_tensor,
    unpack_from_sync,
)


def _tiny_qwen3_moe():
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=160, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _fake_quant_experts(m):
    """The same model with every parameter whose name has 'experts' replaced by dequant(quant(.))."""
    q = copy.deepcopy(m)
    with torch.no_grad():
        for n, p in q.named_parameters():
            if "experts" in n:
                p.copy_(fake_quantize_mxfp4(p))
    return q


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    m = _tiny_qwen3_moe()
    src = tmp_path_factory.mktemp("qwen") / "src"
    m.save_pretrained(src)
    (src / "tokenizer_config.json").write_text("{}")  # any non-weight file must be carried over
    return m, src


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    import model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    m = AutoModelForCausalLM.from_config(model.load_shipped_config("tiny")).eval()
    src = tmp_path_factory.mktemp("hybrid") / "src"
    m.save_pretrained(src)
    return m, src


# ----------------------------------------------------------------------------- export layout
def test_export_experts_layout_config_and_bytes(qwen, tmp_path):
    m, src = qwen
    out = tmp_path / "out"
    rep = export_mxfp4(src, out, "experts")
    src_sd = load_file(str(src / "model.safetensors"))
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        expert_names = [n for n in src_sd if "experts" in n]
        assert expert_names and all(src_sd[n].dim() == 2 for n in expert_names)  # per-expert on disk
        for n in expert_names:
            b, s = f.get_tensor(n + "_blocks"), f.get_tensor(n + "_scales")
            o, i = src_sd[n].shape
            assert b.shape == (o, i // 32, 16) and s.shape == (o, i // 32) and b.dtype == s.dtype == torch.uint8
            rb, rs = quantize_mxfp4(src_sd[n])
            assert torch.equal(b, rb) and torch.equal(s, rs)
            assert n not in names
        for n, t in src_sd.items():  # routers, attention, norms, embeddings: bit-identical copies
            if "experts" not in n:
                assert torch.equal(f.get_tensor(n), t), n
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "mxfp4" and qc["block_size"] == 32 and qc["include"] == "experts"
    assert "model.layers.*.mlp.gate.weight" in qc["modules_to_not_convert"]
    assert (out / "tokenizer_config.json").is_file()
    n_exp = sum(src_sd[n].numel() for n in expert_names)
    n_rest = sum(t.numel() for n, t in src_sd.items() if "experts" not in n)
    assert rep.params_quantized == n_exp and rep.params_total == n_exp + n_rest
    assert rep.bytes_out == n_exp // 32 * 17 + n_rest * 4  # fp32 source: 17 B / 32 values + 4 B per other value
    assert rep.bytes_fp16 == 2 * (n_exp + n_rest)
    assert rep.file_bytes_out == (out / "model.safetensors").stat().st_size
    assert set(rep.quantized) == set(expert_names)


def test_load_state_dict_is_exactly_fake_quant(qwen, tmp_path):
    m, src = qwen
    export_mxfp4(src, tmp_path / "out", "experts")
    sd = load_mxfp4_state_dict(tmp_path / "out")
    src_sd = load_file(str(src / "model.safetensors"))
    assert set(sd) == set(src_sd)
    for n, t in src_sd.items():
        want = fake_quantize_mxfp4(t) if "experts" in n else t
        assert sd[n].dtype == t.dtype and torch.equal(sd[n], want), n
    bf = load_mxfp4_state_dict(tmp_path / "out", dtype=torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in bf.values())


def test_loaded_qwen3_moe_equals_in_memory_fake_quant(qwen, tmp_path):
    m, src = qwen
    export_mxfp4(src, tmp_path / "out", "experts")
    q = load_mxfp4_model(tmp_path / "out")
    ref_q = _fake_quant_experts(m)
    ids = torch.randint(0, 160, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lq, lrq, lr = q(ids).logits, ref_q(ids).logits, m(ids).logits
    assert torch.equal(lq, lrq)  # the export/load path adds nothing beyond the codec
    assert not torch.equal(lq, lr)  # and the quantization really happened


def test_hybrid_moe_export_load_and_all_linear_policy(hybrid, tmp_path):
    m, src = hybrid
    export_mxfp4(src, tmp_path / "e", "experts")
    q = load_mxfp4_model(tmp_path / "e")
    assert type(q).__name__ == "HybridMoeForCausalLM"
    ids = torch.randint(20, 1000, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(q(ids).logits, _fake_quant_experts(m)(ids).logits)

    rep = export_mxfp4(src, tmp_path / "a", "all_linear")
    quantized = set(rep.quantized)
    kept = dict(rep.kept)
    for n in quantized:
        assert "norm" not in n and ".mlp.gate." not in n and "indexer" not in n and "embed" not in n
    assert any("q_proj" in n for n in quantized) and any("out_proj" in n for n in quantized)
    assert any("shared_expert.up_proj" in n for n in quantized)
    for n in ("model.layers.0.mlp.gate.weight", "model.embed_tokens.weight", "lm_head.weight",
              "model.layers.0.linear_attn.in_proj_ba.weight", "model.layers.3.self_attn.indexer.wq.weight",
              "model.layers.0.mlp.shared_expert_gate.weight"):
        assert n in kept, n
    sd = load_mxfp4_state_dict(tmp_path / "a")
    src_sd = load_file(str(src / "model.safetensors"))
    assert torch.equal(sd["model.layers.0.mlp.gate.weight"], src_sd["model.layers.0.mlp.gate.weight"])
    qa = load_mxfp4_model(tmp_path / "a")
    c = compare_models(m, qa, ids)
    assert 0 < c.mean_abs_logit_err and c.positions == 20


def test_fused_3d_experts_and_gptoss_decoder(tmp_path):
    """A checkpoint with fused [E, out, in] experts: blocks along `in`, readable by transformers' gpt-oss decoder."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    src = tmp_path / "src"
    src.mkdir()
    tensors = {"model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 96, 64, generator=g),
               "model.layers.0.mlp.experts.down_proj": torch.randn(4, 64, 48, generator=g),  # in=48: kept
               "model.layers.0.mlp.router.weight": torch.randn(4, 64, generator=g)}
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "toy"}))
    rep = export_mxfp4(src, tmp_path / "out", "experts")
    assert rep.quantized == ("model.layers.0.mlp.experts.gate_up_proj",)
    assert dict(rep.kept)["model.layers.0.mlp.experts.down_proj"] == "last dimension 48 is not a multiple of 32"
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        b = f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_blocks")
        s = f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_scales")
    assert b.shape == (4, 96, 2, 16) and s.shape == (4, 96, 2)
    sd = load_mxfp4_state_dict(tmp_path / "out")
    w = sd["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(w, fake_quantize_mxfp4(tensors["model.layers.0.mlp.experts.gate_up_proj"]))
    assert torch.equal(convert_moe_packed_tensors(b, s, dtype=torch.float32), w.transpose(1, 2))
    assert torch.equal(sd["model.layers.0.mlp.experts.down_proj"], tensors["model.layers.0.mlp.experts.down_proj"])


def test_sharded_checkpoint_and_rest_dtype(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    a = {"m.experts.0.w.weight": torch.randn(8, 64, generator=g)}
    b = {"m.norm.weight": torch.randn(64, generator=g), "m.experts.1.w.weight": torch.randn(8, 32, generator=g)}
    save_file(a, str(src / "model-00001-of-00002.safetensors"))
    save_file(b, str(src / "model-00002-of-00002.safetensors"))
    wm = {**{k: "model-00001-of-00002.safetensors" for k in a}, **{k: "model-00002-of-00002.safetensors" for k in b}}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (src / "config.json").write_text("{}")
    export_mxfp4(src, tmp_path / "out", rest_dtype=torch.bfloat16)
    idx = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert idx["m.experts.1.w.weight_blocks"] == "model-00002-of-00002.safetensors"
    sd = load_mxfp4_state_dict(tmp_path / "out")
    assert sd["m.norm.weight"].dtype == torch.bfloat16 and torch.equal(sd["m.norm.weight"], b["m.norm.weight"].bfloat16())
    assert sd["m.experts.1.w.weight"].dtype == torch.float32  # original dtype restored


# ----------------------------------------------------------------------------- bad input
def test_export_and_load_refuse_bad_input(qwen, tmp_path):
    m, src = qwen
    with pytest.raises(MXFP4ExportError, match="no config.json"):
        export_mxfp4(tmp_path, tmp_path / "o1")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(MXFP4ExportError, match="not empty"):
        export_mxfp4(src, tmp_path / "busy")
    with pytest.raises(ValueError, match="include must be one of"):
        export_mxfp4(src, tmp_path / "o2", "everything")  # type: ignore[arg-type]
    with pytest.raises(MXFP4ExportError, match="not an MXFP4 checkpoint"):
        load_mxfp4_state_dict(src)
    export_mxfp4(src, tmp_path / "q")
    with pytest.raises(MXFP4ExportError, match="already quantized"):
        export_mxfp4(tmp_path / "q", tmp_path / "o3")
    # a NaN in an expert weight: a broken checkpoint, refused with the tensor's name
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    w = torch.randn(4, 64)
    w[2, 7] = float("nan")
    save_file({"layer.experts.0.up.weight": w}, str(bad / "model.safetensors"))
    with pytest.raises(MXFP4ExportError, match=r"layer\.experts\.0\.up\.weight.*non-finite.*flat index 135"):
        export_mxfp4(bad, tmp_path / "o4")
    # an orphan _blocks tensor
    orphan = tmp_path / "orphan"
    orphan.mkdir()
    (orphan / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}}))
    save_file({"x_blocks": torch.zeros(1, 1, 16, dtype=torch.uint8)}, str(orphan / "model.safetensors"))
    with pytest.raises(MXFP4ExportError, match="no matching 'x_scales'"):
        load_mxfp4_state_dict(orphan)


def test_main_export_finds_checkpoint_in_run_dir(qwen, tmp_path, capsys):
    m, src = qwen
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    for f in src.iterdir():
        (run / "checkpoints" / "step_2" / f.name).write_bytes(f.read_bytes())
    assert main_export(str(run), str(tmp_path / "out"), "experts") == 0
    out = capsys.readouterr().out
    assert "step_2" in out and "tensors quantized" in out
    assert main_export(str(tmp_path / "nowhere"), str(tmp_path / "o2"), "experts") == 2
    assert "no such file" in capsys.readouterr().err


# ----------------------------------------------------------------------------- weight sync
def test_sync_roundtrip_bytes_and_policy(qwen):
    m, _ = qwen
    sd = m.state_dict()  # in-memory names: fused 3-D experts
    fused = [n for n in sd if "experts" in n]
    assert fused and all(sd[n].dim() == 3 for n in fused)
    payloads = [pack_for_sync(n, t, "mxfp4") for n, t in sd.items()]
    for p, (n, t) in zip(payloads, sd.items()):
        p2 = SyncPayload.from_bytes(p.to_bytes())  # what crosses a process boundary
        assert (p2.name, p2.shape, p2.dtype, p2.fmt) == (n, tuple(t.shape), "float32", p.fmt)
        got = unpack_from_sync(p2)
        if "experts" in n:
            assert p.fmt == "mxfp4" and torch.equal(got, fake_quantize_mxfp4(t))
        else:
            assert p.fmt == "fp32" and torch.equal(got, t)  # router and norms arrive exactly
    n_exp = sum(sd[n].numel() for n in fused)
    n_all = sum(t.numel() for t in sd.values())
    sb = count_sync_bytes(payloads)
    assert sb.sent == n_exp // 32 * 17 + (n_all - n_exp) * 4
    assert sb.fp32 == 4 * n_all and sb.bf16 == 2 * n_all and sb.n_mxfp4 == len(fused)
    sb16 = count_sync_bytes(pack_for_sync(n, t, "bf16") for n, t in sd.items())
    assert sb16.sent == sb16.bf16 and sb16.vs_fp32 == 0.5
    p = pack_for_sync("x.mlp.gate.weight", sd["model.layers.0.mlp.gate.weight"], "bf16")
    assert torch.equal(unpack_from_sync(p), sd["model.layers.0.mlp.gate.weight"].bfloat16().float())
    assert unpack_from_sync(payloads[0], dtype=torch.bfloat16).dtype == torch.bfloat16


def test_sync_bad_input():
    with pytest.raises(ValueError, match="fmt must be"):
        pack_for_sync("a.experts.w", torch.ones(2, 32), "fp8")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="torch.Tensor"):
        pack_for_sync("a.experts.w", [1.0])  # type: ignore[arg-type]
    w = torch.ones(2, 32)
    w[1, 3] = float("inf")
    with pytest.raises(MXFP4Error, match=r"a\.experts\.w.*non-finite"):
        pack_for_sync("a.experts.w", w)
    odd = pack_for_sync("a.experts.w", torch.ones(2, 48))  # not divisible by 32: falls back, not refused
    assert odd.fmt == "fp32" and plan_tensor("a.experts.w", torch.ones(2, 48)).reason.startswith("last dimension 48")


# ----------------------------------------------------------------------------- evaluation helper
def test_compare_models_against_direct_formulas(qwen):
    m, _ = qwen
    q = _fake_quant_experts(m)
    ids = torch.randint(0, 160, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on the first row
    c = compare_models(m, q, ids, mask)
    with torch.no_grad():
        a, b = m(input_ids=ids, attention_mask=mask).logits, q(input_ids=ids, attention_mask=mask).logits
    kls, gaps, agree, errs = [], [], [], []
    for r in range(2):
        for t in range(9):
            if not mask[r, t]:
                continue
            kls.append(F.kl_div(b[r, t].log_softmax(-1), a[r, t].log_softmax(-1), log_target=True, reduction="sum").item())
            agree.append(float(a[r, t].argmax() == b[r, t].argmax()))
            errs.append((a[r, t] - b[r, t]).abs())
            if t + 1 < 9 and mask[r, t + 1]:
                nxt = ids[r, t + 1]
                gaps.append(abs(a[r, t].log_softmax(-1)[nxt].item() - b[r, t].log_softmax(-1)[nxt].item()))
    assert c.positions == len(kls) == 15
    assert c.mean_kl == pytest.approx(sum(kls) / len(kls), rel=1e-4, abs=1e-9)
    assert c.next_token_agreement == pytest.approx(sum(agree) / len(agree))
    assert c.mean_abs_logprob_gap == pytest.approx(sum(gaps) / len(gaps), rel=1e-4)
    assert c.max_abs_logit_err == pytest.approx(torch.stack(errs).max().item())
    same = compare_models(m, m, ids)
    assert same.max_abs_logit_err == 0 and same.next_token_agreement == 1 and same.mean_kl == 0


def test_compare_models_replays_reference_routes(hybrid, qwen):
    m, _ = hybrid
    q = _fake_quant_experts(m)
    ids = torch.randint(20, 1000, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        routes = m(ids).routed_experts
        want = q(ids, routed_experts=routes).logits
    c = compare_models(m, q, ids, replay_routes=True)
    assert c.max_abs_logit_err == pytest.approx((m(ids).logits - want).abs().max().item())
    with pytest.raises(ValueError, match="routed_experts"):
        compare_models(qwen[0], qwen[0], ids % 160, replay_routes=True)
