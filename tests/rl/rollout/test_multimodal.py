"""rl/rollout/multimodal.py and the image path through the agent loop, the trainer batch and the vLLM engine.

Fast tests: request building and refusals, what an episode shows the policy of each image (notes for
text-only policies, refused and over-limit images; blanked pixels), the loop's exact token / span / loss-mask
bookkeeping with a scripted policy, collate's image mask. Slow tests (a real bf16 vLLM engine on the tiny
random HybridMoe): engine vs HF logprobs on image+text prompts, judged against HF's own bf16-vs-fp32 gap as
for text (tests/model/test_vllm_plugin.py); two images in the same prompt move the engine's and HF's
logprobs the same way; an episode with image tool results scored by the engine and by the trainer.
"""
from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

import model.chat as chat
from jointrl.records import Message, ToolCall
from model.vision import ImageError, VisionSpec
from rl.rollout.agent_loop import BatchingGenerator, LoopSettings, run_episode
from rl.rollout.engine import GenerateResult
from rl.rollout.multimodal import (TEXT_ONLY_NOTE, EpisodeImages, ImageSettings, blank_png, check_spans, collapse,
                                   engine_prompt, image_token_ban, vision_llm_kwargs)
from rl.trainer.batch import collate
from rl.types import TokenImage
from tests.helpers.image_env import PROMPT_IMAGE, VIEWS, ImageEnv, image_task, png

IMG = chat.IMAGE_ID
SPEC = VisionSpec(image_token_id=IMG, patch_size=16, channels=3)


# ----------------------------------------------------------------------------- requests
def test_engine_prompt_collapses_each_span_to_one_placeholder_with_the_images():
    a, b = png(64, 64, 1), png(32, 16, 2)
    toks = [5, 6] + [IMG] * 16 + [7] + [IMG] * 2 + [8]
    ims = [TokenImage(a, 2, 16), TokenImage(b, 19, 2)]
    p = engine_prompt(toks, ims, SPEC, max_images=4)
    assert p["prompt_token_ids"] == [5, 6, IMG, 7, IMG, 8] == collapse(toks, ims)
    assert [im.size for im in p["multi_modal_data"]["image"]] == [(64, 64), (32, 16)]
    assert engine_prompt(toks[:2], [], SPEC, 0) == {"prompt_token_ids": [5, 6]}


@pytest.mark.parametrize("toks, ims, max_images, match", [
    ([IMG] * 16 + [IMG], [TokenImage(png(64, 64), 0, 16)], 4, "belong to no image"),
    ([IMG] * 15 + [7], [TokenImage(png(64, 64), 0, 16)], 4, "holds tokens other than"),
    ([IMG] * 4, [TokenImage(png(64, 64), 0, 4)], 4, "64x64 = 16 patches but its span has 4"),
    ([IMG] * 4, [TokenImage(b"junk", 0, 4)], 4, "could not be decoded"),
    ([IMG] * 2, [TokenImage(png(16, 16), 0, 1), TokenImage(png(16, 16), 1, 1)], 1, "at most 1 per prompt"),
    ([IMG], [TokenImage(png(16, 16), 0, 1)], 0, "built text-only"),
])
def test_engine_prompt_refuses_inconsistent_or_bad_images(toks, ims, max_images, match):
    with pytest.raises(ImageError, match=match):
        engine_prompt(toks, ims, SPEC, max_images)


def test_a_model_without_vision_tower_takes_no_images():
    with pytest.raises(ImageError, match="no vision tower"):
        engine_prompt([IMG], [TokenImage(png(16, 16), 0, 1)], None, 4)
    with pytest.raises(ImageError, match="no vision tower"):
        vision_llm_kwargs(2, None)
    assert vision_llm_kwargs(0, None) == {} and image_token_ban(None, 0) == {}
    assert vision_llm_kwargs(0, SPEC) == {"language_model_only": True}
    assert vision_llm_kwargs(3, SPEC)["limit_mm_per_prompt"] == {"image": 3}
    assert image_token_ban(SPEC, 3) == {IMG: -100.0} and image_token_ban(SPEC, 0) == {}
    with pytest.raises(ImageError, match="at most 8"):
        vision_llm_kwargs(9, SPEC)


def test_check_spans_wants_ordered_spans_inside_the_prompt():
    check_spans([IMG, IMG, 3], [TokenImage(b"", 0, 2)], IMG)
    with pytest.raises(ImageError, match="out of order or outside"):
        check_spans([IMG, IMG], [TokenImage(b"", 1, 2)], IMG)


# ----------------------------------------------------------------------------- what the policy sees
def test_prepare_replaces_images_the_policy_cannot_see_by_a_note():
    msg = Message(role="tool", content="result", images=(png(16, 16),))
    (m,) = EpisodeImages(ImageSettings()).prepare([msg])
    assert m.images == () and m.content == f"{TEXT_ONLY_NOTE}\nresult"
    (m,) = EpisodeImages(ImageSettings(spec=None, max_images=4)).prepare([msg])
    assert m.content.startswith(TEXT_ONLY_NOTE)
    ep = EpisodeImages(ImageSettings(spec=SPEC, max_images=2))
    (m,) = ep.prepare([Message(role="tool", content="x", images=(png(16, 16), b"junk", png(30, 30), png(16, 16), png(16, 16)))])
    assert len(m.images) == 2
    lines = m.content.split("\n")
    assert lines[0].startswith("[image refused: image data could not be decoded")
    assert lines[1].startswith("[image refused: image is 30x30 pixels; both sides must be positive multiples")
    assert lines[2] == "[image not shown: this episode's limit of 2 images is reached]" and lines[3] == "x"


def test_blank_pixels_keep_size_and_placeholders_but_not_the_picture():
    real, blank = (EpisodeImages(ImageSettings(spec=SPEC, max_images=4, pixels=p)) for p in ("real", "blank"))
    msg = [Message(role="user", content="see", images=(png(48, 32, 5),))]
    (mr,), (mb,) = real.prepare(msg), blank.prepare(msg)
    assert mr.images[0] == msg[0].images[0] and mb.images[0] == blank_png(48, 32)
    ids = chat.load_tokenizer().encode(chat.render([mr], None, add_generation_prompt=False), add_special_tokens=False)
    assert real.place(ids, [mr], 0)[0] == blank.place(ids, [mb], 0)[0]  # the same tokens either way
    from model.vision import decode_image

    assert (decode_image(mb.images[0], SPEC).pixels_HWC == 128).all()
    with pytest.raises(ValueError, match="'real' or 'blank'"):
        ImageSettings(pixels="grey")


# ----------------------------------------------------------------------------- the agent loop, scripted policy
def _look(view: str, i: int) -> Message:
    return Message(role="assistant", content="", tool_calls=(ToolCall(id=f"c{i}", name="look", arguments=json.dumps({"view": view})),))


SCRIPT = [_look("a", 0), _look("broken", 1), _look("wide", 2), _look("many", 3),
          Message(role="assistant", content="", tool_calls=(ToolCall(id="c9", name="submit", arguments="{}"),))]


class ScriptedPolicy:
    """Turn k of the episode is script[k]; logprobs come from `score` (the real engine in the slow test)."""

    def __init__(self, tok, score=None, script=SCRIPT):
        self.tok, self.score, self.script, self.requests = tok, score, script, []

    async def __call__(self, reqs):
        out = []
        for r in reqs:
            self.requests.append(r)
            ids = self.tok.encode(chat.render_completion(self.script[len(self.requests) - 1]), add_special_tokens=False)
            if self.score is None:
                lps = tuple(-0.5 for _ in ids)
            else:
                full = list(r.prompt_token_ids) + ids
                lps = tuple(self.score(full, r.images)[len(r.prompt_token_ids) - 1:])
            out.append(GenerateResult(token_ids=tuple(ids), logprobs=lps, finish_reason="stop"))
        return out


def run_image_episode(score=None, max_images: int = 4, max_model_len: int = 1024, script=SCRIPT, tools=True):
    tok = chat.load_tokenizer()
    pol = ScriptedPolicy(tok, score, script)
    settings = LoopSettings(max_model_len=max_model_len, max_turns=10, end_token_id=chat.IM_END_ID,
                            images=ImageSettings(spec=SPEC, max_images=max_images))
    ep = asyncio.run(run_episode(ImageEnv(tools), image_task(), BatchingGenerator(pol), tok, chat, settings, group_id="g"))
    return ep, pol


def test_episode_images_round_trip_tokens_spans_and_loss_mask():
    ep, pol = run_image_episode()
    assert ep.terminated and ep.reward == 1.0 and ep.num_turns == 5
    # prompt 32x32 (4 patches), look a 64x64 (16), broken refused, wide 96x32 (12), many: 1 of 4 fits the limit of 4
    assert [(len(im.data) > 0, im.length) for im in ep.images] == [(True, 4), (True, 16), (True, 12), (True, 1)]
    assert ep.images[0].data == PROMPT_IMAGE and ep.images[1].data == VIEWS["a"][0] and ep.images[3].data == VIEWS["many"][0]
    covered = set()
    for im in ep.images:
        span = range(im.start, im.start + im.length)
        assert all(ep.token_ids[t] == IMG for t in span) and all(ep.loss_mask[t] == 0 for t in span)
        covered.update(span)
    assert covered == {t for t, x in enumerate(ep.token_ids) if x == IMG}  # no placeholder outside a span
    # every request is a prefix of the episode and carries exactly the images placed before it
    for r in pol.requests:
        n = len(r.prompt_token_ids)
        assert tuple(ep.token_ids[:n]) == r.prompt_token_ids
        assert r.images == tuple(im for im in ep.images if im.start + im.length <= n)
    text = "\n".join(m.content for m in ep.messages if m.role == "tool")
    assert "[image refused: image data could not be decoded" in text
    assert text.count("[image not shown: this episode's limit of 4 images is reached]") == 3
    # what the loss is taken on is what the policy generated, unchanged
    assert sum(ep.loss_mask) == sum(len(chat.load_tokenizer().encode(chat.render_completion(m), add_special_tokens=False))
                                    for m in SCRIPT)
    # the trainer batch: image positions masked in the image mask, out of the loss
    b = collate([ep, ep], [1.0, -1.0])
    assert b.image_mask_BT is not None and int(b.image_mask_BT[0].sum()) == 33
    assert float((b.loss_mask_BT * b.image_mask_BT).sum()) == 0.0
    one = b.select([1])
    assert one.images_B == (ep.images,) and bool((one.image_mask_BT == b.image_mask_BT[1:]).all())


def test_a_text_only_policy_gets_notes_and_no_placeholders():
    ep, pol = run_image_episode(max_images=0)
    assert ep.images == () and IMG not in ep.token_ids and all(r.images == () for r in pol.requests)
    assert collate([ep], [1.0]).image_mask_BT is None
    assert sum(TEXT_ONLY_NOTE in m.content for m in ep.messages) == 5  # the prompt, a, broken, wide, many


def test_an_image_turn_that_does_not_fit_truncates_without_a_dangling_span():
    ep, _ = run_image_episode(max_model_len=300)
    assert ep.truncated
    for im in ep.images:
        assert im.start + im.length <= len(ep.token_ids)


# ----------------------------------------------------------------------------- the real engine (slow)
def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def mm_engine(tmp_path_factory):
    from model.shipped import build_random_checkpoint
    from rl.rollout.engine import EngineConfig, RolloutEngine

    ckpt = build_random_checkpoint("tiny", tmp_path_factory.mktemp("mm") / "hyb")
    eng = RolloutEngine(EngineConfig(model_path=str(ckpt), dtype="auto", max_model_len=256, kv_cache_gib=0.25,
                                     max_images_per_prompt=4))
    yield eng, ckpt
    eng.shutdown()


def _image_prompts():
    from tests.rl.rollout.rollout_helpers import fixed_sequences

    text = fixed_sequences(3, 60, seed=7, low=20, high=8000)
    a, b, wide = VIEWS["a"][0], VIEWS["b"][0], VIEWS["wide"][0]
    seqs, ims = [], []
    for t, pics in ((text[0], [a]), (text[0], [b]), (text[1], [wide, a])):
        toks, spans, pos = list(t[:10]), [], 10
        for p in pics:
            n = SPEC.num_patches(*__import__("PIL.Image", fromlist=["Image"]).open(__import__("io").BytesIO(p)).size)
            spans.append(TokenImage(p, len(toks), n))
            toks += [IMG] * n
            toks += list(t[pos:pos + 3])
            pos += 3
        toks += list(t[pos:])
        seqs.append(tuple(toks))
        ims.append(tuple(spans))
    return seqs, ims


@pytest.mark.slow
def test_engine_matches_hf_on_image_prompts_and_images_move_both_the_same_way(mm_engine, tmp_path):
    from tests.helpers.reference import ReferenceJob, run_reference
    from tests.rl.rollout.rollout_helpers import max_abs_diff

    eng, ckpt = mm_engine
    seqs, ims = _image_prompts()
    b64 = tuple(tuple(_b64(im.data) for im in row) for row in ims)
    r32 = run_reference(ReferenceJob(checkpoint=str(ckpt), out_dir=str(tmp_path / "r32"), sequences=tuple(seqs), images=b64))[0]
    r16 = run_reference(ReferenceJob(checkpoint=str(ckpt), out_dir=str(tmp_path / "r16"), sequences=tuple(seqs), images=b64,
                                     dtype="bfloat16"))[0]
    got = eng.score(seqs, ims)
    engine_gap, hf_gap = max_abs_diff(got, r32["logprobs"]), max_abs_diff(r16["logprobs"], r32["logprobs"])
    mean_engine = float(np.mean([np.abs(a - b).mean() for a, b in zip(got, r32["logprobs"])]))
    mean_hf = float(np.mean([np.abs(a - b).mean() for a, b in zip(r16["logprobs"], r32["logprobs"])]))
    print(f"image prompts: engine bf16 vs HF fp32 max {engine_gap:.4f} mean {mean_engine:.5f}; "
          f"HF bf16 vs HF fp32 max {hf_gap:.4f} mean {mean_hf:.5f}")
    assert mean_engine <= 2 * mean_hf and engine_gap <= 2 * hf_gap  # the text criterion (test_vllm_plugin.py)
    # Same prompt, two images: the logprobs after the image move, and the engine's move as HF's do.
    after = ims[0][0].start + ims[0][0].length - 1  # scores index t-1 for token t
    d_eng = got[0][after:] - got[1][after:]
    d_hf = r32["logprobs"][0][after:] - r32["logprobs"][1][after:]
    np.testing.assert_array_equal(got[0][:ims[0][0].start - 1], got[1][:ims[0][0].start - 1])  # nothing before it
    print(f"image a vs b: HF moves max {np.abs(d_hf).max():.4f}, engine-HF disagreement max {np.abs(d_eng - d_hf).max():.4f}")
    assert np.abs(d_hf).max() > 5 * hf_gap
    assert np.abs(d_eng - d_hf).max() <= 2 * hf_gap + 1e-6
    assert np.corrcoef(d_eng, d_hf)[0, 1] > 0.95
    # Bad requests are refused before vLLM and the engine goes on serving.
    with pytest.raises(ImageError):
        eng.score([seqs[0]], [(TokenImage(b"junk", ims[0][0].start, 16),)])
    with pytest.raises(ImageError, match="at most 4"):
        eng.score([tuple([IMG] * 5) + seqs[0][:5]], [tuple(TokenImage(png(16, 16), i, 1) for i in range(5))])
    np.testing.assert_allclose(eng.score(seqs[:1], ims[:1])[0], got[0], atol=0)


def _trainer_logprobs(ckpt: str, ep) -> list[float]:
    from rl.paths import setup_cache_env

    setup_cache_env()
    from rl.trainer.policy import PolicyTrainer, TrainerSpec

    tr = PolicyTrainer(ckpt, TrainerSpec(zero_stage=0, lr=1e-3, micro_batch_size=1, routing_replay="off"))
    lp, _ = tr.compute_logprobs(collate([ep], [1.0]))
    return lp[0].tolist()


@pytest.mark.slow
def test_an_image_episode_scored_by_the_engine_equals_the_trainer(mm_engine):
    import multiprocessing as mp

    eng, ckpt = mm_engine
    short = [SCRIPT[0], SCRIPT[2], SCRIPT[-1]]  # look a, look wide, submit: fits the engine's 256 tokens
    ep, pol = run_image_episode(score=lambda toks, images: eng.score([toks], [images])[0].tolist(), max_model_len=256 - 8,
                                script=short, tools=False)
    assert ep.terminated and len(ep.images) == 3 and sum(ep.loss_mask) > 20
    with mp.get_context("spawn").Pool(1) as pool:
        lp = np.asarray(pool.apply(_trainer_logprobs, (str(ckpt), ep)))
    m = np.asarray(ep.loss_mask, dtype=bool)
    m[0] = False
    gap = np.abs(lp[m] - np.asarray(ep.rollout_logprobs)[m])
    print(f"episode with {len(ep.images)} images: trainer fp32 vs engine bf16 max {gap.max():.4f} mean {gap.mean():.5f}")
    assert gap.mean() < 0.02 and gap.max() < 0.1  # bf16 engine vs fp32 trainer: the noise measured above, not a bias


def test_rollout_section_sets_the_engine_s_image_limit(tmp_path):
    from rl.config import RolloutSection
    from rl.rollout.engine import EngineConfig, EngineError

    (tmp_path / "config.json").write_text("{}")
    assert EngineConfig.from_rollout_section(RolloutSection(max_images_per_prompt=3), str(tmp_path)).max_images_per_prompt == 3
    with pytest.raises(EngineError, match="max_images_per_prompt must be >= 0"):
        EngineConfig(model_path=str(tmp_path), max_images_per_prompt=-1)


@pytest.mark.slow
def test_a_weight_sync_reaches_the_patch_embedding(mm_engine, tmp_path):
    """Runs last: it changes the module engine's weights. Every >= 2-D weight moves, the patch embedding too;
    after the sync the engine must match HF's new state on image prompts as closely as before it."""
    import torch

    from rl.weights import make_buckets, unpack_bucket
    from tests.helpers.reference import ReferenceJob, run_reference
    from tests.rl.rollout.rollout_helpers import max_abs_diff

    eng, ckpt = mm_engine
    seqs, ims = _image_prompts()
    b64 = tuple(tuple(_b64(im.data) for im in row) for row in ims)
    job = dict(checkpoint=str(ckpt), sequences=tuple(seqs), images=b64, num_steps=1, perturb_scale=0.2)
    r32 = run_reference(ReferenceJob(out_dir=str(tmp_path / "r32"), **job))
    r16 = run_reference(ReferenceJob(out_dir=str(tmp_path / "r16"), dtype="bfloat16", **job))
    state = torch.load(r32[1]["state_path"])
    assert any(k.startswith("model.patch_embed.") for k in state)
    (bucket,) = make_buckets(state, "hybrid_moe", bucket_mb=1000)
    names = [n for n, _ in unpack_bucket(bucket)]
    assert "model.patch_embed.proj.weight" in names
    eng.update_weights(unpack_bucket(bucket))
    got = eng.score(seqs, ims)
    gap, hf_gap = max_abs_diff(got, r32[1]["logprobs"]), max_abs_diff(r16[1]["logprobs"], r32[1]["logprobs"])
    stale = max_abs_diff(got, r32[0]["logprobs"])
    print(f"after the sync: engine vs HF fp32 max {gap:.4f} (HF bf16 noise {hf_gap:.4f}); vs the old weights {stale:.4f}")
    assert gap <= 2 * hf_gap and stale > 5 * hf_gap
