"""SGD with momentum, dampening and Nesterov (torch.optim.SGD).

torch's first step with momentum starts the buffer as a copy of the gradient, later
steps as ``buf * momentum + (1 - dampening) * grad``. forge's buffer exists (zeros)
from the start, so the first step is the same formula with ``momentum`` and
``dampening`` replaced by 0: ``0 * 0 + 1 * grad`` is exactly the gradient. The step
count that tells the first step apart is per-step scalar math, so it never recompiles.
"""

import triton.language as tl

from . import Rule, register
from .common import maximize_and_decay


def sgd_coefficients(step, lr, momentum, dampening, weight_decay, _h4, _h5, _h6, _h7):
    first = (step == 1.0).to(tl.float64)
    buffer_decay = momentum * (1.0 - first)
    gradient_weight = (1.0 - dampening) * (1.0 - first) + first
    unused = step
    return (-lr, momentum, buffer_decay, gradient_weight, weight_decay, unused, unused, unused, unused, unused)


def sgd_elementwise(
    param, grad, momentum_buffer, _s1, _s2,
    neg_lr, momentum, buffer_decay, gradient_weight, weight_decay, _c5, _c6, _c7, _c8, _c9,
    MOMENTUM, NESTEROV, MAXIMIZE, WEIGHT_DECAY,
):  # fmt: skip
    param, grad = maximize_and_decay(param, grad, weight_decay, weight_decay, MAXIMIZE, WEIGHT_DECAY, False)
    if MOMENTUM:
        momentum_buffer = momentum_buffer * buffer_decay + gradient_weight * grad
        if NESTEROV:
            grad = grad + momentum * momentum_buffer
        else:
            grad = momentum_buffer
    param = param + neg_lr * grad
    return param, momentum_buffer, _s1, _s2


def _sgd_active_states(options):
    momentum, nesterov, maximize, weight_decay = options
    return (bool(momentum),)


SGD = register(
    Rule(
        name="sgd",
        state_keys=("momentum_buffer",),
        nonnegative_states=(False,),
        hyperparameters=("lr", "momentum", "dampening", "weight_decay"),
        options=("momentum", "nesterov", "maximize", "weight_decay"),
        coefficients=sgd_coefficients,
        elementwise=sgd_elementwise,
        active_states=_sgd_active_states,
    )
)
