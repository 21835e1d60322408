"""A small HF Llama's training steps with forge, for ``python -m forge_compile memory``.

    python -m forge_compile memory --output benchmarks/results/memory_hf_llama.png benchmarks/memory_llama.py
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import forge_compile

torch.manual_seed(0)
config = LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                     num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False)  # fmt: skip
model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
optimizer = forge_compile.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)


def train_step(input_ids):
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


step = torch.compile(train_step, backend="forge")
for _ in range(3):
    step(torch.randint(0, config.vocab_size, (2, 512), device="cuda"))
torch.cuda.synchronize()
