"""rl/setup.py: what `rollout.max_images_per_prompt` / `rollout.image_pixels` give the agent loop, and the
refusal for a checkpoint without a vision tower (before any worker starts)."""
from __future__ import annotations


import pytest

from model.configuration import HybridMoeConfig
from model.vision import VisionSpec
from rl.config import ConfigError, load_config
from rl.setup import image_settings


def _settings(tmp_path, config, overrides):
    config.save_pretrained(tmp_path)
    cfg = load_config(None, overrides)
    return image_settings(cfg.rollout, cfg.model.arch, tmp_path)


def test_image_keys_reach_the_loop_settings(tmp_path):
    s = _settings(tmp_path, HybridMoeConfig(vision_patch_size=8), ["rollout.max_images_per_prompt=3", "rollout.image_pixels=blank"])
    assert (s.max_images, s.pixels) == (3, "blank") and s.spec == VisionSpec(image_token_id=10, patch_size=8, channels=3)
    assert _settings(tmp_path, HybridMoeConfig(), []).max_images == 0  # the default: text only


def test_images_for_a_checkpoint_without_vision_tower_are_refused(tmp_path):
    from transformers import Qwen3Config

    assert _settings(tmp_path, Qwen3Config(), []).spec is None
    with pytest.raises(ConfigError, match="'rollout.max_images_per_prompt'.*has no vision tower"):
        _settings(tmp_path, Qwen3Config(), ["rollout.max_images_per_prompt=1"])
