"""MXFP4 codec: OCP Microscaling FP4 (MX v1.0) quantize / dequantize of float tensors.

What it does
    Splits the LAST dimension of a float tensor into blocks of 32 values. Each block gets one shared
    power-of-two scale (an E8M0 byte, bias 127) and each value becomes a 4-bit E2M1 code; two codes
    are packed per byte, first element in the low nibble. The result is the layout gpt-oss
    checkpoints use: `blocks` uint8 [..., G, 16] and `scales` uint8 [..., G] with G = last_dim / 32,
    so 17 bytes hold 32 values (4.25 bits per value). Dequantizing with the public gpt-oss recipe
    `FP4_VALUES[code] * 2**(scale - 127)` gives exactly what `dequantize_mxfp4` gives.

The recipe (OCP "OCP Microscaling Formats (MX) v1.0 Specification", sections 5.3 and 6.3)
    E     = floor(log2(amax)) - emax_elem, emax_elem = 2 for E2M1, read from the float's exponent
            bits (float32 log2 rounds values just below a power of two up, which would pick a scale
            one too large), clamped to [-127, 127]; an all-zero block gets E = -127.
    scale = E + 127 as a byte; a block whose amax is NaN or +-Inf gets scale 0xFF (the E8M0 NaN).
    code  = sign << 3 | index of round(v * 2**-E) on the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6},
            round-to-nearest-even, saturating at +-6 (values up to 8 * 2**E can occur in a block).

Choices this module makes (and tests pin)
    * Ties round to nearest EVEN (the even neighbour is the one whose mantissa bit is 0), as IEEE
      and the OCP spec do; Microsoft's `microxcaling` library defaults to half-away-from-zero.
    * Zero is canonical +0: a value that rounds to 0 gets code 0 whatever its sign, so code 0b1000
      (-0) is never written (it still decodes to -0.0, as in the gpt-oss LUT).
    * The last dimension must be a multiple of 32: we REFUSE rather than pad, because the gpt-oss
      layout has no field for the unpadded length, so a padded tensor would come back from any
      other reader with the wrong shape. Callers that can skip a tensor (the exporter) keep such
      tensors in high precision instead.
    * Non-finite inputs: by default a block containing NaN/Inf is stored as scale 0xFF with all
      codes 0, and dequantizes to NaN for all 32 values (OCP: a NaN scale makes the whole block
      NaN). `nonfinite="raise"` refuses instead, naming how many values and the first position.
    * float16 / bfloat16 / float32 inputs are processed in float32 (exact widening); float64 is
      processed in float64, so its exponent is read from float64 bits, never rounded first.

What it does not do
    No MX matmul kernels, no other MX element types (FP6/FP8/INT8), no stochastic rounding, no
    per-tensor second-level scale (that is NVFP4, a different format). Checkpoint files and weight
    sync payloads live in `model.mxfp4_export`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

if sys.byteorder != "little":  # the nibble packing below reads byte pairs as little-endian int16
    raise ImportError("model.mxfp4 assumes a little-endian machine")

BLOCK_SIZE = 32  # values per shared scale (OCP MX v1.0, k = 32)
BYTES_PER_BLOCK = BLOCK_SIZE // 2 + 1  # 16 bytes of packed codes + 1 scale byte = 17
SCALE_BIAS = 127  # E8M0 exponent bias
SCALE_NAN = 0xFF  # E8M0 NaN encoding
E2M1_EMAX = 2  # exponent of the largest E2M1 normal (6 = 1.5 * 2**2)
E2M1_MAX = 6.0
# Magnitudes of the 8 non-negative E2M1 codes, index = code & 0b0111 (OCP MX v1.0 table 5).
E2M1_GRID: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Rounding thresholds between neighbouring grid values: a magnitude goes UP past a midpoint, and on
# an exact tie it goes to the neighbour whose mantissa bit is 0 (round-to-nearest-even).
#   midpoint  0.25: 0 (even) vs 0.5 (odd)  -> tie stays down  -> count "a >  0.25"
#   midpoint  0.75: 0.5 (odd) vs 1 (even)  -> tie goes up     -> count "a >= 0.75"
#   midpoint  1.25: 1 (even) vs 1.5 (odd)  -> down ; 1.75: 1.5 vs 2 (even) -> up
#   midpoint  2.5 : 2 (even) vs 3 (odd)    -> down ; 3.5 : 3 vs 4 (even)   -> up
#   midpoint  5   : 4 (even) vs 6 (odd)    -> down ; above 6 saturates at index 7 automatically.
_THRESHOLDS: tuple[tuple[float, bool], ...] = (
    (0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False),
)

# Work on 1000 blocks (32,000 values) at a time: the ~20 elementwise passes then stay in cache, and
# each op is below torch's parallel grain (32,768 elements), so it runs on the calling thread without
# an OpenMP barrier. Chunks are spread over a small thread pool instead (torch ops release the GIL).
# Why not let torch parallelise bigger chunks: on a shared 2-core machine every OpenMP barrier waits
# for a descheduled thread: we measured single ops up to 100x slower (3.7 ms instead of 27 us on
# 256K floats) while other jobs loaded the cores.
_CHUNK_BLOCKS = 1000
_INLINE_MAX_CHUNKS = 4  # below this many chunks, no thread pool


def _for_chunks(nb: int, body: Callable[[int, int], None], device: torch.device) -> None:
    """Call body(start, end) over [0, nb) in chunks of _CHUNK_BLOCKS blocks, on up to
    torch.get_num_threads() threads each owning one contiguous range. Re-raises the error of the
    lowest range first, so "first bad index" messages do not depend on thread timing."""
    if device.type != "cpu":  # accelerators: one launch per op is what they want
        body(0, nb)
        return
    n_chunks = -(-nb // _CHUNK_BLOCKS)
    workers = min(torch.get_num_threads(), n_chunks)
    if n_chunks <= _INLINE_MAX_CHUNKS or workers <= 1:
        for s in range(0, nb, _CHUNK_BLOCKS):
            body(s, min(s + _CHUNK_BLOCKS, nb))
        return
    per = -(-n_chunks // workers) * _CHUNK_BLOCKS

    def run(lo: int, hi: int) -> None:
        for s in range(lo, hi, _CHUNK_BLOCKS):
            body(s, min(s + _CHUNK_BLOCKS, hi))

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mxfp4") as pool:
        futures = [pool.submit(run, lo, min(lo + per, nb)) for lo in range(0, nb, per)]
    for f in futures:  # all finished (the with-block waits); raise in range order
        f.result()

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class MXFP4Error(ValueError):
    """Input that the MXFP4 codec refuses (wrong shape, non-finite values under 'raise', bad codes)."""


# ----------------------------------------------------------------------------- lookup tables
def _code_values() -> torch.Tensor:
    """float32 [16]: value of each 4-bit code (sign << 3 | index); code 8 is -0.0 (gpt-oss LUT)."""
    pos = torch.tensor(E2M1_GRID, dtype=torch.float32)
    return torch.cat([pos, -pos])


_CODE_VALUES_16 = _code_values()
# byte -> (value of low nibble, value of high nibble): one gather decodes two elements.
_BYTE_PAIR_LUT_256x2 = torch.stack(
    [_CODE_VALUES_16[torch.arange(256) & 0x0F], _CODE_VALUES_16[torch.arange(256) >> 4]], dim=1
).contiguous()
# scale byte -> 2**(byte - 127) as float32; 2**-127 is a float32 subnormal, still exact; 0xFF -> NaN.
_SCALE_LUT_256 = torch.ldexp(torch.ones(256, dtype=torch.float32), torch.arange(256) - SCALE_BIAS)
_SCALE_LUT_256[SCALE_NAN] = float("nan")


# ----------------------------------------------------------------------------- validation
def _check_float_input(x: object, what: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"MXFP4 quantize: {what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in _FLOAT_DTYPES)
        raise TypeError(f"MXFP4 quantize: {what} has dtype {str(x.dtype).removeprefix('torch.')}; "
                        f"only floating tensors can be quantized ({allowed})")
    if x.dim() == 0:
        raise MXFP4Error(f"MXFP4 quantize: {what} is a 0-d scalar; blocks run along the last dimension, "
                         f"which needs at least one dimension")
    k = x.shape[-1]
    if k == 0 or k % BLOCK_SIZE != 0:
        nxt = max(BLOCK_SIZE, -(-k // BLOCK_SIZE) * BLOCK_SIZE)
        raise MXFP4Error(
            f"MXFP4 quantize: last dimension of {what} with shape {tuple(x.shape)} is {k}, not a positive "
            f"multiple of {BLOCK_SIZE}; refusing to pad (the blocks/scales layout cannot record an "
            f"unpadded length). Pad to {nxt} yourself or keep this tensor in high precision.")
    return x


def mxfp4_nbytes(shape: tuple[int, ...] | torch.Size) -> int:
    """Bytes that `quantize_mxfp4` stores for a tensor of `shape` (17 per 32 values)."""
    n = 1
    for s in shape:
        n *= int(s)
    if n % BLOCK_SIZE:
        raise MXFP4Error(f"shape {tuple(shape)} does not hold whole blocks of {BLOCK_SIZE}")
    return n // BLOCK_SIZE * BYTES_PER_BLOCK


# ----------------------------------------------------------------------------- quantize
def _round_to_index_slow(a: torch.Tensor) -> torch.Tensor:
    """|a| -> E2M1 grid index 0..7 (round-to-nearest-even, saturating) by counting thresholds passed.

    The plain statement of the rounding rule; only used to build the lookup tables below.
    """
    m = a.abs()
    idx = torch.zeros(a.shape, dtype=torch.uint8)
    for t, tie_up in _THRESHOLDS:
        idx += (m >= t) if tie_up else (m > t)
    return idx


# Fast rounding without comparisons (bool tensors are slow on CPU): every threshold has at most two
# mantissa bits, so whether a value passes it depends only on (sign, exponent, top 2 mantissa bits)
# and on whether any lower mantissa bit is set. With u = the float's bits without the sign,
#     key = (u >> lo) + ((u + 2**lo - 1) >> lo)  =  2 * (u >> lo) + [low bits != 0]
# and the sign goes to the top bit of the key. The table maps key -> full 4-bit code (sign included,
# zero canonical +0). It is built once from `_round_to_index_slow` on one representative per key.
@dataclass(frozen=True)
class _KeySpec:
    int_dtype: torch.dtype
    lo: int  # mantissa bits below the top two
    sign_shift: int  # bit position of the sign
    exp_mant_bits: int  # exponent bits + 2 mantissa bits


_KEYSPECS = {
    torch.float32: _KeySpec(torch.int32, 21, 31, 10),
    torch.float64: _KeySpec(torch.int64, 50, 63, 13),
}


def _build_code_lut(fdtype: torch.dtype) -> torch.Tensor:
    ks = _KEYSPECS[fdtype]
    n = 1 << ks.exp_mant_bits
    top = torch.arange(n, dtype=ks.int_dtype) << ks.lo
    # even key: exactly on a 2-mantissa-bit value; odd key: strictly inside the next interval.
    # The top interval (exponent all ones) is NaN/Inf; those blocks are overwritten later anyway.
    reps = torch.stack([top, top | 1], dim=1).reshape(-1).view(fdtype)
    idx = _round_to_index_slow(torch.nan_to_num(reps, nan=0.0))
    signed = torch.where(idx > 0, idx | 0b1000, idx)  # canonical zero: no sign on index 0
    return torch.cat([idx, signed]).contiguous()  # [2 * 2n], key with sign in the top bit


_CODE_LUT = {dt: _build_code_lut(dt) for dt in _KEYSPECS}


def _codes(a_NB32: torch.Tensor) -> torch.Tensor:
    """Scaled values (finite) -> uint8 4-bit codes, same shape, via the key table."""
    ks = _KEYSPECS[a_NB32.dtype]
    bits = a_NB32.view(ks.int_dtype)
    sign_mask = (1 << ks.sign_shift)
    u = bits & (sign_mask - 1)
    key = (u >> ks.lo).add_((u + ((1 << ks.lo) - 1)) >> ks.lo)
    # sign bit -> bit (exp_mant_bits + 1) of the key; `>>` on a negative int is arithmetic, so mask.
    key |= (bits >> (ks.sign_shift - ks.exp_mant_bits - 1)) & (1 << (ks.exp_mant_bits + 1))
    lut = _CODE_LUT[a_NB32.dtype].to(a_NB32.device)
    return lut.index_select(0, key.reshape(-1)).view(a_NB32.shape)


def _quantize_chunk(x_NB32: torch.Tensor, nonfinite: str, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [nb, 32] values (float32 or float64) -> (packed uint8 [nb, 16], scale uint8 [nb])."""
    amax_NB = x_NB32.abs().amax(dim=1)
    # floor(log2(amax)) straight from the exponent field: exact for every normal number; zero and
    # subnormal amax (field 0) land below -127 and are clamped there, as the spec asks for zero.
    if x_NB32.dtype == torch.float64:
        field_NB = (amax_NB.view(torch.int64) >> 52) & 0x7FF
        nonfinite_NB = field_NB == 0x7FF
        e_NB = (field_NB - (1023 + E2M1_EMAX)).clamp_(-SCALE_BIAS, SCALE_BIAS)
        inv_scale_NB = torch.ldexp(torch.ones_like(amax_NB), -e_NB)
    else:
        field_NB = (amax_NB.view(torch.int32) >> 23) & 0xFF
        nonfinite_NB = field_NB == 0xFF
        e_NB = (field_NB - (127 + E2M1_EMAX)).clamp_(-SCALE_BIAS, SCALE_BIAS)
        # 2**-E built from its bits: E <= 125 for any finite float32 amax, so 127 - E >= 2 and the
        # result is a normal float32 (no ldexp call, no subnormal).
        inv_scale_NB = ((SCALE_BIAS - e_NB).to(torch.int32) << 23).view(torch.float32)
    any_nonfinite = bool(nonfinite_NB.any())
    if any_nonfinite and nonfinite == "raise":
        bad = ~torch.isfinite(x_NB32.reshape(-1))
        first = int(bad.nonzero()[0, 0]) + offset
        raise MXFP4Error(f"MXFP4 quantize: input has non-finite values (NaN/Inf), first at flat index "
                         f"{first} (this chunk holds {int(bad.sum())}); pass nonfinite='nan_block' to "
                         f"store such blocks as NaN")
    # Multiplying by a power of two is exact unless the product is subnormal, and such products
    # (< 2**-126) round to code 0 either way, so `a` is exactly x * 2**-E.
    a_NB32 = x_NB32 * inv_scale_NB.unsqueeze(1)
    if x_NB32.dtype == torch.float64:
        a_NB32.clamp_(-8.0, 8.0)  # E is clamped at 127, so huge float64 values can exceed 8: saturate
    if any_nonfinite:
        a_NB32 = torch.nan_to_num(a_NB32, nan=0.0, posinf=0.0, neginf=0.0)  # keep keys in range
    code_NB32 = _codes(a_NB32)
    scale_NB = (e_NB + SCALE_BIAS).to(torch.uint8)
    if any_nonfinite:
        code_NB32[nonfinite_NB] = 0
        scale_NB[nonfinite_NB] = SCALE_NAN
    # Pack pairs: on a little-endian machine an int16 view of bytes (c0, c1) is c0 | c1 << 8, and
    # (v & 0xF) | ((v >> 4) & 0xF0) = c0 | c1 << 4: first element in the low nibble. Strided
    # slicing [:, 0::2] does the same but measured ~3x slower.
    pair_NB16 = code_NB32.view(torch.int16)
    packed_NB16 = ((pair_NB16 & 0x0F) | ((pair_NB16 >> 4) & 0xF0)).to(torch.uint8)
    return packed_NB16, scale_NB


@torch.no_grad()
def quantize_mxfp4(x: torch.Tensor, *, nonfinite: Literal["nan_block", "raise"] = "nan_block"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` [..., K] (K a multiple of 32) along its last dimension.

    Returns `(blocks, scales)`: blocks uint8 [..., K/32, 16] (two E2M1 codes per byte, first element
    in the low nibble), scales uint8 [..., K/32] (E8M0, bias 127; 0xFF marks a NaN block).
    Raises TypeError for non-tensors and non-float dtypes, MXFP4Error for a bad last dimension, and
    for NaN/Inf values when `nonfinite="raise"`.
    """
    if nonfinite not in ("nan_block", "raise"):
        raise ValueError(f"nonfinite must be 'nan_block' or 'raise', got {nonfinite!r}")
    x = _check_float_input(x)
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    g = k // BLOCK_SIZE
    work_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    x_NB32 = x.detach().contiguous().view(-1, BLOCK_SIZE)
    nb = x_NB32.shape[0]
    blocks_NB16 = torch.empty((nb, BLOCK_SIZE // 2), dtype=torch.uint8, device=x.device)
    scales_NB = torch.empty((nb,), dtype=torch.uint8, device=x.device)

    def body(s: int, e: int) -> None:
        # .to() copies half inputs into float32; a float32 input is only read.
        blk, sc = _quantize_chunk(x_NB32[s:e].to(work_dtype), nonfinite, s * BLOCK_SIZE)
        blocks_NB16[s:e] = blk
        scales_NB[s:e] = sc

    _for_chunks(nb, body, x.device)
    return blocks_NB16.view(*lead, g, BLOCK_SIZE // 2), scales_NB.view(*lead, g)


# ----------------------------------------------------------------------------- dequantize
@torch.no_grad()
def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse layout of `quantize_mxfp4`: blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G*32].

    Value = E2M1(code) * 2**(scale - 127), computed exactly in float32 then cast to `dtype` (a
    float16 target can overflow/underflow for extreme scales; that cast is the caller's choice).
    A 0xFF scale yields NaN for its whole block.
    """
    for nm, t in (("blocks", blocks), ("scales", scales)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"MXFP4 dequantize: {nm} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.uint8:
            raise TypeError(f"MXFP4 dequantize: {nm} must be uint8, got {str(t.dtype).removeprefix('torch.')}")
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"MXFP4 dequantize: output dtype must be a float dtype, got {dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_SIZE // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise MXFP4Error(f"MXFP4 dequantize: expected blocks [..., G, {BLOCK_SIZE // 2}] and scales [..., G]; "
                         f"got blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}")
    lead_g = tuple(blocks.shape[:-1])
    dev = blocks.device
    pair_lut = _BYTE_PAIR_LUT_256x2.to(dev)
    scale_lut = _SCALE_LUT_256.to(dev)
    b_NB16 = blocks.contiguous().view(-1, BLOCK_SIZE // 2)
    s_NB = scales.contiguous().view(-1)
    nb = s_NB.shape[0]
    out_NB32 = torch.empty((nb, BLOCK_SIZE), dtype=dtype, device=dev)

    def body(s: int, e: int) -> None:
        n = e - s
        vals_NB32 = pair_lut.index_select(0, b_NB16[s:e].reshape(-1).to(torch.int32)).view(n, BLOCK_SIZE)
        mult_NB1 = scale_lut.index_select(0, s_NB[s:e].to(torch.int32)).view(n, 1)
        out_NB32[s:e] = vals_NB32.mul_(mult_NB1)

    _for_chunks(nb, body, dev)
    return out_NB32.view(*lead_g[:-1], lead_g[-1] * BLOCK_SIZE)


def fake_quantize_mxfp4(x: torch.Tensor, *, nonfinite: Literal["nan_block", "raise"] = "nan_block") -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype and shape: the weights an MXFP4 deployment computes with."""
    b, s = quantize_mxfp4(x, nonfinite=nonfinite)
    return dequantize_mxfp4(b, s, dtype=x.dtype)


@dataclass(frozen=True)
class MXFP4Tensor:
    """A quantized tensor with what is needed to restore it: packed codes, scales, original dtype.

    blocks: uint8 [..., G, 16]; scales: uint8 [..., G]; the logical shape is [..., G*32].
    """

    blocks: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @classmethod
    def quantize(cls, x: torch.Tensor, *, nonfinite: Literal["nan_block", "raise"] = "nan_block") -> "MXFP4Tensor":
        b, s = quantize_mxfp4(x, nonfinite=nonfinite)
        return cls(blocks=b, scales=s, dtype=x.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.scales.shape[:-1], self.scales.shape[-1] * BLOCK_SIZE)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size() + self.scales.numel() * self.scales.element_size()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks, self.scales, dtype=dtype or self.dtype)
