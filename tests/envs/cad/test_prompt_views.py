"""cad-v0's task prompt with the target's views (`CadEnv(prompt_views=True)`), through the agent loop on the
tiny HybridMoe's image contract: the image is the task's four views exactly as the renderer draws them (a fresh
render of the reference code, panel by panel), its span in the episode is exact (400 placeholders, out of the
loss, the request carries it), blank pixels keep the span, a text-only policy gets the note and no placeholder,
and an env built without `prompt_views` keeps the prompt text only. The runtime turns `prompt_views` on exactly
when the policy takes images."""
from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("cadquery")

import envs  # noqa: E402
import model.chat as chat  # noqa: E402
from envs.base import EnvSetupError  # noqa: E402
from envs.cad.domain import with_prompt_views  # noqa: E402
from envs.cad.tasks import PANEL_PX, PROMPT_IMAGE_PX, make_tasks, prompt_image  # noqa: E402
from envs.cad.worker import default_pool  # noqa: E402
from jointrl.records import Message, Task, ToolCall  # noqa: E402
from model.shipped import load_shipped_config  # noqa: E402
from model.vision import VisionSpec, decode_image  # noqa: E402
from rl.rollout.agent_loop import BatchingGenerator, LoopSettings, run_episode  # noqa: E402
from rl.rollout.engine import GenerateResult  # noqa: E402
from rl.rollout.multimodal import TEXT_ONLY_NOTE, ImageSettings  # noqa: E402

SPEC = VisionSpec.from_config(load_shipped_config("tiny"))
IMG = SPEC.image_token_id
P = PANEL_PX


@pytest.fixture(scope="module")
def tasks():
    # Through a task row, as the runtime reads them: the row keeps the sheet in `public`, no Message.images.
    return [Task.from_row(t.to_row()) for t in make_tasks("train", 0, 2)]


def pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def test_the_prompt_image_is_the_target_s_four_views_as_the_renderer_draws_them(tasks):
    pool = default_pool()
    for t in tasks:
        img = decode_image(prompt_image(t.public), SPEC)  # accepted by the model's image contract as is
        assert (img.width, img.height) == (PROMPT_IMAGE_PX, PROMPT_IMAGE_PX) == (2 * P, 2 * P)
        assert SPEC.num_patches(img.width, img.height) == 400
        fresh = pixels(pool.render(t.private["reference_code"], panel=P).png)  # (2P+1)^2 sheet, separator at row/col P
        got = img.pixels_HWC
        for (r0, c0), (R0, C0) in [((0, 0), (0, 0)), ((0, P), (0, P + 1)), ((P, 0), (P + 1, 0)), ((P, P), (P + 1, P + 1))]:
            assert np.array_equal(got[r0:r0 + P, c0:c0 + P], fresh[R0:R0 + P, C0:C0 + P])
    a, b = (pixels(prompt_image(t.public)) for t in tasks)
    assert not np.array_equal(a, b)  # two tasks, two parts, two pictures


def test_prompt_views_refuse_a_task_without_its_sheet(tasks):
    bad = dataclasses.replace(tasks[0], public={k: v for k, v in tasks[0].public.items() if k != "image_png_b64"})
    with pytest.raises(EnvSetupError, match=r"public\['image_png_b64'\] is missing"):
        with_prompt_views(bad)
    odd = dataclasses.replace(tasks[0], public={**tasks[0].public, "image_png_b64": "bm90IGEgcG5n"})
    with pytest.raises(EnvSetupError, match=r"public\['image_png_b64'\] is not a base64 PNG"):
        with_prompt_views(odd)
    twice = with_prompt_views(with_prompt_views(tasks[0]))
    assert [len(m.images) for m in twice.prompt] == [0, 1]


class OneCall:
    """Answers every request with a `render_view` call (no solid yet: a text answer, no sandbox run)."""

    def __init__(self, tok):
        self.tok, self.requests = tok, []

    async def __call__(self, reqs):
        self.requests.extend(reqs)
        msg = Message(role="assistant", content="", tool_calls=(ToolCall(id="c0", name="render_view",
                                                                        arguments=json.dumps({"view": "top"})),))
        ids = self.tok.encode(chat.render_completion(msg), add_special_tokens=False)
        return [GenerateResult(token_ids=tuple(ids), logprobs=tuple(-0.5 for _ in ids), finish_reason="stop") for _ in reqs]


def run(task, backend, *, prompt_views=True, max_images=4, pixels_arm="real"):
    tok = chat.load_tokenizer()
    pol = OneCall(tok)
    settings = LoopSettings(max_model_len=4096, max_turns=1, end_token_id=chat.IM_END_ID,
                            images=ImageSettings(spec=SPEC, max_images=max_images, pixels=pixels_arm))
    env = envs.make("cad-v0", backend=backend, prompt_views=prompt_views)
    try:
        ep = asyncio.run(run_episode(env, task, BatchingGenerator(pol), tok, chat, settings, group_id="g"))
    finally:
        env.close()
    return ep, pol


def test_a_cad_prompt_round_trips_through_the_agent_loop_with_an_exact_image_span(tasks, backend):
    t = tasks[0]
    ep, pol = run(t, backend)
    assert ep.truncated and not ep.terminated
    assert len(ep.images) == 1
    im = ep.images[0]
    assert im.data == prompt_image(t.public) and im.length == 400
    span = range(im.start, im.start + im.length)
    assert all(ep.token_ids[i] == IMG for i in span) and all(ep.loss_mask[i] == 0 for i in span)
    assert sum(1 for x in ep.token_ids if x == IMG) == 400  # no placeholder outside the span
    # the span sits in the user message: after the system turn, before the task's text
    user_text = tok_text(ep.token_ids[im.start + im.length:im.start + im.length + 12])
    assert user_text.startswith("Build this part")
    req = pol.requests[0]
    assert req.images == (im,) and tuple(ep.token_ids[:len(req.prompt_token_ids)]) == req.prompt_token_ids
    # the pixels the policy reads are the target's views
    assert np.array_equal(pixels(im.data), pixels(prompt_image(t.public)))


def tok_text(ids) -> str:
    return chat.load_tokenizer().decode(list(ids))


def test_blank_arm_text_only_policy_and_a_text_only_env(tasks, backend):
    t = tasks[0]
    real, _ = run(t, backend)
    blank, _ = run(t, backend, pixels_arm="blank")
    assert blank.token_ids == real.token_ids and [(i.start, i.length) for i in blank.images] == [(i.start, i.length) for i in real.images]
    assert (pixels(blank.images[0].data) == 128).all()
    text_only, pol = run(t, backend, max_images=0)
    assert text_only.images == () and IMG not in text_only.token_ids and pol.requests[0].images == ()
    assert text_only.messages[1].content.startswith(TEXT_ONLY_NOTE)
    plain, _ = run(t, backend, prompt_views=False)
    assert plain.images == () and IMG not in plain.token_ids
    assert plain.messages[1] == t.prompt[1]  # the prompt exactly as the task has it: no image, no note


def test_the_task_pools_turn_prompt_views_on_only_for_a_policy_that_takes_images(tasks):
    from rl.tasks import TaskPools

    for n, want in [(0, False), (2, True)]:
        pools = TaskPools(domains=("cad",), env_ids={"cad": "cad-v0"}, train={}, heldout={}, prompt_views=n > 0)
        env = pools.make_env(tasks[0])
        try:
            assert env.prompt_views is want
        finally:
            env.close()
