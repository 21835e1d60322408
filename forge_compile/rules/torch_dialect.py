"""The few ``tl`` names that forge's rules use, implemented with torch operations.

Rules in :mod:`forge_compile.rules` are written in Triton's dialect. Binding the global
name ``tl`` to this module runs the same text on torch tensors: on the CPU, inside the
fused op's fallback, and as the decomposition that Inductor compiles for unfused updates.
Every function keeps Triton's semantics for the arguments rules pass (fp32 tensors and
0-d fp32/fp64 tensors), with IEEE rounding, which is what ``sqrt_rn``/``div_rn`` ask of
Triton too.
"""

import torch

float16 = torch.float16
bfloat16 = torch.bfloat16
float32 = torch.float32
float64 = torch.float64


def exp(x):
    return torch.exp(x)


def log(x):
    return torch.log(x)


def sqrt(x):
    return torch.sqrt(x)


def sqrt_rn(x):
    return torch.sqrt(x)


def div_rn(x, y):
    return torch.div(x, y)


def abs(x):  # noqa: A001 - mirrors tl.abs
    return torch.abs(x)


class PropagateNan:
    """torch's maximum/minimum always propagate NaN: rules ask Triton for ``ALL`` too."""

    ALL = "all"
    NONE = "none"


def maximum(x, y, propagate_nan=PropagateNan.ALL):
    return torch.maximum(x, y)


def minimum(x, y, propagate_nan=PropagateNan.ALL):
    return torch.minimum(x, y)


def where(condition, x, y):
    return torch.where(condition, x, y)


# 32-bit unsigned integers are held in int64: the storage helpers mask every result to
# 32 bits, and int64 keeps their products exact (or exact modulo 2**64, whose low 32
# bits are what uint32 arithmetic gives).
uint32 = torch.int64
_LOW_32 = 0xFFFFFFFF


def cast(x, dtype, bitcast=False):
    if not bitcast:
        return x.to(dtype)
    if x.dtype == torch.float32 and dtype == uint32:
        return x.view(torch.int32).to(torch.int64) & _LOW_32
    if x.dtype == torch.int64 and dtype == torch.float32:
        low = x & _LOW_32
        return (low - ((low & 0x80000000) << 1)).to(torch.int32).view(torch.float32)
    raise TypeError(f"forge: the torch dialect bitcasts fp32 <-> uint32 only, not {x.dtype} -> {dtype}")


def floor(x):
    return torch.floor(x)


def reshape(x, shape):
    return x.reshape(shape)


def max(x, axis):  # noqa: A001 - mirrors tl.max
    return x.amax(dim=axis)
