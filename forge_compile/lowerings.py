"""Inductor lowerings of forge's element-wise ops.

``forge::round_bfloat16_stochastically`` (an unfused bf16 update's last step) lowers to
one point-wise body that runs the storage helpers' text in the Inductor dialect
(:mod:`forge_compile.rules.inductor_dialect`): the rounded value, the element index and
the parameter's key are each loaded or computed once per element. Inductor fuses that
body into the update's kernel as it would any point-wise op, so the updated weight is
still read and written once.

The body also computes the key from the seed and the step (a dozen integer operations
on two scalars) where the aten form stored it in a kernel of its own per parameter.
"""

from __future__ import annotations

import torch

from . import ops as forge_ops  # noqa: F401  (defines torch.ops.forge.round_bfloat16_stochastically)
from .rules import in_dialect, inductor_dialect, storage

_round = in_dialect(storage.round_bfloat16_stochastically, inductor_dialect)
_rounding_key = in_dialect(storage.rounding_key, inductor_dialect)


def _register() -> None:
    from torch._inductor import ir
    from torch._inductor.lowering import fallback_handler, register_lowering
    from torch._inductor.virtualized import ops

    op = torch.ops.forge.round_bfloat16_stochastically.default
    fallback = fallback_handler(op, add_to_fallback_set=False)

    @register_lowering(op, type_promotion_kind=None)
    def round_bfloat16_stochastically(rows, step, seed, first_row):
        device = rows.get_device()
        if step.get_device() != device or seed.get_device() != device:  # e.g. a step count kept on the CPU
            return fallback(rows, step, seed, first_row)
        load_rows, load_step, load_seed = rows.make_loader(), step.make_loader(), seed.make_loader()
        columns = rows.get_size()[1]
        step_dtype, seed_dtype = step.get_dtype(), seed.get_dtype()
        Value = inductor_dialect.Value

        # Only the element index's low 32 bits reach the hash (storage.round_bfloat16_stochastically
        # masks them), so the rows' offset goes in as its low 32 bits, read as a signed int32.
        # Inductor 2.11 prints an int64 index expression in the kernel's index dtype, int32 for
        # a tensor under 2**31 elements, and Triton rejects a constant outside int32 there
        # ("Scalar 2348810240 is out of range for type int32" on an H100 for a block 2**25 rows
        # in); the sum then wraps modulo 2**32 in int32 and is exact in int64, the same low bits.
        try:
            offset = (first_row * int(columns)) % 2**32
            offset -= 2**32 if offset >= 2**31 else 0
        except TypeError:  # a symbolic width: the offset stays an expression
            offset = first_row * columns

        def body(index):
            row, column = index
            element = ops.index_expr(offset + row * columns + column, torch.int64)
            seed_value = Value(load_seed([0] * len(seed.get_size())), seed_dtype).to(torch.int64)
            key = _rounding_key(seed_value, Value(load_step([0] * len(step.get_size())), step_dtype))
            return _round(Value(load_rows(index), torch.float32), Value(element, torch.int64), key).value

        return ir.Pointwise.create(device=device, dtype=torch.float32, inner_fn=body, ranges=list(rows.get_size()))


_register()
