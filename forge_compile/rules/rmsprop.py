"""RMSprop, plain or centered, with or without momentum (torch.optim.RMSprop).

In torch's operation order (``_single_tensor_rmsprop``): ``square_avg * alpha +
(1 - alpha) * g * g``, the centered variance as ``square_avg - grad_avg * grad_avg``,
``sqrt(.) + eps``, then either ``buf * momentum + g / avg`` or ``p + (-lr) * (g / avg)``.
"""

import triton.language as tl

from . import Rule, register
from .common import lerp, maximize_and_decay


def rmsprop_coefficients(step, lr, alpha, eps, weight_decay, momentum, _h5, _h6, _h7):
    unused = step
    return (-lr, alpha, 1.0 - alpha, eps, weight_decay, momentum, unused, unused, unused, unused)


def rmsprop_elementwise(
    param, grad, square_avg, momentum_buffer, grad_avg,
    neg_lr, alpha, one_minus_alpha, eps, weight_decay, momentum, _c6, _c7, _c8, _c9,
    CENTERED, MOMENTUM, MAXIMIZE, WEIGHT_DECAY,
):  # fmt: skip
    param, grad = maximize_and_decay(param, grad, weight_decay, weight_decay, MAXIMIZE, WEIGHT_DECAY, False)
    square_avg = square_avg * alpha + one_minus_alpha * grad * grad
    if CENTERED:
        grad_avg = lerp(grad_avg, grad, one_minus_alpha)
        avg = tl.sqrt_rn(square_avg - grad_avg * grad_avg) + eps
    else:
        avg = tl.sqrt_rn(square_avg) + eps
    if MOMENTUM:
        momentum_buffer = momentum_buffer * momentum + tl.div_rn(grad, avg)
        param = param + neg_lr * momentum_buffer
    else:
        param = param + neg_lr * tl.div_rn(grad, avg)
    return param, square_avg, momentum_buffer, grad_avg


def _rmsprop_active_states(options):
    centered, momentum, maximize, weight_decay = options
    return (True, bool(momentum), bool(centered))


RMSPROP = register(
    Rule(
        name="rmsprop",
        state_keys=("square_avg", "momentum_buffer", "grad_avg"),
        nonnegative_states=(True, False, False),
        hyperparameters=("lr", "alpha", "eps", "weight_decay", "momentum"),
        options=("centered", "momentum", "maximize", "weight_decay"),
        coefficients=rmsprop_coefficients,
        elementwise=rmsprop_elementwise,
        active_states=_rmsprop_active_states,
    )
)
