"""Chat codecs (rl/rollout/codec): the prefix property on five formats, typed tool calls equal across
codecs, parse errors, generation caps, the config keys and the checkpoint default.

Real parts throughout: vLLM's registered tool / reasoning parsers, `apply_chat_template` on real
templates (vLLM's bundled chatml, SmolLM2-135M-Instruct's own from `model.hub.pull`, the shipped
jointrl one, a fixture that drops earlier reasoning the way Qwen3's does) and harmony through
`openai_harmony`. The episode is assembled with `rl.sft.transcript_to_episode`, which builds it from
the codec exactly as the agent loop does (prompt, per turn the completion, then the environment delta).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from jointrl.records import Message, Task, ToolCall
from rl.rollout.codec import CodecError, as_codec, default_codec_name, make_codec, resolve_codec_name
from rl.rollout.codec.hf import HERMES_TOOLS_HEADER, HarmonyRenderer, HfCodec
from rl.sft import transcript_to_episode
from tests import REPO
from tests.helpers.checkpoints import train_tokenizer
from tests.helpers.harmony_tokenizer import HarmonyTokenizer

FIXTURES = REPO / "tests" / "fixtures" / "chat_templates"
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                                           "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                          "required": ["command"]}}}]


def _call(turn: int, cmd: str) -> ToolCall:
    return ToolCall(id=f"call_{turn}_0", name="bash", arguments=json.dumps({"command": cmd}))


# A multi-turn tool conversation: reasoning, tool calls, tool results, a second user message.
CONVO = (
    Message(role="system", content="You are terse."),
    Message(role="user", content="What is in /tmp?"),
    Message(role="assistant", content="", reasoning="Use ls.", tool_calls=(_call(0, "ls /tmp"),)),
    Message(role="tool", content="a.txt\nb.txt", tool_call_id="call_0_0"),
    Message(role="assistant", content="Two files: a.txt and b.txt.", reasoning="Two files."),
    Message(role="user", content="Delete b.txt."),
    Message(role="assistant", content="", reasoning="rm it.", tool_calls=(_call(2, "rm /tmp/b.txt"),)),
    Message(role="tool", content="removed", tool_call_id="call_2_0"),
    Message(role="assistant", content="Done."),
)
N_PROMPT = 2
TASK = Task(id="codec-t0", domain="terminal", prompt=CONVO[:N_PROMPT])


def _vllm_chatml() -> str:
    import vllm

    return (Path(vllm.__file__).parent / "transformers_utils" / "chat_templates" / "template_chatml.jinja").read_text()


def _tiny_checkpoint(root: Path, template: str) -> Path:
    """A checkpoint directory's tokenizer files: a real byte-level BPE (ChatML specials) + `template`."""
    from transformers import AutoTokenizer

    d = train_tokenizer(root)
    tok = AutoTokenizer.from_pretrained(str(d))
    tok.chat_template = template
    tok.save_pretrained(str(d))
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return d


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {"chatml": _tiny_checkpoint(tmp_path_factory.mktemp("chatml"), _vllm_chatml()),
            "drops": _tiny_checkpoint(tmp_path_factory.mktemp("drops"), (FIXTURES / "drops_reasoning.jinja").read_text())}


@pytest.fixture(scope="module")
def smollm2():
    from model import hub

    return hub.pull("smollm2-135m")


def _assembled(codec) -> list[int]:
    ep = transcript_to_episode(TASK, CONVO, TOOLS, N_PROMPT, codec.tokenizer, codec)
    return list(ep.token_ids)


def _whole(codec) -> list[int]:
    """The whole conversation rendered at once, up to its last end-of-turn token."""
    return codec._closed(CONVO, TOOLS)


def _check_prefix_stable(codec: HfCodec) -> None:
    for k in range(N_PROMPT + 1, len(CONVO)):  # every turn boundary: m[:k+1] extends m[:k] token-wise
        a, b = codec._closed(CONVO[:k], TOOLS), codec._closed(CONVO[: k + 1], TOOLS)
        assert b[: len(a)] == a, k
    assert _assembled(codec) == _whole(codec)  # appending deltas == rendering the whole
    assert codec.prefix_stable is True


def test_vllm_chatml_is_prefix_stable_with_hermes_tools_in_the_system_message(dirs):
    codec = make_codec("hf", dirs["chatml"], tool_parser="hermes")
    _check_prefix_stable(codec)
    text = codec.tokenizer.decode(_assembled(codec), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n" + HERMES_TOOLS_HEADER)  # no tool section: Hermes-style
    assert '<tool_call>\n{"name": "bash", "arguments": {"command": "ls /tmp"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n<tool_response>\na.txt\nb.txt\n</tool_response><|im_end|>" in text


def test_harmony_through_openai_harmony_is_prefix_stable_with_full_history():
    r = HarmonyRenderer()
    codec = HfCodec(HarmonyTokenizer(), r, tool_parser="openai", reasoning_parser="openai_gptoss", eos_ids=r.stop_ids,
                    end_token_id=r.end_id)
    _check_prefix_stable(codec)
    text = codec.tokenizer.decode(_assembled(codec))
    assert text.count("<|channel|>analysis") == 3  # every turn keeps its reasoning
    assert "<|start|>functions.bash<|channel|>commentary to=assistant<|message|>removed<|end|>" in text


def test_harmony_dropping_analysis_is_detected_and_the_seen_tokens_are_kept(caplog):
    r = HarmonyRenderer(auto_drop_analysis=True)  # openai_harmony's default: drop analysis before a final answer
    codec = HfCodec(HarmonyTokenizer(), r, tool_parser="openai", reasoning_parser="openai_gptoss", eos_ids=r.stop_ids,
                    end_token_id=r.end_id)
    with caplog.at_level(logging.WARNING):
        got = codec.tokenizer.decode(_assembled(codec))
    assert codec.prefix_stable is False
    assert "Use ls." in got and "Use ls." not in codec.tokenizer.decode(_whole(codec))


def test_template_that_drops_earlier_reasoning_is_detected_once_and_history_is_retained(dirs, caplog):
    codec = make_codec("hf", dirs["drops"], tool_parser="hermes")
    with caplog.at_level(logging.WARNING, logger="jointrl.codec"):
        ids = _assembled(codec)
        _assembled(codec)  # a second episode: no second warning
    assert codec.prefix_stable is False
    assert sum("not prefix-stable" in r.getMessage() for r in caplog.records) == 1
    tok = codec.tokenizer
    got, whole = tok.decode(ids, skip_special_tokens=False), tok.decode(_whole(codec), skip_special_tokens=False)
    # The re-render drops the first turns' thinking once a new user message comes; the episode keeps it.
    assert "Use ls." in got and "Two files." in got and "Use ls." not in whole
    # From the new user turn on, both agree token for token.
    tail = whole[whole.index("<|im_start|>user\nDelete"):]
    assert got.endswith(tail)
    # Before the drop the template was prefix-stable: the first tool turn's delta is the user-wrapped response.
    assert "<|im_end|>\n<|im_start|>user\n<tool_response>\na.txt\nb.txt\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in got


def test_jointrl_codec_is_model_chat_unchanged():
    from model import chat

    codec = make_codec("jointrl", None)
    ids = _assembled(codec)
    assert ids == codec.tokenizer.encode(chat.render(list(CONVO), TOOLS), add_special_tokens=False)[:-1]  # up to the last <|im_end|>
    assert codec.stop_token_ids == (chat.IM_END_ID,) and codec.end_token_id == chat.IM_END_ID
    assert codec.reasoning_markers == ("<think>", "</think>") and codec.pad_token_id == chat.PAD_ID
    # The module itself, as the older callers pass it, becomes the same codec.
    legacy = as_codec(chat, codec.tokenizer, end_token_id=chat.IM_END_ID)
    assert _assembled(legacy) == ids


@pytest.mark.slow  # the first model.hub.pull downloads and converts SmolLM2 (later pulls are a cache hit)
def test_smollm2_own_template_is_prefix_stable_and_parses_hermes_calls(smollm2):
    codec = make_codec(default_codec_name(str(smollm2)), smollm2, tool_parser="hermes")
    assert codec.name == "hf" and codec.reasoning_markers is None
    tok = codec.tokenizer
    assert codec.end_token_id == tok.convert_tokens_to_ids("<|im_end|>") and codec.end_token_id in codec.stop_token_ids
    _check_prefix_stable(codec)
    ids = codec.completion_ids(list(CONVO[:2]), CONVO[2], TOOLS)
    assert codec.parse(ids, 0, TOOLS).message.tool_calls == CONVO[2].tool_calls


def _codecs_for_parity(dirs):
    from model import chat

    r = HarmonyRenderer()
    shipped = make_codec("hf", chat.TOKENIZER_DIR, tool_parser="hermes", reasoning_parser="deepseek_r1")
    return {"jointrl": make_codec("jointrl", None), "hf-shipped-template": shipped,
            "hf-chatml": make_codec("hf", dirs["chatml"], tool_parser="hermes"),
            "hf-drops": make_codec("hf", dirs["drops"], tool_parser="hermes"),
            "harmony": HfCodec(HarmonyTokenizer(), r, tool_parser="openai", reasoning_parser="openai_gptoss",
                               eos_ids=r.stop_ids, end_token_id=r.end_id)}


def test_tool_calls_parse_into_the_same_typed_tool_calls_as_the_jointrl_codec(dirs):
    codecs = _codecs_for_parity(dirs)
    for turn, k in ((0, 2), (2, 6)):
        msg = CONVO[k]
        want = codecs["jointrl"].parse(codecs["jointrl"].completion_ids(CONVO[:k], msg, TOOLS), turn, TOOLS).message
        assert want.tool_calls == msg.tool_calls and want.reasoning == msg.reasoning
        for name, codec in codecs.items():
            got = codec.parse(codec.completion_ids(CONVO[:k], msg, TOOLS), turn, TOOLS)
            assert got.message.tool_calls == want.tool_calls, name
            assert got.ended and not got.errors, (name, got.errors)
            if codec.reasoning_markers or name == "harmony":  # formats with a reasoning parser keep the thinking
                assert got.message.reasoning == want.reasoning, name
    shipped = codecs["hf-shipped-template"]
    assert shipped.reasoning_markers == ("<think>", "</think>")  # deepseek_r1's markers, one token each
    text = shipped.parse(shipped.completion_ids(CONVO[:4], CONVO[4], TOOLS), 1, TOOLS).message
    assert (text.content, text.reasoning, text.tool_calls) == (CONVO[4].content, CONVO[4].reasoning, ())


def test_malformed_calls_become_call_errors_and_a_cut_turn_is_not_ended(dirs):
    codec = make_codec("hf", dirs["chatml"], tool_parser="hermes")
    tok = codec.tokenizer
    bad = tok.encode('<tool_call>\n{"name": "bash", "arguments": {"command": \n</tool_call><|im_end|>', add_special_tokens=False)
    p = codec.parse(bad, 0, TOOLS)
    assert p.message.tool_calls == () and len(p.call_errors) == 1 and p.ended
    # vLLM's hermes parser drops every call of a reply when one is malformed: both are reported.
    two = tok.encode('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n<tool_call>\n{oops}\n</tool_call>',
                     add_special_tokens=False)
    p = codec.parse(two, 0, TOOLS)
    assert p.message.tool_calls == () and len(p.call_errors) == 2 and not p.ended


def test_tool_parser_name_selects_vllms_parser(dirs):
    xml = ("<tool_call>\n<function=bash>\n<parameter=command>\nls /tmp\n</parameter>\n</function>\n</tool_call><|im_end|>")
    hermes = make_codec("hf", dirs["chatml"], tool_parser="hermes")
    coder = make_codec("hf", dirs["chatml"], tool_parser="qwen3_coder")
    ids = hermes.tokenizer.encode(xml, add_special_tokens=False)
    assert coder.parse(ids, 0, TOOLS).message.tool_calls == (_call(0, "ls /tmp"),)
    assert hermes.parse(ids, 0, TOOLS).message.tool_calls == ()


def test_thinking_tiers_cap_generation_for_a_format_without_reasoning(dirs):
    from rl.rollout.agent_loop import LoopSettings, _generation_caps

    s = LoopSettings(max_new_tokens_per_turn=256, thinking_budgets={"low": 64, "high": 300, "max": -1})
    plain = make_codec("hf", dirs["chatml"], tool_parser="hermes")
    thinking = make_codec("jointrl", None)
    assert [_generation_caps(plain, s, t, room=1000) for t in ("low", "high", "max")] == [(64, None), (256, None), (256, None)]
    assert [_generation_caps(thinking, s, t, room=1000) for t in ("low", "high", "max")] == [(256, 64), (256, 300), (256, None)]


def test_thinking_token_ids_come_from_the_codecs_own_tokenizer(dirs):
    """Telemetry counts thinking tokens between these ids: each format's own, never another vocabulary's."""
    from model import chat
    from rl.rollout.codec import reasoning_token_ids

    assert reasoning_token_ids(make_codec("jointrl", None)) == (chat.THINK_START_ID, chat.THINK_END_ID)
    assert reasoning_token_ids(make_codec("hf", dirs["chatml"], tool_parser="hermes")) is None  # no thinking block
    shipped = make_codec("hf", chat.TOKENIZER_DIR, tool_parser="hermes", reasoning_parser="deepseek_r1")
    start, end = shipped.reasoning_markers
    assert reasoning_token_ids(shipped) == (shipped.tokenizer.convert_tokens_to_ids(start),
                                            shipped.tokenizer.convert_tokens_to_ids(end))


def test_default_codec_follows_the_checkpoint(dirs, tmp_path):
    from model.shipped import copy_tokenizer

    assert default_codec_name("tiny") == "jointrl"  # a shipped shape
    shipped = copy_tokenizer(tmp_path / "shipped")
    (shipped / "config.json").write_text("{}")
    assert default_codec_name(str(shipped)) == "jointrl"  # carries the shipped tokenizer
    assert default_codec_name(str(dirs["chatml"])) == "hf"  # a chat template of its own
    assert resolve_codec_name("jointrl", str(dirs["chatml"])) == "jointrl"
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    assert default_codec_name(str(bare)) == "jointrl"  # no tokenizer: it gets the shipped one
    with pytest.raises(CodecError, match="no chat_template"):
        make_codec("hf", train_tokenizer(tmp_path / "notemplate"))


def test_runtime_builds_the_configured_codec_and_keeps_a_checkpoints_own_tokenizer(dirs, tmp_path):
    from rl.config import ModelSection
    from rl.setup import build_codec, build_initial_checkpoint

    out = build_initial_checkpoint(str(dirs["chatml"]), tmp_path / "init", seed=0)
    assert not (out / "special_tokens_map.json").exists()  # no shipped tokenizer file mixed in
    codec = build_codec(ModelSection(arch=str(out), tool_parser="qwen3_coder"), out)
    assert codec.name == "hf" and codec.tool_parser_name == "qwen3_coder"
    with pytest.raises(CodecError, match="has a tokenizer of its own"):
        build_codec(ModelSection(arch=str(out), chat_codec="jointrl"), out)
    bare = tmp_path / "bare"  # a checkpoint without a tokenizer gets the shipped one, and speaks jointrl
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    out = build_initial_checkpoint(str(bare), tmp_path / "init2", seed=0)
    assert (out / "tokenizer.json").exists() and build_codec(ModelSection(arch=str(out)), out).name == "jointrl"


def test_config_checks_codec_and_parser_names():
    from rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"'model.chat_codec'.*allowed values: 'auto', 'hf', 'jointrl'"):
        load_config(None, ["model.chat_codec=vllm"])
    with pytest.raises(ConfigError, match=r"'model.tool_parser'.*not a registered vLLM tool parser; allowed values: .*hermes"):
        load_config(None, ["model.chat_codec=hf", "model.tool_parser=hermes2"])
    with pytest.raises(ConfigError, match=r"'model.reasoning_parser'.*allowed values: .*qwen3"):
        load_config(None, ["model.chat_codec=hf", "model.reasoning_parser=qwen"])
    with pytest.raises(ConfigError, match=r"'model.tool_parser'.*read only by the hf chat codec"):
        load_config(None, ["model.tool_parser=qwen3_coder"])  # tiny: the jointrl codec
    m = load_config(None, ["model.chat_codec=hf", "model.tool_parser=qwen3_coder", "model.reasoning_parser=qwen3"]).model
    assert (m.chat_codec, m.tool_parser, m.reasoning_parser) == ("hf", "qwen3_coder", "qwen3")
