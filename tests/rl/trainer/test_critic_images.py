"""The PPO critic (rl/trainer/critic.py) on an image episode (tiny HybridMoe, DeepSpeed on gloo/CPU, a spawned
process like test_critic.py): its values read the images. With a non-zero value head, the values after the
first image change when the image's pixels change (same tokens) and are identical before it; they equal a
manual forward of the critic's own model with `pixel_values` and `image_mask`, and differ from a forward that
leaves the images out; a value step on the image batch runs and moves the values."""
from __future__ import annotations

import multiprocessing as mp
from dataclasses import replace

import numpy as np
import pytest

from tests import REPO

pytestmark = pytest.mark.slow


def _run(tmp: str, ep) -> dict:
    import os

    os.environ["JOINTRL_CACHE"] = str(REPO / ".cache")
    from rl.paths import setup_cache_env

    setup_cache_env()
    import torch

    from model.shipped import build_random_checkpoint
    from model.vision import decode_image, pixel_tensor, VisionSpec
    from rl.rollout.multimodal import blank_png
    from rl.trainer.batch import collate
    from rl.trainer.critic import CriticSpec, CriticTrainer
    from rl.trainer.policy import init_distributed

    init_distributed()
    init = build_random_checkpoint("tiny", f"{tmp}/init", seed=0)
    critic = CriticTrainer(str(init), CriticSpec(lr=1e-3, micro_batch_size=1, zero_stage=0))
    torch.manual_seed(0)
    head = critic.engine.module.head
    with torch.no_grad():  # the head starts at zero (values 0 whatever the input): give it weights to read with
        head.weight.normal_(0.0, 1.0)
        head.bias.zero_()

    batch = collate([ep], [1.0])
    grey = replace(ep, images=tuple(replace(im, data=blank_png(*decode_image(im.data, spec_of(critic)).pixels_HWC.shape[1::-1]))
                                    for im in ep.images))
    v_real = critic.values(batch)[0]
    v_grey = critic.values(collate([grey], [1.0]))[0]

    lm = critic.engine.module.lm
    spec = VisionSpec.from_config(lm.config)
    with torch.no_grad():
        kw = dict(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT, output_hidden_states=True,
                  logits_to_keep=1)
        pix = [pixel_tensor(decode_image(im.data, spec)) for im in ep.images]

        def manual(**img):
            h_TD = lm(**kw, **img).hidden_states[-1][0]
            v_T = head(h_TD).squeeze(-1)
            out = torch.zeros_like(v_T)
            out[1:] = v_T[:-1]
            return out * (batch.loss_mask_BT[0] > 0)

        v_manual = manual(pixel_values=pix, image_mask=batch.image_mask_BT)
        v_no_images = manual()
    mask = batch.loss_mask_BT[0] > 0
    first = ep.images[0].start
    rb = batch.with_(values_BT=v_real[None].clone(), returns_BT=torch.ones_like(v_real)[None] * mask,
                     loss_weights_BT=mask[None].float() / mask.sum())
    critic.value_step(rb)
    v_after = critic.values(batch)[0]
    return {"mask": mask.numpy(), "first": first, "real": v_real.numpy(), "grey": v_grey.numpy(),
            "manual": v_manual.numpy(), "no_images": v_no_images.numpy(), "after": v_after.numpy()}


def spec_of(critic):
    from model.vision import VisionSpec

    return VisionSpec.from_config(critic.engine.module.lm.config)


def test_critic_values_read_the_images(tmp_path):
    from tests.rl.rollout.test_multimodal import SCRIPT, run_image_episode

    short = [SCRIPT[0], SCRIPT[2], SCRIPT[-1]]  # prompt image, look a (64x64), look wide (96x32), submit
    ep, _ = run_image_episode(max_model_len=248, script=short, tools=False)
    assert len(ep.images) == 3 and sum(ep.loss_mask) > 20
    with mp.get_context("spawn").Pool(1) as pool:
        r = pool.apply(_run, (str(tmp_path), ep))
    m, first = r["mask"], r["first"]
    after_img = m.copy()
    after_img[:first + 1] = False
    moved = np.abs(r["real"] - r["grey"])[after_img]
    print(f"critic values, real vs grey images: max {moved.max():.4f} mean {moved.mean():.4f} over {after_img.sum()} tokens; "
          f"manual forward max diff {np.abs(r['real'] - r['manual']).max():.2e}; "
          f"without images max diff {np.abs(r['real'] - r['no_images'])[m].max():.4f}")
    assert np.array_equal(r["real"][:first + 1], r["grey"][:first + 1])  # before the image: the same state
    assert moved.min() > 0 and moved.mean() > 1e-3  # every valued token after the image sees it
    np.testing.assert_allclose(r["real"], r["manual"], atol=1e-5, rtol=0)
    assert np.abs(r["real"] - r["no_images"])[after_img].max() > 1e-3
    assert np.abs(r["after"] - r["real"])[m].max() > 0  # the value step on the image batch moved the values
