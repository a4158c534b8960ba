"""Tests for the shipped tokenizer (model/tokenizer/) and scripts/train_tokenizer.py:
loading through transformers.AutoTokenizer, vocabulary and special-token ids, byte-level
losslessness, and byte-for-byte reproduction of the shipped files by the training script."""
from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from model import chat

from tests import REPO as ROOT
SHIPPED = ROOT / "model" / "tokenizer"
SCRIPT = ROOT / "scripts" / "train_tokenizer.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("train_tokenizer", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(SHIPPED))


def test_shipped_files_present():
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "corpus_manifest.json"):
        assert (SHIPPED / name).is_file(), name
    cfg = json.loads((SHIPPED / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == chat.CHAT_TEMPLATE, "chat template changed: rerun scripts/train_tokenizer.py"
    assert cfg["eos_token"] == "<|im_end|>" and cfg["pad_token"] == "<|pad|>"


def test_autotokenizer_vocab_and_special_ids(tok):
    assert len(tok) == 8192 and tok.vocab_size == 8192
    assert max(tok.get_vocab().values()) == 8191 and len(tok.get_vocab()) == 8192
    for i, t in enumerate(chat.SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(t) == i
        assert tok.convert_ids_to_tokens(i) == t
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == chat.EOS_ID
    assert tok.pad_token_id == chat.PAD_ID
    assert tok.bos_token is None
    # No BOS/EOS is added implicitly: the chat template owns all structure.
    assert tok("hello world")["input_ids"] == tok("hello world", add_special_tokens=False)["input_ids"]


def test_reasoning_strings_encode_to_single_ids(tok):
    # Exactly what vLLM's ReasoningConfig.initialize_token_ids does with these strings.
    assert tok.encode(chat.REASONING_START_STR, add_special_tokens=False) == [chat.THINK_START_ID]
    assert tok.encode(chat.REASONING_END_STR, add_special_tokens=False) == [chat.THINK_END_ID]


def test_special_tokens_are_atomic_inside_text(tok):
    for i, t in enumerate(chat.SPECIAL_TOKENS):
        ids = tok.encode(f"ab{t}cd", add_special_tokens=False)
        assert ids.count(i) == 1, t
        assert tok.decode(ids) == f"ab{t}cd"


def test_skip_special_tokens_keeps_reasoning_and_tool_markers(tok):
    text = "<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|><|pad|><|image|><|endoftext|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    # pad / endoftext / im_start / im_end / image are dropped; the markers parsers need stay.
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    # transformers' own notion of "special" (used by slow detokenisation paths) agrees.
    assert sorted(tok.all_special_ids) == [chat.PAD_ID, chat.ENDOFTEXT_ID, chat.IM_START_ID, chat.IM_END_ID, chat.IMAGE_ID]
    assert tok.convert_ids_to_tokens(list(range(11)), skip_special_tokens=True) == list(chat.NON_SKIPPED_TOKENS)


def test_byte_level_round_trip_is_lossless(tok):
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(0, 0x250)] + list("中文日本語한국어😀🚀👍🏽\u200b\u202e\ufeff\r\n\t")
    for _ in range(300):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    std = Path(sysconfig.get_paths()["stdlib"])
    for name in ("json/decoder.py", "textwrap.py"):
        s = (std / name).read_text(encoding="utf-8")
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s


def test_numbers_are_split_into_single_digits(tok):
    vocab = tok.get_vocab()
    multi = [t for t in vocab if sum(ch.isdigit() for ch in tok.convert_tokens_to_string([t])) > 1]
    assert multi == []
    assert tok.tokenize("12345") == ["1", "2", "3", "4", "5"]


def test_compresses_held_out_code_and_prose(tok):
    # Held-out text (never in the training corpus): a byte-level vocabulary of 8192 merges should
    # give well over 3 bytes per token on Python code; raw bytes would give 1.
    std = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "pathlib.py"):
        s = (std / name).read_text(encoding="utf-8")
        ratio = len(s.encode()) / len(tok.encode(s, add_special_tokens=False))
        assert ratio > 3.3, (name, ratio)


def test_script_refuses_wrong_package_versions(monkeypatch):
    mod = _load_script()
    src = mod.PackageSource("datasets", "0.0.1", "datasets", ("*.py",))
    with pytest.raises(SystemExit, match="datasets .* is installed but the corpus is defined on the pinned 0.0.1"):
        mod.package_group(src, allow_version_mismatch=False)


def test_training_reproduces_shipped_files_byte_for_byte(tmp_path):
    mod = _load_script()
    shipped = json.loads((SHIPPED / "corpus_manifest.json").read_text())
    groups = mod.build_corpus(allow_version_mismatch=True)
    now = mod.manifest(groups)
    if now != shipped:
        diff = [g["name"] for g, h in zip(now["groups"], shipped["groups"]) if g != h]
        pytest.skip(f"this environment's corpus differs from the shipped one in {diff or 'settings'} "
                    f"(tokenizers {now['tokenizers_version']} vs {shipped['tokenizers_version']}); "
                    "byte-for-byte reproduction is only defined on the pinned environment")
    out = tmp_path / "tok"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "corpus_manifest.json"):
        assert (out / name).read_bytes() == (SHIPPED / name).read_bytes(), name


@pytest.mark.slow
def test_vllm_loads_tokenizer_and_renders_the_same_prompt():
    # vLLM's own tokenizer loader and its content-format detection (imports vLLM: ~10-20 s).
    from vllm.renderers.hf import _detect_content_format
    from vllm.tokenizers import get_tokenizer

    from jointrl.records import Message, ToolCall

    t = get_tokenizer(str(SHIPPED))
    msgs = [Message("system", "s"), Message("user", "hi", images=(b"png",)),
            Message("assistant", "ok", reasoning="r", tool_calls=(ToolCall("call_0_0", "f", '{"a": 1}'),)),
            Message("tool", "res", tool_call_id="call_0_0")]
    tools = [{"type": "function", "function": {"name": "f"}}]
    got = t.apply_chat_template(chat.to_template_messages(msgs), tools=tools, tokenize=False, add_generation_prompt=True)
    assert got == chat.render(msgs, tools=tools, add_generation_prompt=True)
    assert t.eos_token_id == chat.EOS_ID
    # Content given as parts (text + images) reaches the template as parts, not flattened text.
    assert _detect_content_format(chat.CHAT_TEMPLATE, default="string") == "openai"


@pytest.mark.slow
def test_vllm_builtin_hermes_and_r1_parsers_read_our_format():
    # For vLLM's OpenAI server: --reasoning-parser deepseek_r1 --tool-call-parser hermes.
    from vllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
    from vllm.tokenizers import get_tokenizer
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    from jointrl.records import Message, ToolCall

    t = get_tokenizer(str(SHIPPED))
    m = Message("assistant", "Let me check.", reasoning="plan {it}",
                tool_calls=(ToolCall("call_0_0", "bash", '{"command": "ls \\"x\\""}'), ToolCall("call_0_1", "f", "{}")))
    generated = chat.render_completion(m)[: -len(chat.IM_END_TOKEN)]  # the server's text has no stop token
    reasoning, content = DeepSeekR1ReasoningParser(t).extract_reasoning(generated, None)
    assert reasoning.strip("\n") == "plan {it}"  # those parsers keep the format's newlines
    info = Hermes2ProToolParser(t).extract_tool_calls(content, None)
    assert info.tools_called and info.content.strip("\n") == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == [("bash", {"command": 'ls "x"'}), ("f", {})]
