"""Adam and AdamW (torch.optim.Adam/AdamW, decoupled_weight_decay, amsgrad, maximize).

Written in torch's operation order (torch/optim/adam.py, ``_single_tensor_adam``) so that
fp32 results agree with torch.optim to rounding: lerp for the first moment (with
torch's two-sided formula), ``v * beta2 + (1 - beta2) * g * g`` for the second, and
``p + (-step_size) * (m / denom)`` as ``addcdiv`` computes it.
"""

import triton.language as tl

from . import Rule, register
from .common import adam_moments, maximize_and_decay


def adam_coefficients(step, lr, beta1, beta2, eps, weight_decay, _h5, _h6, _h7):
    # fp64 scalars, once per step. beta ** step as exp(step * log(beta)): Triton has no
    # scalar pow, and fp64 keeps it within 1e-15 of torch's Python float pow.
    bias_correction1 = 1.0 - tl.exp(step * tl.log(beta1))
    bias_correction2 = 1.0 - tl.exp(step * tl.log(beta2))
    step_size = lr / bias_correction1
    bias_correction2_sqrt = tl.sqrt(bias_correction2)
    decay = 1.0 - lr * weight_decay
    unused = step  # the last two slots (a value of the right kind for the kernel to pass on)
    return (-step_size, bias_correction2_sqrt, 1.0 - beta1, beta2, 1.0 - beta2, eps, decay, weight_decay, unused, unused)


def adam_elementwise(
    param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq,
    neg_step_size, bias_correction2_sqrt, one_minus_beta1, beta2, one_minus_beta2, eps, decay, weight_decay, _c8, _c9,
    DECOUPLED_WEIGHT_DECAY, AMSGRAD, MAXIMIZE, WEIGHT_DECAY,
):  # fmt: skip
    param, grad = maximize_and_decay(param, grad, decay, weight_decay, MAXIMIZE, WEIGHT_DECAY, DECOUPLED_WEIGHT_DECAY)
    exp_avg, exp_avg_sq = adam_moments(exp_avg, exp_avg_sq, grad, one_minus_beta1, beta2, one_minus_beta2)
    if AMSGRAD:
        max_exp_avg_sq = tl.maximum(max_exp_avg_sq, exp_avg_sq, propagate_nan=tl.PropagateNan.ALL)
        denom = tl.div_rn(tl.sqrt_rn(max_exp_avg_sq), bias_correction2_sqrt) + eps
    else:
        denom = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
    param = param + neg_step_size * tl.div_rn(exp_avg, denom)
    return param, exp_avg, exp_avg_sq, max_exp_avg_sq


def _adam_active_states(options):
    decoupled_weight_decay, amsgrad, maximize, weight_decay = options
    return (True, True, bool(amsgrad))


ADAM = register(
    Rule(
        name="adam",
        state_keys=("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
        nonnegative_states=(False, True, True),
        hyperparameters=("lr", "beta1", "beta2", "eps", "weight_decay"),
        options=("decoupled_weight_decay", "amsgrad", "maximize", "weight_decay"),
        coefficients=adam_coefficients,
        elementwise=adam_elementwise,
        active_states=_adam_active_states,
    )
)
