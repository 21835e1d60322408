"""The ``tl`` names that the stochastic-rounding helpers use, on Inductor's ``ops``.

:mod:`forge_compile.rules.storage` hashes each element's index into random bits with a
dozen integer operations, each reading its operand twice (``x ^ (x >> 16)``). Written
as aten ops, every such line is an Inductor IR node, and Inductor evaluates an inlined
node's body once per read: the rounded value was rebuilt 3 times and the index 16 times
for each element, in every pass Inductor makes over the body (2-layer Qwen3 on a 2-core
CPU: 62,741 IR body evaluations against 20,506 without rounding, and a first step of
50.9 s against 41.4 s). Binding ``tl`` to this module runs the same helper text inside
one lowering's body (:mod:`forge_compile.lowerings`), where a value read twice is one
Python object: each operation is emitted once.

Values are :class:`Value`, an ``ops`` value with its dtype. Like the torch dialect,
32-bit unsigned integers are held in int64 and every helper masks its results to 32
bits, so both dialects compute the same bits as the Triton kernel.
"""

from __future__ import annotations

import torch
from torch._inductor.virtualized import ops

float32 = torch.float32
uint32 = torch.int64
_LOW_32 = 0xFFFFFFFF


class Value:
    """An ``ops`` value (what a loader or an ``ops`` call returns) and its dtype, with the
    operators the storage helpers apply to integers."""

    __hash__ = None

    def __init__(self, value, dtype: torch.dtype):
        self.value = value
        self.dtype = dtype

    def _operand(self, other) -> Value:
        return other if isinstance(other, Value) else Value(ops.constant(other, self.dtype), self.dtype)

    def _binary(self, other, op) -> Value:
        return Value(op(self.value, self._operand(other).value), self.dtype)

    def __xor__(self, other):
        return self._binary(other, ops.bitwise_xor)

    def __and__(self, other):
        return self._binary(other, ops.bitwise_and)

    def __rshift__(self, other):
        return self._binary(other, ops.bitwise_right_shift)

    def __lshift__(self, other):
        return self._binary(other, ops.bitwise_left_shift)

    def __add__(self, other):
        return self._binary(other, ops.add)

    def __sub__(self, other):
        return self._binary(other, ops.sub)

    def __mul__(self, other):
        return self._binary(other, ops.mul)

    def __ne__(self, other):
        return Value(ops.ne(self.value, self._operand(other).value), torch.bool)

    def to(self, dtype: torch.dtype) -> Value:
        if dtype == self.dtype:
            return self
        return Value(ops.to_dtype(self.value, dtype, src_dtype=self.dtype), dtype)


def cast(x: Value, dtype: torch.dtype, bitcast: bool = False) -> Value:
    if not bitcast:
        return x.to(dtype)
    if x.dtype == torch.float32 and dtype == uint32:
        signed = Value(ops.to_dtype_bitcast(x.value, torch.int32, torch.float32), torch.int32)
        return signed.to(torch.int64) & _LOW_32
    if x.dtype == torch.int64 and dtype == torch.float32:
        low = x & _LOW_32
        signed = (low - ((low & 0x80000000) << 1)).to(torch.int32)
        return Value(ops.to_dtype_bitcast(signed.value, torch.float32, torch.int32), torch.float32)
    raise TypeError(f"forge: the Inductor dialect bitcasts fp32 <-> uint32 only, not {x.dtype} -> {dtype}")


def where(condition: Value, x: Value, y: Value) -> Value:
    return Value(ops.where(condition.value, x.value, y.value), x.dtype)
