"""RAdam with its variance rectification, L2 or decoupled weight decay (torch.optim.RAdam).

Whether a step is rectified (``rho_t > 5``, first true at step 6 for beta2 = 0.999)
depends only on the step count, so it is a per-step scalar: the rectification factor,
0 where the step is not rectified. Both branches are one formula chosen per step, so
the flip at step 6 does not recompile.
"""

import triton.language as tl

from . import Rule, register
from .common import adam_moments, maximize_and_decay


def radam_coefficients(step, lr, beta1, beta2, eps, weight_decay, _h5, _h6, _h7):
    beta2_power = tl.exp(step * tl.log(beta2))
    bias_correction1 = 1.0 - tl.exp(step * tl.log(beta1))
    bias_correction2 = 1.0 - beta2_power
    rho_inf = 2.0 / (1.0 - beta2) - 1.0
    rho_t = rho_inf - 2.0 * step * beta2_power / bias_correction2
    rectified = rho_t > 5.0
    # Where not rectified the square root's argument may be negative: use 1 there, then 0.
    rect_argument = (rho_t - 4.0) * (rho_t - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t)
    rect_argument = tl.where(rectified, rect_argument, 1.0)
    rectification = tl.where(rectified, tl.sqrt(rect_argument), 0.0)
    decay = 1.0 - lr * weight_decay
    return (bias_correction1, lr, tl.sqrt(bias_correction2), rectification, 1.0 - beta1, beta2, 1.0 - beta2, eps, decay,
            weight_decay)  # fmt: skip


def radam_elementwise(
    param, grad, exp_avg, exp_avg_sq, _s2,
    bias_correction1, lr, bias_correction2_sqrt, rectification, one_minus_beta1, beta2, one_minus_beta2, eps, decay,
    weight_decay,
    DECOUPLED_WEIGHT_DECAY, MAXIMIZE, WEIGHT_DECAY, _O3,
):  # fmt: skip
    param, grad = maximize_and_decay(param, grad, decay, weight_decay, MAXIMIZE, WEIGHT_DECAY, DECOUPLED_WEIGHT_DECAY)
    exp_avg, exp_avg_sq = adam_moments(exp_avg, exp_avg_sq, grad, one_minus_beta1, beta2, one_minus_beta2)
    unrectified = tl.div_rn(exp_avg, bias_correction1) * lr
    adaptive_lr = tl.div_rn(bias_correction2_sqrt, tl.sqrt_rn(exp_avg_sq) + eps)
    rectified = unrectified * adaptive_lr * rectification
    param = param - tl.where(rectification > 0.0, rectified, unrectified)
    return param, exp_avg, exp_avg_sq, _s2


RADAM = register(
    Rule(
        name="radam",
        state_keys=("exp_avg", "exp_avg_sq"),
        nonnegative_states=(False, True),
        hyperparameters=("lr", "beta1", "beta2", "eps", "weight_decay"),
        options=("decoupled_weight_decay", "maximize", "weight_decay"),
        coefficients=radam_coefficients,
        elementwise=radam_elementwise,
        active_states=lambda options: (True, True, False),
    )
)
