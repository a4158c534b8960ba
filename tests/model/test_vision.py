"""model/vision.py: decoding and refusing images, patch order against the HF patch embedding, placeholder
expansion; the HF model's variable-size image lists and explicit image mask."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from model.configuration import HybridMoeConfig
from model.modeling import HybridMoeForCausalLM
from model.shipped import load_shipped_config
from model.vision import (ImageError, ImageSpan, VisionSpec, decode_image, expand_placeholders, patch_rows,
                          pixel_tensor)


def png(width: int, height: int, seed: int = 0, mode: str = "RGB") -> bytes:
    from PIL import Image

    rs = np.random.RandomState(seed)
    arr = rs.randint(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").convert(mode).save(buf, format="PNG")
    return buf.getvalue()


SPEC = VisionSpec(image_token_id=10, patch_size=16, channels=3)


def test_spec_comes_from_hybrid_moe_configs_only():
    cfg = load_shipped_config("tiny")
    assert VisionSpec.from_config(cfg) == SPEC
    from transformers import Qwen3Config

    assert VisionSpec.from_config(Qwen3Config()) is None


def test_decode_keeps_pixels_exactly_and_normalises_to_unit_range():
    data = png(32, 48, seed=3)
    img = decode_image(data, SPEC)
    assert (img.width, img.height) == (32, 48)
    from PIL import Image

    want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    np.testing.assert_array_equal(img.pixels_HWC, want)
    x = pixel_tensor(img)
    assert x.shape == (3, 48, 32) and x.dtype == torch.float32
    torch.testing.assert_close(x, torch.from_numpy(want).permute(2, 0, 1).float() / 127.5 - 1.0)
    assert decode_image(png(16, 16, mode="RGBA"), SPEC).pixels_HWC.shape == (16, 16, 3)  # alpha dropped
    assert decode_image(png(16, 16, mode="L"), SPEC).pixels_HWC.shape == (16, 16, 3)


@pytest.mark.parametrize("data, match", [
    (b"", "empty"),
    (b"\x89PNG\r\n\x1a\nnot really a png", "could not be decoded"),
    (png(64, 64)[:200], "could not be decoded"),  # truncated
    (png(30, 32), "multiples of the model's patch size 16"),
    (png(8, 16), "multiples"),
    (png(528, 16), "largest side accepted is 512"),
])
def test_images_the_model_cannot_take_are_refused_with_the_reason(data, match):
    with pytest.raises(ImageError, match=match):
        decode_image(data, SPEC)


def test_too_many_images_are_refused():
    SPEC.check_count(SPEC.max_images)
    with pytest.raises(ImageError, match="at most 8"):
        SPEC.check_count(SPEC.max_images + 1)


def test_patch_rows_through_the_patch_linear_equal_the_hf_patch_embedding():
    torch.manual_seed(0)
    cfg = HybridMoeConfig(hidden_size=32, vision_patch_size=4)
    from model.modeling import ImagePatchEmbed

    pe = ImagePatchEmbed(cfg)
    px = torch.randn(3, 12, 8)
    want = pe(px[None])
    got = pe.proj(patch_rows(px, 4))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_expand_placeholders_grows_each_image_to_its_patches_and_records_spans():
    ids = [5, 10, 10, 7, 10, 8]
    out, spans = expand_placeholders(ids, [2, 3, 1], 10, offset=100, first_index=4)
    assert out == [5, 10, 10, 10, 10, 10, 7, 10, 8]
    assert spans == [ImageSpan(4, 101, 2), ImageSpan(5, 103, 3), ImageSpan(6, 107, 1)]
    with pytest.raises(ImageError, match="2 image placeholders in the rendered text for 1 images"):
        expand_placeholders([10, 10], [4], 10)


def _tiny_model() -> HybridMoeForCausalLM:
    torch.manual_seed(0)
    cfg = load_shipped_config("tiny", vision_patch_size=4)
    return HybridMoeForCausalLM(cfg).eval()


def test_hf_model_takes_images_of_different_sizes_as_a_list():
    m = _tiny_model()
    a, b = torch.randn(3, 8, 8), torch.randn(3, 4, 12)
    ids = torch.tensor([[20, 21] + [10] * 4 + [22] + [10] * 3 + [23]])
    with torch.no_grad():
        got = m(ids, pixel_values=[a, b]).logits
        emb = m.model.embed(ids, [a, b])
    pe = m.model.patch_embed
    torch.testing.assert_close(emb[0, 2:6], pe(a[None]))
    torch.testing.assert_close(emb[0, 7:10], pe(b[None]))
    with torch.no_grad():
        same = m(ids, pixel_values=[a, b]).logits
        other = m(ids, pixel_values=[a, torch.randn(3, 4, 12)]).logits
    torch.testing.assert_close(got, same)
    assert not torch.allclose(got[0, 7:], other[0, 7:])  # the second image changes what follows it
    torch.testing.assert_close(got[0, :7], other[0, :7])  # and nothing before it (causal)


def test_image_mask_lets_a_placeholder_token_no_image_feeds_stay_text():
    m = _tiny_model()
    a = torch.randn(3, 8, 8)
    ids = torch.tensor([[20] + [10] * 4 + [21, 10, 22]])  # position 6: a placeholder the policy wrote itself
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, 1:5] = True
    with pytest.raises(ValueError, match="5 image positions"):
        m.model.embed(ids, [a])
    emb = m.model.embed(ids, [a], mask)
    torch.testing.assert_close(emb[0, 6], m.model.embed_tokens.weight[10])
    with pytest.raises(ValueError, match="no pixel_values"):
        m.model.embed(ids, None, mask)
