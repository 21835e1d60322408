"""An embedding's gradient by its summed rows (forge_compile/decompositions.py): the same
values as torch's dense gradient, and in a compiled step no dense gradient buffer."""

import re

import pytest
import torch
from helpers import assert_matches_torch_optim, twin
from torch import nn
from torch._decomp.decompositions import embedding_dense_backward as torch_embedding_dense_backward

import forge_compile
from forge_compile.decompositions import embedding_dense_backward_by_rows

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding_idx", [-1, 3])
@pytest.mark.parametrize("index_shape", [(29,), (3, 11), (0,)])
def test_rows_give_torch_decompositions_gradient(device, dtype, padding_idx, index_shape):
    generator = torch.Generator().manual_seed(0)
    vocabulary, width = 40, 6
    # Few distinct rows, so most are read by several tokens; row 3 (padding) among them; rows never
    # read too. Row 20 is read by the first token alone, so slot 0 is a live slot: padding that
    # added into it (instead of the spare slot) would show.
    indices = torch.randint(0, 9, index_shape, generator=generator)
    if indices.numel():
        indices.view(-1)[:4] = torch.tensor([20, 3, 3, 8])
    grad_output = torch.randn(*index_shape, width, generator=generator).to(device, dtype)
    indices = indices.to(device)
    ours = embedding_dense_backward_by_rows(grad_output, indices, vocabulary, padding_idx, False)
    stock = torch_embedding_dense_backward(grad_output, indices, vocabulary, padding_idx, False)
    assert ours.dtype == stock.dtype == dtype and ours.shape == (vocabulary, width)
    # The same fp32 sums of the same rows, cast once; on the CPU in the same (token) order.
    if device == "cpu":
        assert torch.equal(ours, stock)
    else:
        torch.testing.assert_close(ours, stock, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)
    if not indices.numel():
        assert not ours.any()
        return
    if padding_idx == 3:
        assert not ours[3].any(), "the padding row must get no gradient"
    assert ours[3].any() or padding_idx == 3, "row 3 is read, so it must have a gradient when it is not padding"
    torch.testing.assert_close(ours[20], grad_output.reshape(-1, width)[0])  # its one token's row


def test_gradient_scaled_by_frequency_is_torchs():
    indices = torch.tensor([[1, 1, 2], [5, 1, 2]])
    grad_output = torch.randn(2, 3, 4)
    ours = embedding_dense_backward_by_rows(grad_output, indices, 7, -1, True)
    torch.testing.assert_close(ours, torch.ops.aten.embedding_dense_backward(grad_output, indices, 7, -1, True))


class _TokenModel(nn.Module):
    def __init__(self, vocabulary, width):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width, padding_idx=0)
        self.head = nn.Linear(width, vocabulary, bias=False)

    def forward(self, tokens):
        logits = self.head(torch.tanh(self.embedding(tokens)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, dims=1).flatten())


def _step(model, optimizer, between=None):
    def train_step(tokens):
        loss = model(tokens)
        loss.backward()
        if between is not None:
            between(model)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return train_step


_ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("between,dynamic,dtype,device", [
    (None, False, torch.float32, "cpu"), (None, True, torch.float32, "cpu"),
    ("clip_grad_norm", False, torch.float32, "cpu"), (None, False, torch.bfloat16, "cpu"),
    pytest.param(None, False, torch.bfloat16, "cuda", marks=_ON_CUDA),
], ids=["update", "dynamic-length", "clip_grad_norm", "bf16", "bf16-cuda"])  # fmt: skip
def test_compiled_step_updates_the_embedding_from_its_rows_as_torch_optim(between, dynamic, dtype, device):
    """bf16 weights (rounded to nearest, as torch does) against torch.optim on an fp32 twin:
    within a few bf16 steps of it, and the generated code stores no [vocabulary, width]
    gradient of any dtype."""
    from torch._inductor.utils import run_and_get_code

    vocabulary, width, lr, steps = 97, 24, 1e-2, 4
    torch.manual_seed(0)
    model = _TokenModel(vocabulary, width).to(device)
    reference = twin(model)
    model.to(dtype)
    clip = (lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)) if between else None
    optimizer = forge_compile.optim.AdamW(model.parameters(), lr=lr, stochastic_rounding=False)
    step = torch.compile(_step(model, optimizer, clip), backend="forge", dynamic=dynamic)
    reference_step = _step(reference, torch.optim.AdamW(reference.parameters(), lr=lr), clip)
    generator = torch.Generator().manual_seed(1)
    for i in range(steps):
        length = 9 - 2 * (i % 2) if dynamic else 9  # one graph for every length: the token count is a symbol
        tokens = torch.randint(0, 30, (4, length), generator=generator)  # rows 30-96 never read: decay only
        tokens[0, 0] = 50  # a row read by the first token alone: its slot is slot 0
        tokens[0, 1:3] = 0  # padding
        tokens[1, :4] = 11  # one row read four times
        tokens = tokens.to(device)
        if i == 0:
            _, code = run_and_get_code(step, tokens)
            source = "\n".join(code)
        else:
            step(tokens)
        reference_step(tokens)
    if dtype == torch.float32:
        assert_matches_torch_optim(model, reference, lr=lr, steps=steps)
    else:  # bf16 holds a weight near 1 to 2**-8: a few such roundings apart at most
        assert_matches_torch_optim(model, reference, lr=lr, steps=steps, atol=2e-2)
    dense = re.findall(rf"empty_strided_\w+\(\({vocabulary}, {width}\), \({width}, 1\), torch\.\w+\)", source)
    reason = {d.name: d.reason for d in forge_compile.explain(step, tokens).rejected}["model.embedding.weight"]
    if between is None:
        assert not dense, f"the embedding's dense gradient was stored ({dense}); it should fuse into the update"
        assert "embedding" in reason, reason  # explain names the op the gather came from
    else:  # the norm reads the gradient too: stored (in the weight's dtype), and the clip is the reason given
        assert "clip_grad_norm_" in reason, reason


def test_a_step_without_tokens_compiles_and_decays_the_embedding_as_torch_optim():
    """No token reads any row: every gradient row is zero and AdamW only decays the weight."""
    torch.manual_seed(0)
    model = nn.Embedding(10, 4)
    reference, start = twin(model), model.weight.detach().clone()

    def loss_of(embedding, tokens):
        return embedding(tokens).sum()

    step = torch.compile(_step(lambda t: loss_of(model, t), forge_compile.optim.AdamW(model.parameters(), lr=0.1)),
                         backend="forge")  # fmt: skip
    reference_step = _step(lambda t: loss_of(reference, t), torch.optim.AdamW(reference.parameters(), lr=0.1))
    empty = torch.zeros(2, 0, dtype=torch.long)
    for _ in range(2):
        step(empty)
        reference_step(empty)
    torch.testing.assert_close(model.weight, reference.weight)
    assert not torch.equal(model.weight, start), "weight decay should have moved the weight"
