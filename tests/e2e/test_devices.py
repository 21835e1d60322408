"""A model on the CPU and one on CUDA in one process, each with its own forge step (GPU only)."""

import pytest
import torch
from helpers import MLP, assert_matches_torch_optim, mse_step, twin

import forge_compile

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cpu_and_cuda_models_in_one_process():
    models = {"cpu": MLP(), "cuda": MLP().cuda()}
    references = {d: twin(m) for d, m in models.items()}
    steps, reference_steps, reports = {}, {}, {}
    for device, model in models.items():
        opt = forge_compile.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        steps[device] = torch.compile(mse_step(model, opt), backend="forge")
        reference_opt = torch.optim.AdamW(references[device].parameters(), lr=1e-2, weight_decay=0.1)
        reference_steps[device] = mse_step(references[device], reference_opt)
    for i in range(4):
        for device in models:
            x, y = torch.randn(4, 5, 12, device=device), torch.randn(4, 5, 6, device=device)
            if i == 0:
                reports[device] = forge_compile.explain(steps[device], x, y)
            else:
                steps[device](x, y)
            reference_steps[device](x, y)
    for device in models:
        assert_matches_torch_optim(models[device], references[device], lr=1e-2, steps=4)
        assert len(reports[device].fused) == 3, (device, str(reports[device]))


def test_hyperparameter_tensor_on_the_cpu_follows_cuda_parameters():
    model = MLP().cuda()
    reference = twin(model)
    lr = torch.tensor(1e-2)  # on the CPU, as schedulers and users often leave it
    step = torch.compile(mse_step(model, forge_compile.optim.AdamW(model.parameters(), lr=lr)), backend="forge")
    reference_step = mse_step(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2))
    for _ in range(3):
        x, y = torch.randn(4, 5, 12, device="cuda"), torch.randn(4, 5, 6, device="cuda")
        step(x, y), reference_step(x, y)
    assert_matches_torch_optim(model, reference, lr=1e-2, steps=3)
