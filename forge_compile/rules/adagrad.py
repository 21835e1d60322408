"""Adagrad with learning-rate decay (torch.optim.Adagrad).

The decayed rate ``lr / (1 + (step - 1) * lr_decay)`` is a per-step scalar; the sum
starts at ``initial_accumulator_value``, which the optimizer fills in when it creates
the state.
"""

import triton.language as tl

from . import Rule, register
from .common import maximize_and_decay


def adagrad_coefficients(step, lr, lr_decay, weight_decay, eps, _h4, _h5, _h6, _h7):
    decayed_lr = lr / (1.0 + (step - 1.0) * lr_decay)
    unused = step
    return (-decayed_lr, weight_decay, eps, unused, unused, unused, unused, unused, unused, unused)


def adagrad_elementwise(
    param, grad, state_sum, _s1, _s2,
    neg_decayed_lr, weight_decay, eps, _c3, _c4, _c5, _c6, _c7, _c8, _c9,
    MAXIMIZE, WEIGHT_DECAY, _O2, _O3,
):  # fmt: skip
    param, grad = maximize_and_decay(param, grad, weight_decay, weight_decay, MAXIMIZE, WEIGHT_DECAY, False)
    state_sum = state_sum + grad * grad
    std = tl.sqrt_rn(state_sum) + eps
    param = param + neg_decayed_lr * tl.div_rn(grad, std)
    return param, state_sum, _s1, _s2


ADAGRAD = register(
    Rule(
        name="adagrad",
        state_keys=("sum",),
        nonnegative_states=(True,),
        hyperparameters=("lr", "lr_decay", "weight_decay", "eps"),
        options=("maximize", "weight_decay"),
        coefficients=adagrad_coefficients,
        elementwise=adagrad_elementwise,
        active_states=lambda options: (True,),
    )
)
