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


@triton.jit
def maximize_and_decay(param, grad, decay, weight_decay, MAXIMIZE, WEIGHT_DECAY, DECOUPLED_WEIGHT_DECAY):
    """torch.optim's preamble: ``-grad`` for maximize, then weight decay on the weight
    (decoupled: ``param * (1 - lr * wd)``, given as ``decay``) or on the gradient (L2:
    ``grad + wd * param``). Returns (param, grad)."""
    if MAXIMIZE:
        grad = -grad
    if WEIGHT_DECAY:
        if DECOUPLED_WEIGHT_DECAY:
            param = param * decay
        else:
            grad = grad + weight_decay * param
    return param, grad


@triton.jit
def adam_moments(exp_avg, exp_avg_sq, grad, one_minus_beta1, beta2, one_minus_beta2):
    """Adam's moving averages in torch's order: ``exp_avg.lerp_(grad, 1 - beta1)`` and
    ``exp_avg_sq * beta2 + (1 - beta2) * grad * grad``. Returns (exp_avg, exp_avg_sq)."""
    exp_avg = lerp(exp_avg, grad, one_minus_beta1)
    exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * grad * grad
    return exp_avg, exp_avg_sq
