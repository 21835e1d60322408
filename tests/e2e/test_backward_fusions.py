"""Inductor does not fuse forward work with backward work in a compiled step.

The recompute pass rebuilds the key and value repeated to every head right before the
attention backward. Inductor would fuse that rebuild with the forward's kernel that repeats
them for the forward attention (both read the same key and value), so the backward's copies
were computed in the forward and alive at the step's peak (forge_compile.scheduling). The
check runs on Inductor's Triton code, the code a GPU gets, written on the CPU in a child
process without the interpreter; its kernels are generated, not built.
"""

import re
import sys
import unittest.mock

import pytest
import torch
from helpers import (assert_matches_torch_optim, causal_lm_step, last_line_outside_the_interpreter,
                     triton_wrapper_written_for_the_cpu, twin)

import forge_compile
from forge_compile import scheduling

transformers = pytest.importorskip("transformers")

# Eight heads share one key/value head: each repeated copy is eight times the key's size.
VOCAB, TOKENS, HEADS, HEAD_DIM, LR, STEPS = 256, 64, 8, 16, 1e-3, 3
_ALLOCATION = re.compile(r"^\s*(buf\d+) = empty_strided_\w+\(\(([\d, ]+)\), \([\d, ]+\), torch\.(\w+)\)")


def bytes_kept_across_the_loss(code: str) -> int:
    """Bytes of the wrapper's buffers allocated before the loss (forge's chunked head loss,
    or Inductor's kernel of it) and named after it."""
    lines = code[code.index("def call(self, args):"):].splitlines()
    loss = max(i for i, line in enumerate(lines)
               if "torch.ops.forge.linear_cross_entropy.default(" in line
               or ("nll_loss_forward" in line and ".run(" in line))  # fmt: skip
    kept = 0
    for i, line in enumerate(lines[:loss]):
        if match := _ALLOCATION.match(line):
            name, shape, dtype = match.groups()
            named = re.compile(rf"\b{name}\b")
            if any(named.search(later) and not later.lstrip().startswith("#") for later in lines[loss + 1:]):
                sizes = [int(size) for size in shape.split(",") if size.strip()]
                kept += torch.Size(sizes).numel() * getattr(torch, dtype).itemsize
    return kept


def _model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HEADS * HEAD_DIM, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=HEADS, num_key_value_heads=1, tie_word_embeddings=False,
                                      attn_implementation="sdpa", use_cache=False)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _triton_step_code(refuse: bool) -> str:
    """The compiled step's wrapper with Triton kernels for the CPU."""
    model = _model()
    optimizer = forge_compile.optim.AdamW(model.parameters(), lr=LR)
    step = torch.compile(lambda tokens: causal_lm_step(model, optimizer, tokens), backend="forge")
    patches = [] if refuse else [unittest.mock.patch.object(scheduling, "_side_of_the_cut", lambda node: None)]
    return triton_wrapper_written_for_the_cpu(lambda: step(torch.randint(0, VOCAB, (1, TOKENS))), *patches)


def test_the_repeated_key_and_value_are_rebuilt_in_the_backward_in_triton_code():
    forge = int(last_line_outside_the_interpreter(__file__, "triton", "1"))
    fused = int(last_line_outside_the_interpreter(__file__, "triton", "0"))
    # Fused with the forward's kernel, the repeated copies are made before the loss and kept
    # past it: 0.428 against 0.559 MB, on torch 2.13 and 2.11 alike (four 32 KiB copies).
    assert forge + HEADS * TOKENS * HEAD_DIM * 4 <= fused, (forge, fused)


def test_the_step_with_fusions_refused_matches_torch_optim(no_inductor_cache):
    model = _model()
    reference = twin(model)
    optimizer = forge_compile.optim.AdamW(model.parameters(), lr=LR)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    step = torch.compile(lambda tokens: causal_lm_step(model, optimizer, tokens), backend="forge")
    tokens = torch.randint(0, VOCAB, (1, TOKENS))
    for _ in range(STEPS):
        step(tokens)
        causal_lm_step(reference, reference_optimizer, tokens)
    assert_matches_torch_optim(model, reference, lr=LR, steps=STEPS)


if __name__ == "__main__" and sys.argv[1:2] == ["triton"]:
    print(bytes_kept_across_the_loss(_triton_step_code(bool(int(sys.argv[2])))))
