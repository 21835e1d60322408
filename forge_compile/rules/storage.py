"""How an updated value is stored: bf16 weights rounded stochastically, 8-bit blockwise states.

Written once in Triton's dialect, like the rules: the fused kernel's epilogue calls these
helpers as ``triton.jit`` functions, and every torch path (the CPU fused op, the unfused
Inductor decomposition, eager steps) runs the same text through the torch dialect, which
computes the 32-bit integer arithmetic in int64. Inductor compiles the rounding of an
unfused update through the Inductor dialect (:mod:`forge_compile.lowerings`), the same
text on Inductor's ``ops``, also in int64. So all paths draw the same random bits and
produce the same codes.

**Stochastic rounding** (fp32 -> bf16). Adding 16 uniform random bits to the low half of
an fp32 pattern and truncating rounds the magnitude up with probability equal to the
dropped fraction of an ULP, so the expected stored value is the fp32 value exactly: an
update smaller than half a bf16 ULP still moves the weight on average, where rounding to
nearest drops it every step. The bits come from a counter-based hash of the element's
index in the weight (row-major, whatever the strides or tile shape) keyed by the
parameter's seed and the step: reproducible, and independent between elements, steps and
parameters. The hash is lowbias32 (C. Wellons' hash prospector): two multiplies per
element where Philox-4x32-10 takes twenty.

**8-bit blockwise states.** Each run of 64 elements along a weight row shares one fp32
scale, the block's largest magnitude. Values are stored through a square-root companding
code: a first moment ``m`` (signed) as ``round(127 * sign(m) * sqrt(|m| / absmax))`` in an
int8, a second moment ``v`` (non-negative) as ``round(255 * (v / absmax) ** (1/4))`` in a
uint8, i.e. ``sqrt(v)`` under the same square-root code as ``m``. Like a dynamic
(exponent) code this spends its levels near zero, where Adam's moments mostly are,
but it needs no table: decoding is ``absmax * c * |c| / 127**2`` and ``absmax * (c / 255)**4``.
``benchmarks/quantization_schemes.py`` compares it with linear absmax and with the
signed/unsigned dynamic tree code on the moments of a real training run.

Round-trip bounds (``x`` in a block with scale ``a``): signed,
``|x - x'| <= a * (s + 1/4) / 127**2`` with ``s = 127 * sqrt(|x| / a)``, so at most
``a / 126.5`` and ``a / 64516`` near zero; non-negative, ``|sqrt(x) - sqrt(x')| <=
sqrt(a) * (s + 1/4) / 255**2`` with ``s = 255 * (x / a) ** (1/4)``.
"""

import triton
import triton.language as tl

QUANT_BLOCK = 64
"""Elements per scale along a weight row."""


@triton.jit
def hash32(x):
    """lowbias32 on values in [0, 2**32) (uint32 in Triton, int64 in the torch dialect)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    # x * 0x846CA68B mod 2**32 as x * 0x046CA68B + (x & 1) * 2**31, so that no product
    # leaves int64 in the torch dialect.
    x = (x * 0x046CA68B + ((x & 1) << 31)) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    return x


@triton.jit
def rounding_key(seed, step):
    """The per-step key of a parameter: ``seed`` an int in [0, 2**31), ``step`` the step count."""
    return hash32((step.to(tl.uint32) * 0x9E3779B9 + seed) & 0xFFFFFFFF)


@triton.jit
def round_bfloat16_stochastically(x, element_index, key):
    """fp32 ``x`` rounded to a bf16 value (returned as fp32) up or down at random, with
    the probability that makes the expected result ``x``. NaN stays NaN."""
    random16 = hash32((element_index.to(tl.uint32) ^ key) & 0xFFFFFFFF) >> 16
    bits = tl.cast(x, tl.uint32, bitcast=True)
    rounded = tl.cast((bits + random16) & 0xFFFF0000, tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


@triton.jit
def dequantize_blocks(codes, absmax, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr,
                      SIGNED: tl.constexpr):  # fmt: skip
    """[ROWS, COLS] codes (as fp32) and their [ROWS, COLS // BLOCK] scales -> [ROWS, COLS] fp32 values."""
    blocks = tl.reshape(codes, (ROWS, COLS // BLOCK, BLOCK))
    if SIGNED:
        unit = blocks * tl.abs(blocks) * (1.0 / 16129.0)
    else:
        root = blocks * (1.0 / 255.0)
        unit = root * root
        unit = unit * unit
    return tl.reshape(unit * absmax[:, :, None], (ROWS, COLS))


@triton.jit
def quantize_blocks(x, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr, SIGNED: tl.constexpr):
    """[ROWS, COLS] fp32 values (COLS a multiple of BLOCK, padding zero) -> (codes as fp32,
    [ROWS, COLS // BLOCK] scales)."""
    blocks = tl.reshape(x, (ROWS, COLS // BLOCK, BLOCK))
    absmax = tl.max(tl.abs(blocks), axis=2)
    scale = tl.where(absmax > 0, absmax, 1.0)
    unit = tl.div_rn(tl.abs(blocks), scale[:, :, None])
    if SIGNED:
        magnitude = tl.floor(tl.sqrt_rn(unit) * 127.0 + 0.5)
        codes = tl.where(blocks < 0, -magnitude, magnitude)
    else:
        codes = tl.floor(tl.sqrt_rn(tl.sqrt_rn(unit)) * 255.0 + 0.5)
    return tl.reshape(codes, (ROWS, COLS)), absmax
