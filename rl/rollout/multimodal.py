"""Images in rollouts: which images an episode shows the policy, and how its tokens meet vLLM's multimodal requests.

An episode keeps its tokens in the form the model reads: each image is a run of `<|image|>` tokens, one per
patch (model/vision.py). vLLM takes a prompt with ONE `<|image|>` per image plus the images themselves
(`multi_modal_data`) and expands the placeholders itself (model/vllm_vision.py). This module:
- `EpisodeImages`: per episode, decides what the policy sees of each message's images (`prepare`: the image
  itself, a mid-grey image of the same size for the blanked control arm, or a one-line note in the text
  when the policy takes no images, the image is unusable or the episode's image limit is reached, so a bad
  image from a tool is a tool error the agent reads, never a crash), then expands the codec's placeholders
  and records which image feeds which span (`place`, `commit`): the episode's `images`;
- `engine_prompt(tokens, images)`: the dict `LLMEngine.add_request` takes, collapsed to one placeholder
  per image, with the decoded images; checks that the spans hold placeholder tokens and nothing else does;
- `vision_llm_kwargs(...)`: the `vllm.LLM` arguments that turn image input on (or off) for an engine;
- `image_token_ban(...)`: the sampling bias that keeps a vision engine's policy from writing `<|image|>`:
  a placeholder no image feeds would be read as an image slot by vLLM's matching on the next turn.

What it does not do: render messages (the codecs), decode model output, or train (rl/trainer/batch.py
turns an episode's images into `pixel_values`).
"""
from __future__ import annotations

import io
from dataclasses import dataclass, replace
from typing import Any, Literal, Sequence

from jointrl.records import Message
from model.vision import ImageError, VisionSpec, decode_image, expand_placeholders, open_image
from rl.types import TokenImage


def check_spans(tokens: Sequence[int], images: Sequence[TokenImage], image_token_id: int) -> None:
    """Spans in order, inside the sequence, made of placeholder tokens only, and no placeholder outside them."""
    prev = 0
    covered = 0
    for k, im in enumerate(images):
        if im.start < prev or im.length < 1 or im.start + im.length > len(tokens):
            raise ImageError(f"image {k}: span [{im.start}, {im.start + im.length}) is out of order or outside the "
                             f"{len(tokens)}-token prompt")
        if any(t != image_token_id for t in tokens[im.start:im.start + im.length]):
            raise ImageError(f"image {k}: span [{im.start}, {im.start + im.length}) holds tokens other than the image placeholder")
        prev = im.start + im.length
        covered += im.length
    stray = sum(1 for t in tokens if t == image_token_id) - covered
    if stray:
        raise ImageError(f"{stray} image placeholder tokens in the prompt belong to no image")


def collapse(tokens: Sequence[int], images: Sequence[TokenImage]) -> list[int]:
    """The prompt with each image's span replaced by its first token (one placeholder per image)."""
    out: list[int] = []
    prev = 0
    for im in images:
        out.extend(tokens[prev:im.start + 1])
        prev = im.start + im.length
    out.extend(tokens[prev:])
    return out


def engine_prompt(tokens: Sequence[int], images: Sequence[TokenImage], spec: VisionSpec | None,
                  max_images: int) -> dict[str, Any]:
    """`add_request`'s prompt: token ids, plus `multi_modal_data` when there are images."""
    if not images:
        return {"prompt_token_ids": list(tokens)}
    if spec is None:
        raise ImageError("this model has no image input (no vision tower); the request carries images")
    if len(images) > max_images:
        raise ImageError(f"{len(images)} images in the request; this engine takes at most {max_images} per prompt"
                         + (" (built text-only)" if max_images == 0 else ""))
    spec.check_count(len(images))
    check_spans(tokens, images, spec.image_token_id)
    pil = []
    for k, im in enumerate(images):
        img = open_image(im.data)
        n = spec.num_patches(*img.size)
        if n != im.length:
            raise ImageError(f"image {k} is {img.size[0]}x{img.size[1]} = {n} patches but its span has {im.length} tokens")
        pil.append(img.convert("RGB" if spec.channels == 3 else "L"))
    return {"prompt_token_ids": collapse(tokens, images), "multi_modal_data": {"image": pil}}


def vision_llm_kwargs(max_images: int, spec: VisionSpec | None) -> dict[str, Any]:
    """`vllm.LLM` arguments for an engine taking up to `max_images` images per prompt (0: text only)."""
    if max_images < 0:
        raise ValueError(f"max_images_per_prompt must be >= 0, got {max_images}")
    if spec is None:
        if max_images:
            raise ImageError(f"max_images_per_prompt={max_images} but this model has no vision tower (image input is "
                             "HybridMoe's only); set it to 0")
        return {}
    if max_images == 0:
        return {"language_model_only": True}  # no patch embedding, no multimodal profiling
    spec.check_count(max_images)
    # No processor cache: rollout images are mostly seen once, and each cached item holds its patches.
    return {"limit_mm_per_prompt": {"image": int(max_images)}, "mm_processor_cache_gb": 0}


def image_token_ban(spec: VisionSpec | None, max_images: int) -> dict[int, float]:
    """`SamplingParams.logit_bias` for a vision engine: the image placeholder is input-only. vLLM reports raw
    logprobs (before the bias), so the logprobs stay the model's own, as the trainer computes them."""
    if spec is None or max_images == 0:
        return {}
    return {spec.image_token_id: -100.0}


# ----------------------------------------------------------------------------- per episode
@dataclass(frozen=True)
class ImageSettings:
    """What images reach the policy: `spec` (None: a model without image input), up to `max_images` per
    episode, `pixels` "real" or "blank" (mid-grey, same size: the control arm)."""

    spec: VisionSpec | None = None
    max_images: int = 0
    pixels: Literal["real", "blank"] = "real"

    def __post_init__(self) -> None:
        if self.pixels not in ("real", "blank"):
            raise ValueError(f"ImageSettings.pixels must be 'real' or 'blank', got {self.pixels!r}")
        if self.max_images < 0:
            raise ValueError(f"ImageSettings.max_images must be >= 0, got {self.max_images}")


TEXT_ONLY_NOTE = "[image not shown: this policy reads text only]"


def _note(text: str, content: str) -> str:
    return text + ("\n" + content if content else "")


_BLANKS: dict[tuple[int, int, int], bytes] = {}


def blank_png(width: int, height: int, channels: int = 3) -> bytes:
    """A mid-grey (128) PNG of the given size, cached."""
    key = (width, height, channels)
    if key not in _BLANKS:
        from PIL import Image

        buf = io.BytesIO()
        Image.new("RGB" if channels == 3 else "L", (width, height), color=(128,) * channels if channels == 3 else 128
                  ).save(buf, format="PNG")
        _BLANKS[key] = buf.getvalue()
    return _BLANKS[key]


class EpisodeImages:
    """The images one episode has shown the policy, with their token spans. Not thread-safe (one per episode)."""

    def __init__(self, settings: ImageSettings) -> None:
        self.settings = settings
        self.items: list[TokenImage] = []
        self._pending = 0  # images accepted by `prepare` but not yet committed
        self._patches: dict[int, int] = {}  # id(bytes) of an accepted image -> its patch count

    def prepare(self, messages: Sequence[Message]) -> list[Message]:
        """`messages` as the policy sees them: each usable image kept (or blanked), every other one replaced
        by a note at the head of the message's text, saying why."""
        st = self.settings
        out = []
        for m in messages:
            if not m.images:
                out.append(m)
                continue
            kept: list[bytes] = []
            notes: list[str] = []
            for k, data in enumerate(m.images):
                if st.spec is None or st.max_images == 0:
                    notes.append(TEXT_ONLY_NOTE)
                    continue
                if len(self.items) + self._pending + len(kept) >= st.max_images:
                    notes.append(f"[image not shown: this episode's limit of {st.max_images} images is reached]")
                    continue
                try:
                    img = decode_image(data, st.spec)
                except ImageError as e:
                    notes.append(f"[image refused: {e}]")
                    continue
                shown = data if st.pixels == "real" else blank_png(img.width, img.height, st.spec.channels)
                self._patches[id(shown)] = st.spec.num_patches(img.width, img.height)
                kept.append(shown)
            self._pending += len(kept)
            text = m.content
            for n in reversed(notes):
                text = _note(n, text)
            out.append(replace(m, images=tuple(kept), content=text))
        return out

    def place(self, ids: Sequence[int], messages: Sequence[Message], offset: int) -> tuple[list[int], list[TokenImage]]:
        """The codec's ids for `messages` (prepared) with each image's placeholder expanded to its patches, and
        the images with their spans (`offset`: where `ids` start in the episode). Call `commit` once they
        are appended to the episode."""
        data = [d for m in messages for d in m.images]
        if not data:
            return list(ids), []
        spec = self.settings.spec
        assert spec is not None  # prepare() keeps images only when the policy takes them
        out, spans = expand_placeholders(ids, [self._patches[id(d)] for d in data], spec.image_token_id, offset=offset)
        return out, [TokenImage(data=d, start=s.start, length=s.length) for d, s in zip(data, spans)]

    def commit(self, images: Sequence[TokenImage]) -> None:
        self.items.extend(images)
        self._pending = 0

    def discard(self) -> None:
        """Forget images prepared but not appended (the turn did not fit the context)."""
        self._pending = 0

    def restart(self) -> None:
        """A new context (a compacted history, rl/rollout/context.py): no image placed yet. Images already
        prepared keep their patch counts, so the new context's `place` can expand the ones it keeps."""
        self.items = []
        self._pending = 0
