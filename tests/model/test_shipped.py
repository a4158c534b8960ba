"""model/shipped.py: the shipped configs, the tokenizer copy and the random-checkpoint builder."""
from __future__ import annotations

import json

from model import chat
from model.shipped import COMPLETE_MARKER, build_random_checkpoint, copy_tokenizer


def test_shipped_config_is_built_once_with_fixed_seed(tmp_path):
    from safetensors import safe_open

    a = build_random_checkpoint("tiny", tmp_path / "a", seed=0)
    b = build_random_checkpoint("tiny", tmp_path / "b", seed=0)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (a / f).is_file()
    with safe_open(a / "model.safetensors", "pt") as fa, safe_open(b / "model.safetensors", "pt") as fb:
        keys = sorted(fa.keys())
        assert keys == sorted(fb.keys()) and any(".experts.0." in k for k in keys)  # per-expert layout vLLM loads
        assert all(fa.get_tensor(k).equal(fb.get_tensor(k)) for k in keys)
    assert json.loads((a / "config.json").read_text())["model_type"] == "hybrid_moe"
    assert chat.load_tokenizer(a).convert_tokens_to_ids(chat.THINK_END_TOKEN) == chat.THINK_END_ID


def test_a_complete_checkpoint_is_reused_and_a_partial_one_rebuilt(tmp_path):
    a = build_random_checkpoint("tiny", tmp_path / "a", seed=0)
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert build_random_checkpoint("tiny", a, seed=0) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp
    (a / COMPLETE_MARKER).unlink()  # an interrupted build: rebuilt, not trusted
    build_random_checkpoint("tiny", a, seed=1)
    assert (a / COMPLETE_MARKER).exists() and json.loads((a / COMPLETE_MARKER).read_text())["seed"] == 1
    assert not list(tmp_path.glob("a.tmp*"))


def test_copy_tokenizer_keeps_the_checkpoints_own_files_unless_told(tmp_path):
    dst = tmp_path / "ckpt"
    dst.mkdir()
    (dst / "tokenizer_config.json").write_text("{}")
    copy_tokenizer(dst)
    assert (dst / "tokenizer_config.json").read_text() == "{}"
    assert (dst / "tokenizer.json").read_bytes() == (chat.TOKENIZER_DIR / "tokenizer.json").read_bytes()
    assert not (dst / "corpus_manifest.json").exists()  # the tokenizer trainer's manifest is not a tokenizer file
    copy_tokenizer(dst, overwrite=True)
    assert (dst / "tokenizer_config.json").read_bytes() == (chat.TOKENIZER_DIR / "tokenizer_config.json").read_bytes()
