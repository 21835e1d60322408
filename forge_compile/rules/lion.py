"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2).

    update = sign(beta1 * m + (1 - beta1) * g)
    p      = p * (1 - lr * weight_decay) - lr * update
    m      = beta2 * m + (1 - beta2) * g

torch has no Lion; forge's follows the paper with decoupled weight decay. A zero
interpolation has sign 0, so it leaves the weight unchanged (apart from decay).
"""

import triton.language as tl  # noqa: F401  (Triton requires tl in a jit function's globals)

from . import Rule, register
from .common import lerp, maximize_and_decay, sign


def lion_coefficients(step, lr, beta1, beta2, weight_decay, _h4, _h5, _h6, _h7):
    unused = step
    return (-lr, 1.0 - beta1, 1.0 - beta2, 1.0 - lr * weight_decay, unused, unused, unused, unused, unused, unused)


def lion_elementwise(
    param, grad, exp_avg, _s1, _s2,
    neg_lr, one_minus_beta1, one_minus_beta2, decay, _c4, _c5, _c6, _c7, _c8, _c9,
    MAXIMIZE, WEIGHT_DECAY, _O2, _O3,
):  # fmt: skip
    param, grad = maximize_and_decay(param, grad, decay, decay, MAXIMIZE, WEIGHT_DECAY, True)
    param = param + neg_lr * sign(lerp(exp_avg, grad, one_minus_beta1))
    exp_avg = lerp(exp_avg, grad, one_minus_beta2)
    return param, exp_avg, _s1, _s2


LION = register(
    Rule(
        name="lion",
        state_keys=("exp_avg",),
        nonnegative_states=(False,),
        hyperparameters=("lr", "beta1", "beta2", "weight_decay"),
        options=("maximize", "weight_decay"),
        coefficients=lion_coefficients,
        elementwise=lion_elementwise,
        active_states=lambda options: (True,),
    )
)
