"""Image limits shared by the model, the rollout config and the serving routes.

Kept in the leaf package so that validating a config or building the CLI's parser does not import
`model` (and with it torch and transformers, ~10 s on this machine).
"""
from __future__ import annotations

# Largest image side accepted, in pixels. A 512 x 512 image at patch 16 is 1024 placeholder tokens:
# past that an image crowds out the conversation in the context sizes this project trains at.
MAX_IMAGE_SIDE = 512
# Most images one prompt may carry (vLLM's per-prompt limit for the model and the serving routes' limit).
MAX_IMAGES_PER_PROMPT = 8
