"""NAdam with momentum decay, L2 or decoupled weight decay (torch.optim.NAdam).

The momentum schedule ``mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))`` and
its running product ``mu_product`` are per-step scalars. The product is state
(``state["mu_product"]``, a 0-d tensor as in torch): ``advance`` multiplies it by
``mu_t`` once per step, before the update reads it, as torch's ``mu_product *= mu``.
"""

import triton
import triton.language as tl

from . import Rule, register
from .common import adam_moments, maximize_and_decay


@triton.jit
def nadam_momentum(step, beta1, momentum_decay):
    # 0.96 ** x as exp(x * ln 0.96): Triton has no scalar pow; -0.0408... is math.log(0.96).
    return beta1 * (1.0 - 0.5 * tl.exp(step * momentum_decay * -0.040821994520255166))


def nadam_advance(step, lr, beta1, beta2, eps, weight_decay, momentum_decay, mu_product):
    return (mu_product * nadam_momentum(step, beta1, momentum_decay),)


def nadam_coefficients(step, lr, beta1, beta2, eps, weight_decay, momentum_decay, mu_product, _h7):
    # mu_product is this step's (already advanced) product, as torch reads it.
    bias_correction2 = 1.0 - tl.exp(step * tl.log(beta2))
    mu = nadam_momentum(step, beta1, momentum_decay)
    mu_next = nadam_momentum(step + 1.0, beta1, momentum_decay)
    mu_product_next = mu_product * mu_next
    grad_weight = -lr * (1.0 - mu) / (1.0 - mu_product)
    exp_avg_weight = -lr * mu_next / (1.0 - mu_product_next)
    decay = 1.0 - lr * weight_decay
    return (grad_weight, exp_avg_weight, 1.0 - beta1, beta2, 1.0 - beta2, bias_correction2, eps, decay, weight_decay,
            step)  # fmt: skip


def nadam_elementwise(
    param, grad, exp_avg, exp_avg_sq, _s2,
    grad_weight, exp_avg_weight, one_minus_beta1, beta2, one_minus_beta2, bias_correction2, eps, decay, weight_decay,
    _c9,
    DECOUPLED_WEIGHT_DECAY, MAXIMIZE, WEIGHT_DECAY, _O3,
):  # fmt: skip
    param, grad = maximize_and_decay(param, grad, decay, weight_decay, MAXIMIZE, WEIGHT_DECAY, DECOUPLED_WEIGHT_DECAY)
    exp_avg, exp_avg_sq = adam_moments(exp_avg, exp_avg_sq, grad, one_minus_beta1, beta2, one_minus_beta2)
    denom = tl.sqrt_rn(tl.div_rn(exp_avg_sq, bias_correction2)) + eps
    param = param + grad_weight * tl.div_rn(grad, denom)
    param = param + exp_avg_weight * tl.div_rn(exp_avg, denom)
    return param, exp_avg, exp_avg_sq, _s2


NADAM = register(
    Rule(
        name="nadam",
        state_keys=("exp_avg", "exp_avg_sq"),
        nonnegative_states=(False, True),
        hyperparameters=("lr", "beta1", "beta2", "eps", "weight_decay", "momentum_decay"),
        options=("decoupled_weight_decay", "maximize", "weight_decay"),
        coefficients=nadam_coefficients,
        elementwise=nadam_elementwise,
        active_states=lambda options: (True, True),
        scalar_states=("mu_product",),
        scalar_initial_values=(1.0,),
        advance=nadam_advance,
    )
)
