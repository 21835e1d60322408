"""Pieces several rules share, as ``@triton.jit`` helpers (the torch dialect rebinds them too)."""

import triton
import triton.language as tl


@triton.jit
def lerp(start, end, weight):
    """torch.lerp's own formula: ``start + w * (end - start)`` for ``|w| < 0.5``, else from ``end``.

    torch picks the side so that ``w = 1`` gives exactly ``end``; matching it keeps
    moving averages (``exp_avg.lerp_(grad, 1 - beta1)``) equal to torch's to the bit.
    """
    return tl.where(tl.abs(weight) < 0.5, start + weight * (end - start), end - (end - start) * (1.0 - weight))


@triton.jit
def sign(x):
    """torch.sign: 1 or -1, a zero stays zero and NaN stays NaN."""
    return tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, x))
