"""The compiled step keeps the order in which forge's recompute pass placed its values.

Inductor's ``reorder_for_peak_memory`` picks among topological orders by an estimate that
counts the unfused updates' never-stored intermediates, and it moves values rebuilt for the
backward back into the forward, where they are alive at the step's peak
(forge_compile.scheduling). forge turns it off for step graphs; ``options=`` turns it on.
"""

import re

import pytest
import torch
from helpers import assert_matches_torch_optim, causal_lm_step, twin
from torch._inductor.utils import run_and_get_code

import forge_compile

transformers = pytest.importorskip("transformers")

VOCAB, TOKENS, LR, STEPS = 2048, 64, 1e-3, 3
_ALLOCATION = re.compile(r"^\s*(buf\w+) = empty_strided_\w+\(\(([^)]*)\), \(([^)]*)\), torch\.(\w+)\)")
_REUSE = re.compile(r"^\s*(buf\w+) = (?:reinterpret_tensor\()?(buf\w+)\b.*; del (buf\w+)\s+# reuse")
_DELETION = re.compile(r"^\s*del (buf\w+)\s*$")


def wrapper_peak_bytes(code: str) -> int:
    """The most bytes the generated wrapper's own buffers hold at once: each from its
    ``empty_strided`` to its ``del``, carried over where a buffer is reused under a new name."""
    body = code[code.index("def call(self, args):"):]
    alive: dict[str, int] = {}
    current = peak = 0
    for line in body.splitlines():
        if match := _ALLOCATION.match(line):
            name, shape, stride, dtype = match.groups()
            sizes = [int(s) for s in shape.split(",") if s.strip()]
            strides = [int(s) for s in stride.split(",") if s.strip()]
            elements = 1 + sum((size - 1) * step for size, step in zip(sizes, strides)) if sizes else 1
            alive[name] = elements * getattr(torch, dtype).itemsize
            current += alive[name]
            peak = max(peak, current)
        elif match := _REUSE.match(line):
            new, old, _ = match.groups()
            if old in alive:
                alive[new] = alive.pop(old)
        elif (match := _DELETION.match(line)) and match.group(1) in alive:
            current -= alive.pop(match.group(1))
    return peak


def _train(options):
    """(the step's generated code, the model after STEPS compiled steps, the eager twin
    after as many torch.optim.AdamW steps)."""
    torch.manual_seed(0)
    # Grouped-query attention (4 heads, 1 key/value head) and a SiLU-gated MLP: the values
    # the recompute pass rebuilds include the key and value repeated to every head.
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                                      attn_implementation="sdpa", use_cache=False)  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    reference = twin(model)
    optimizer = forge_compile.optim.AdamW(model.parameters(), lr=LR)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)

    tokens = torch.randint(0, VOCAB, (1, TOKENS))
    step = torch.compile(lambda t: causal_lm_step(model, optimizer, t), backend="forge", options=options)
    _, codes = run_and_get_code(step, tokens)
    causal_lm_step(reference, reference_optimizer, tokens)
    for _ in range(STEPS - 1):
        step(tokens)
        causal_lm_step(reference, reference_optimizer, tokens)
    assert len(codes) == 1
    return codes[0], model, reference


def test_the_step_keeps_the_recompute_order_and_options_can_turn_the_reordering_on(no_inductor_cache, monkeypatch):
    # Measured with the head loss unchunked: chunked (head_loss.py), the logits are not
    # among the values the reordering moves, and the two peaks are 0.54 and 0.56 MB.
    monkeypatch.setattr(forge_compile.config, "chunk_head_loss", False)
    forge_code, model, reference = _train(options=None)
    assert_matches_torch_optim(model, reference, lr=LR, steps=STEPS)
    reordered_code, model, reference = _train(options={"reorder_for_peak_memory": True})
    assert_matches_torch_optim(model, reference, lr=LR, steps=STEPS)
    # With Inductor's reordering (before forge_compile.scheduling turned it off) the rebuilt
    # values run in the forward again: 1.04 MB at the peak against 0.92 MB on torch 2.13.
    assert wrapper_peak_bytes(forge_code) < 0.95 * wrapper_peak_bytes(reordered_code)
