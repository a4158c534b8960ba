"""The image contract of `HybridMoeForCausalLM`: which images it takes, how they become pixels and patches.

One definition shared by everything that feeds the model an image, so the HF model, vLLM's processor
(model/vllm_vision.py), the agent loop, the trainer and the serving routes turn the same bytes into the
same numbers:

- `VisionSpec.from_config(cfg)`: the checkpoint's patch size, channels and image-placeholder id, or None
  for a checkpoint without the patch embedding (every HF family but HybridMoe): images are refused there.
- `decode_image(data, spec)`: PNG / JPEG / any format Pillow reads -> `DecodedImage` (uint8 [H, W, C]).
  Refuses with `ImageError` (a ValueError) what the model cannot take: bytes Pillow cannot decode,
  sides that are not multiples of the patch size, a side over `MAX_IMAGE_SIDE`. Images are never
  resized or padded: the patches the model sees are exactly the pixels that were sent.
- `pixel_tensor(img)`: float32 [C, H, W] in [-1, 1] ((x / 255 - 0.5) / 0.5), what `pixel_values` holds.
- `patch_rows(pixels_CHW, p)`: [patches, C*p*p] in the order `model.modeling.ImagePatchEmbed` cuts them
  (raster order over the patch grid, each row channel-major), so a Linear on these rows equals the
  HF patch embedding.
- `expand_placeholders(ids, patches, image_token_id)`: a rendered prompt holds one `<|image|>` per image
  (model/chat.py); the model reads one placeholder token per patch. Expands each to its patch count and
  returns the `ImageSpan`s (start, length) the images feed.

What it does not do: talk to vLLM or transformers, learn anything (the patch embedding is the model's),
or decide where images come from (environments and API clients do).
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from jointrl.limits import MAX_IMAGE_SIDE, MAX_IMAGES_PER_PROMPT


class ImageError(ValueError):
    """An image the model cannot take, with the reason (shown to the agent or the API client)."""


@dataclass(frozen=True)
class VisionSpec:
    """What images a checkpoint takes: `patch_size`-pixel square patches of `channels` channels, each read
    at one `image_token_id` placeholder."""

    image_token_id: int
    patch_size: int
    channels: int
    max_side: int = MAX_IMAGE_SIDE
    max_images: int = MAX_IMAGES_PER_PROMPT

    @staticmethod
    def from_config(cfg: Any) -> "VisionSpec | None":
        """The spec of a HybridMoe config (the only architecture here with a patch embedding), else None."""
        if getattr(cfg, "model_type", None) != "hybrid_moe":
            return None
        return VisionSpec(image_token_id=int(cfg.image_token_id), patch_size=int(cfg.vision_patch_size),
                          channels=int(cfg.vision_num_channels))

    def check_size(self, width: int, height: int) -> None:
        p = self.patch_size
        if width < p or height < p or width % p or height % p:
            raise ImageError(f"image is {width}x{height} pixels; both sides must be positive multiples of the "
                             f"model's patch size {p} (e.g. {4 * p}x{4 * p})")
        if max(width, height) > self.max_side:
            raise ImageError(f"image is {width}x{height} pixels; the largest side accepted is {self.max_side}")

    def num_patches(self, width: int, height: int) -> int:
        self.check_size(width, height)
        return (width // self.patch_size) * (height // self.patch_size)

    def check_count(self, n: int) -> None:
        if n > self.max_images:
            raise ImageError(f"{n} images in one conversation; at most {self.max_images} are accepted")


@dataclass(frozen=True)
class DecodedImage:
    """An accepted image: uint8 pixels [height, width, channels]."""

    pixels_HWC: np.ndarray

    @property
    def height(self) -> int:
        return int(self.pixels_HWC.shape[0])

    @property
    def width(self) -> int:
        return int(self.pixels_HWC.shape[1])


@dataclass(frozen=True)
class ImageSpan:
    """Image `index` (0-based, in order of appearance) feeds tokens [start, start + length) of a sequence."""

    index: int
    start: int
    length: int


def from_pil(image: Any, spec: VisionSpec) -> DecodedImage:
    """A Pillow image as the model's pixels (RGB, or L for one-channel models), size-checked."""
    mode = "RGB" if spec.channels == 3 else "L" if spec.channels == 1 else None
    if mode is None:
        raise ImageError(f"models with {spec.channels} image channels are not supported (1 or 3)")
    spec.check_size(*image.size)
    arr = np.array(image.convert(mode), dtype=np.uint8)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return DecodedImage(pixels_HWC=np.ascontiguousarray(arr))


def open_image(data: bytes) -> Any:
    """Pillow image of encoded bytes, fully decoded; ImageError for bytes that are not a readable image."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, (bytes, bytearray)) or not data:
        raise ImageError("image data is empty")
    try:
        img = Image.open(io.BytesIO(bytes(data)))
        # Pillow refuses decompression bombs past its pixel limit; our side limit is far below that.
        if max(img.size) > 8 * MAX_IMAGE_SIDE:
            raise ImageError(f"image is {img.size[0]}x{img.size[1]} pixels; the largest side accepted is {MAX_IMAGE_SIDE}")
        img.load()  # decode now: a truncated file fails here, not later inside the engine
        return img
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"image data could not be decoded ({type(e).__name__}: {str(e)[:200]})") from None


def decode_image(data: bytes, spec: VisionSpec) -> DecodedImage:
    return from_pil(open_image(data), spec)


def pixel_tensor(img: DecodedImage) -> "Any":
    """float32 torch tensor [C, H, W] in [-1, 1]: ((x / 255) - 0.5) / 0.5."""
    import torch

    x = torch.from_numpy(img.pixels_HWC).permute(2, 0, 1).to(torch.float32)
    return (x / 255.0 - 0.5) / 0.5


def patch_rows(pixels_CHW: "Any", patch: int) -> "Any":
    """[C, H, W] -> [(H/p)*(W/p), C*p*p], raster order over the grid, each row (C, p, p) flattened:
    the layout `ImagePatchEmbed` feeds its Linear."""
    c, h, w = pixels_CHW.shape
    x = pixels_CHW.reshape(c, h // patch, patch, w // patch, patch).permute(1, 3, 0, 2, 4)
    return x.reshape((h // patch) * (w // patch), c * patch * patch)


def expand_placeholders(ids: Sequence[int], patches: Sequence[int], image_token_id: int, *, offset: int = 0,
                        first_index: int = 0) -> tuple[list[int], list[ImageSpan]]:
    """Replace the k-th `image_token_id` of `ids` by `patches[k]` copies of it.

    The number of placeholders must equal `len(patches)` (ImageError otherwise: the text carried an image
    token of its own, or an image lost its placeholder). Spans are in the expanded sequence, shifted by
    `offset` (where `ids` will start in the episode), images numbered from `first_index`.
    """
    where = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(where) != len(patches):
        raise ImageError(f"{len(where)} image placeholders in the rendered text for {len(patches)} images")
    out: list[int] = []
    spans: list[ImageSpan] = []
    prev = 0
    for k, (i, n) in enumerate(zip(where, patches)):
        out.extend(ids[prev:i])
        spans.append(ImageSpan(index=first_index + k, start=offset + len(out), length=int(n)))
        out.extend([image_token_id] * int(n))
        prev = i + 1
    out.extend(ids[prev:])
    return out, spans


__all__ = ["MAX_IMAGE_SIDE", "MAX_IMAGES_PER_PROMPT", "DecodedImage", "ImageError", "ImageSpan", "VisionSpec",
           "decode_image", "expand_placeholders", "from_pil", "open_image", "patch_rows", "pixel_tensor"]
