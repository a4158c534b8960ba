"""MXFP4 codec (model/mxfp4.py) against an independent, slow, per-element reference written here
from the OCP MX v1.0 text, and against public decoders (transformers' gpt-oss LUT recipe, torch's
float8_e8m0fnu). CPU only, a few seconds."""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from model.mxfp4 import (
    BLOCK_SIZE,
    MXFP4Error,
    MXFP4Tensor,
    dequantize_mxfp4,
    fake_quantize_mxfp4,
    mxfp4_nbytes,
    quantize_mxfp4,
)

GRID = [Fraction(0), Fraction(1, 2), Fraction(1), Fraction(3, 2), Fraction(2), Fraction(3), Fraction(4), Fraction(6)]


# ----------------------------------------------------------------------------- slow reference
def ref_block(values: list[float]) -> tuple[list[int], int]:
    """One block of 32 Python floats -> (32 codes, scale byte). Exact rational arithmetic.

    Scale: E = floor(log2(amax)) - 2 (frexp is exact: amax = m * 2**e, m in [0.5, 1) -> floor = e-1),
    clamped to [-127, 127]; zero block -> -127; non-finite amax -> 0xFF with codes 0.
    Element: nearest grid magnitude to |v| / 2**E; ties -> the grid index with mantissa bit 0 (even
    index); above 6 -> 6. Canonical zero: sign bit only when the magnitude index is non-zero.
    """
    if any(not math.isfinite(v) for v in values):
        return [0] * len(values), 0xFF
    amax = max(abs(v) for v in values)
    if amax == 0:
        e = -127
    else:
        _, ex = math.frexp(amax)
        e = min(max(ex - 1 - 2, -127), 127)
    codes = []
    for v in values:
        mag = abs(Fraction(v)) / (Fraction(2) ** e)
        if mag >= 6:
            idx = 7
        else:
            dists = [abs(mag - g) for g in GRID]
            best = min(dists)
            cands = [i for i, d in enumerate(dists) if d == best]
            idx = cands[0] if len(cands) == 1 else next(i for i in cands if i % 2 == 0)
        sign = 1 if (v < 0 and idx > 0) else 0
        codes.append(sign << 3 | idx)
    return codes, e + 127


def ref_quantize(x: torch.Tensor) -> tuple[list[list[int]], list[int]]:
    flat = x.detach().reshape(-1, BLOCK_SIZE).tolist()  # float32/float64 -> exact Python floats
    out = [ref_block(b) for b in flat]
    return [c for c, _ in out], [s for _, s in out]


def unpack_codes(blocks: torch.Tensor) -> list[list[int]]:
    """uint8 [..., G, 16] -> per block 32 codes, low nibble first (written independently of the codec)."""
    rows = blocks.reshape(-1, 16).tolist()
    return [[c for byte in row for c in (byte & 0xF, byte >> 4)] for row in rows]


def gptoss_lut_dequant(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The public gpt-oss recipe, LUT[code] * 2**(scale - 127), with the LUT taken from transformers."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    lut = torch.tensor(FP4_VALUES, dtype=torch.float64)
    lo = lut[(blocks & 0x0F).long()]
    hi = lut[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], dim=-1).reshape(*blocks.shape[:-1], 32)
    factor = torch.pow(2.0, scales.to(torch.float64) - 127).unsqueeze(-1)
    return (vals * factor).reshape(*scales.shape[:-1], -1)


def random_wide(shape: tuple[int, ...], seed: int, dtype=torch.float32) -> torch.Tensor:
    """normal * 2**U(-20, 20), one exponent per block so scales vary widely across blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    nblk = x.numel() // BLOCK_SIZE
    e = torch.randint(-20, 21, (nblk, 1), generator=g).to(torch.float64)
    x = (x.reshape(nblk, BLOCK_SIZE) * torch.pow(2.0, e)).reshape(shape)
    return x.to(dtype)


# ----------------------------------------------------------------------------- the checks
def test_grid_values_roundtrip_losslessly_at_many_scales():
    grid = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -.5, -1, -1.5, -2, -3, -4, -6, 6] * 2, dtype=torch.float32)
    for e in (-127, -100, -3, 0, 1, 7, 100, 125):  # block amax 6 * 2**e -> scale exponent e
        x = torch.ldexp(grid, torch.tensor(e)).view(1, 32)
        b, s = quantize_mxfp4(x)
        assert int(s) == e + 127
        assert torch.equal(dequantize_mxfp4(b, s), x)


def test_ties_round_to_nearest_even_at_scale_one():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = torch.tensor((ties + [-t for t in ties] + [4.0, 0.0]) * 2, dtype=torch.float32).view(1, 32)
    b, s = quantize_mxfp4(x)
    assert int(s) == 127  # amax 5 -> floor(log2 5) - 2 = 0
    y = dequantize_mxfp4(b, s)[0]
    expect = [0, 1, 1, 2, 2, 4, 4]
    assert y[:7].tolist() == expect
    assert y[7:14].tolist() == [-v for v in expect]


def test_saturation_and_scale_exponent_edges():
    x = torch.zeros(1, 32)
    x[0, 0] = 7.9
    b, s = quantize_mxfp4(x)
    assert int(s) == 127 and dequantize_mxfp4(b, s)[0, 0].item() == 6.0  # keeps E=0, saturates
    x[0, 0] = 8.0
    b, s = quantize_mxfp4(x)
    assert int(s) == 128 and dequantize_mxfp4(b, s)[0, 0].item() == 8.0  # takes E=1
    # just below a power of two: float32 log2 rounds up, the exponent bits do not
    below = torch.nextafter(torch.tensor(8.0), torch.tensor(0.0)).item()
    assert torch.tensor(below, dtype=torch.float32).log2().item() == 3.0  # the trap exists in float32
    x[0, 0] = below
    _, s = quantize_mxfp4(x)
    assert int(s) == 127


def test_zero_and_tiny_blocks():
    b, s = quantize_mxfp4(torch.zeros(3, 64))
    assert s.eq(0).all() and b.eq(0).all()  # E = -127 -> byte 0
    neg_zero = torch.full((1, 32), -0.0)
    b, s = quantize_mxfp4(neg_zero)
    assert b.eq(0).all()  # canonical +0
    sub = torch.full((1, 32), 1e-45)  # float32 subnormal amax: E clamps to -127
    b, s = quantize_mxfp4(sub)
    assert int(s) == 0
    assert torch.equal(dequantize_mxfp4(b, s), torch.zeros(1, 32))  # 1e-45 * 2**127 ~ 1.7e-7 -> 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_bit_exact_against_slow_reference(dtype):
    x = random_wide((4, 3, 256), seed=1 + len(str(dtype)), dtype=dtype)
    if dtype == torch.float16:  # float16 cannot hold 2**+-20 * normal: use a range it holds
        x = (torch.randn(4, 3, 256, generator=torch.Generator().manual_seed(5)) * 300).to(dtype)
    # make sure ties, saturation and exact zeros appear too
    x.view(-1)[:8] = torch.tensor([0.25, 0.75, 5.0, -3.5, 0.0, -0.0, 6.0, 1.25]).to(dtype)
    b, s = quantize_mxfp4(x)
    assert b.shape == (4, 3, 8, 16) and s.shape == (4, 3, 8) and b.dtype == s.dtype == torch.uint8
    codes_ref, scales_ref = ref_quantize(x.to(torch.float64) if dtype != torch.float64 else x)
    assert s.reshape(-1).tolist() == scales_ref
    assert unpack_codes(b) == codes_ref


def test_non_finite_blocks_get_nan_scale_or_refuse():
    x = random_wide((2, 128), seed=3)
    x[0, 5] = float("nan")
    x[1, 100] = float("inf")
    x[1, 40] = -float("inf")
    b, s = quantize_mxfp4(x)
    codes_ref, scales_ref = ref_quantize(x)
    assert s.reshape(-1).tolist() == scales_ref
    assert unpack_codes(b) == codes_ref
    assert s[0, 0] == 0xFF and s[1, 3] == 0xFF and s[1, 1] == 0xFF and s[0, 1] != 0xFF
    y = dequantize_mxfp4(b, s)
    assert torch.isnan(y[0, :32]).all() and torch.isfinite(y[0, 32:]).all()
    with pytest.raises(MXFP4Error, match=r"non-finite.*flat index 5"):
        quantize_mxfp4(x, nonfinite="raise")


def test_storage_is_17_bytes_per_32_values():
    x = torch.randn(6, 4, 96)
    q = MXFP4Tensor.quantize(x)
    assert q.nbytes == x.numel() // 32 * 17 == mxfp4_nbytes(x.shape)
    assert q.shape == tuple(x.shape)
    assert q.nbytes * 8 / x.numel() == 4.25


# ----------------------------------------------------------------------------- public decoders
def test_gptoss_lut_recipe_decodes_our_checkpoints():
    x = random_wide((3, 5, 128), seed=11)
    b, s = quantize_mxfp4(x)
    ours = dequantize_mxfp4(b, s, dtype=torch.float64)
    assert torch.equal(ours, gptoss_lut_dequant(b, s))
    # transformers' own gpt-oss converter (it returns experts as [E, in, out], hence the transpose)
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    theirs = convert_moe_packed_tensors(b, s, dtype=torch.float32)
    assert torch.equal(theirs, dequantize_mxfp4(b, s).transpose(1, 2))


def test_scale_bytes_decode_like_torch_e8m0():
    s = torch.arange(256, dtype=torch.uint8).view(8, 32)
    b = torch.full((8, 32, 16), 0x22, dtype=torch.uint8)  # every element 1.0
    y = dequantize_mxfp4(b, s)
    e8m0 = s.view(torch.float8_e8m0fnu).float().unsqueeze(-1).expand(8, 32, 32).reshape(8, 1024)
    assert torch.equal(torch.isnan(y), torch.isnan(e8m0))
    assert torch.equal(y.nan_to_num(), e8m0.nan_to_num())


def test_dequantize_every_code_and_nibble_order():
    # byte (hi << 4 | lo): element 2i is lo, element 2i+1 is hi
    blocks = torch.arange(256, dtype=torch.uint8).view(16, 16)
    scales = torch.full((16,), 127, dtype=torch.uint8)
    y = dequantize_mxfp4(blocks, scales).view(256, 2)
    vals = [0, .5, 1, 1.5, 2, 3, 4, 6]
    for byte in range(256):
        lo, hi = byte & 0xF, byte >> 4
        exp_lo = (-1 if lo & 8 else 1) * vals[lo & 7]
        exp_hi = (-1 if hi & 8 else 1) * vals[hi & 7]
        assert y[byte].tolist() == [exp_lo, exp_hi]
    assert math.copysign(1.0, y[8, 0].item()) == -1.0  # code 8 decodes to -0.0 as in the gpt-oss LUT


# ----------------------------------------------------------------------------- properties
def test_error_is_bounded_by_half_step_of_the_block():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    y = fake_quantize_mxfp4(x)
    b, s = quantize_mxfp4(x)
    unit = torch.pow(2.0, s.float() - 127).repeat_interleave(32, dim=-1)  # 2**E per element
    # up to 6 * 2**E the error is at most half the largest grid gap (2 * 2**E); above it saturates
    bound = torch.where(x.abs() <= 6 * unit, unit, x.abs() - 6 * unit)
    assert ((y - x).abs() <= bound).all()
    assert ((y - x).abs() > 0.5 * unit).any()  # the bound is not vacuous
    # relative to the block amax the error is small and the sign is kept
    assert torch.all((y == 0) | (torch.sign(y) == torch.sign(x)))


def test_chunk_boundaries_do_not_matter():
    x = random_wide((20000, 32), seed=2)  # > one internal chunk of blocks
    b, s = quantize_mxfp4(x)
    b2 = torch.cat([quantize_mxfp4(x[i:i + 999])[0] for i in range(0, 20000, 999)])
    assert torch.equal(b, b2)
    assert torch.equal(dequantize_mxfp4(b, s)[12345], dequantize_mxfp4(b[12345:12346], s[12345:12346])[0])


def test_half_output_dtypes_and_non_contiguous_input():
    x = torch.randn(64, 96)
    xt = x.t()  # non-contiguous [96, 64]
    b, s = quantize_mxfp4(xt)
    b2, s2 = quantize_mxfp4(xt.contiguous())
    assert torch.equal(b, b2) and torch.equal(s, s2)
    y32 = dequantize_mxfp4(b, s)
    assert torch.equal(dequantize_mxfp4(b, s, dtype=torch.bfloat16), y32.to(torch.bfloat16))
    assert fake_quantize_mxfp4(x.to(torch.bfloat16)).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors():
    with pytest.raises(TypeError, match="int64"):
        quantize_mxfp4(torch.ones(2, 32, dtype=torch.int64))
    with pytest.raises(TypeError, match="bool"):
        quantize_mxfp4(torch.ones(32, dtype=torch.bool))
    with pytest.raises(TypeError, match="torch.Tensor"):
        quantize_mxfp4([1.0] * 32)  # type: ignore[arg-type]
    with pytest.raises(MXFP4Error, match=r"last dimension .* is 48, not a positive multiple of 32.*Pad to 64"):
        quantize_mxfp4(torch.ones(3, 48))
    with pytest.raises(MXFP4Error, match="0-d"):
        quantize_mxfp4(torch.tensor(1.0))
    with pytest.raises(ValueError, match="nonfinite"):
        quantize_mxfp4(torch.ones(32), nonfinite="zero")  # type: ignore[arg-type]
    b, s = quantize_mxfp4(torch.ones(2, 64))
    with pytest.raises(TypeError, match="uint8"):
        dequantize_mxfp4(b.int(), s)
    with pytest.raises(MXFP4Error, match="expected blocks"):
        dequantize_mxfp4(b, s[:, :1])
    with pytest.raises(TypeError, match="float dtype"):
        dequantize_mxfp4(b, s, dtype=torch.int32)


def test_empty_leading_dims_are_fine():
    b, s = quantize_mxfp4(torch.empty(0, 64))
    assert b.shape == (0, 2, 16) and s.shape == (0, 2)
    assert dequantize_mxfp4(b, s).shape == (0, 64)


def test_threaded_chunks_report_the_first_bad_value():
    x = torch.randn(12000, 64)  # 24,000 blocks: several chunks on several threads
    x[11000, 3] = float("nan")
    x[200, 5] = float("inf")
    with pytest.raises(MXFP4Error, match=f"flat index {200 * 64 + 5} "):
        quantize_mxfp4(x, nonfinite="raise")
    b, s = quantize_mxfp4(x)
    assert int(s[200, 0]) == 0xFF and int(s[11000, 0]) == 0xFF and int((s == 0xFF).sum()) == 2
