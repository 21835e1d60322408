"""forge under torch's parallelism, two CPU ranks over gloo, against one process.

* Tensor + sequence parallelism (DTensor parameters): each rank's column- and row-parallel
  weight shard gets its complete local gradient, so its update fuses on the shard; a
  weight replicated over the mesh while the activations are sequence-sharded gets a
  Partial gradient that must be all-reduced first: unfused, ``reduced_across_ranks``.
* DDP and FSDP2 reduce every gradient in backward hooks: nothing fuses, explain says why
  and names the weights, and the step is torch's.

Every case trains the same model as a single process does with torch's AdamW on the
whole batch, and must end at the same weights. Each rank runs in its own process
(torch.multiprocessing, spawn) and sends its results back through a file.
"""

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

WORLD = 2
STEPS = 4  # the first through forge_compile.explain
HIDDEN, TOKENS = 16, 4
LR = 1e-2


class Block(nn.Module):
    """An RMSNorm, an MLP (column- then row-parallel under TP) and a sigmoid gate whose
    weight stays replicated over the tensor-parallel mesh."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN)
        self.gate = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return self.down(torch.relu(self.up(h))) * torch.sigmoid(self.gate(h))


def _model() -> Block:
    torch.manual_seed(0)
    return Block()


def _batch() -> torch.Tensor:
    return torch.randn(2, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))


def _reference() -> dict[str, torch.Tensor]:
    """One process, the whole batch, torch's AdamW."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for _ in range(STEPS):
        model(_batch()).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach() for name, p in model.named_parameters()}


def _train_step(model, optimizer):
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def _prepare(kind: str):
    """The model, optimizer and this rank's input for one parallelism."""
    import forge_compile
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    x = _batch()
    if kind == "tensor_parallel":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (WORLD,))
        plan = {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        }
        parallelize_module(model, mesh, plan)
        model.gate.weight = nn.Parameter(distribute_tensor(model.gate.weight.detach(), mesh, [Replicate()]))
        x = distribute_tensor(x, mesh, [Replicate()]).redistribute(mesh, [Shard(1)])  # sequence-sharded
    elif kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        x = x.chunk(world)[rank]
    elif kind == "tensor_parallel_inside_fsdp":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("data", "tensor"))
        parallelize_module(model, mesh["tensor"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["data"])
        x = x.chunk(world // 2)[mesh.get_coordinate()[0]]
    elif kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in (model.gate, model.up, model.down):
            fully_shard(layer)
        fully_shard(model)
        x = x.chunk(world)[rank]
    optimizer = forge_compile.optim.AdamW(model.parameters(), lr=LR)
    return model, optimizer, x


def _partial_gradient_reduced() -> bool:
    """forge's shard view (dtensor.local_shards, what the traced step calls) given a
    gradient still Partial over the mesh (DTensor's own backward reduces it before, so the
    models above never give one) sums it over the ranks, as the parameter's Replicate
    layout requires."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from forge_compile import dtensor

    mesh = init_device_mesh("cpu", (WORLD,))
    rank = dist.get_rank()
    param = DTensor.from_local(torch.zeros(3), mesh, [Replicate()])
    grad = DTensor.from_local(torch.full((3,), float(rank + 1)), mesh, [Partial()])
    _, local_grad, _ = dtensor.local_shards(param, grad, [])
    return torch.equal(local_grad, torch.full((3,), float(sum(range(1, WORLD + 1)))))


def _worker(rank: int, kind: str, port: int, out_dir: str, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import forge_compile

        from forge_compile import dtensor

        model, optimizer, x = _prepare(kind)
        step = torch.compile(_train_step(model, optimizer), backend="forge")
        report = forge_compile.explain(step, x)
        for _ in range(STEPS - 1):
            step(x)
        weights = {}
        for name, p in model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p  # a collective: every rank calls it
            weights[name.removeprefix("module.")] = full.detach().tolist()
        result = {
            "partial_gradient_reduced": _partial_gradient_reduced() if kind == "tensor_parallel" else None,
            "shard_seed": dtensor.shard_seed(model.up.weight, 1234) if kind == "tensor_parallel" else None,
            "fused": sorted(_short(d.name) for d in report.fused),
            "rejected": {_short(d.name): d.code for d in report.rejected},
            "notes": report.notes,
            "weights": weights,
        }
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _short(name: str) -> str:
    """``model.up.weight`` (the step's closure) or ``module.up.weight`` (DDP's wrapper) -> ``up.weight``."""
    return name.removeprefix("model.").removeprefix("module.")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(kind: str, tmp_path, world: int = WORLD) -> list[dict]:
    # The ranks import this file by its module name; spawn passes sys.path on.
    mp.spawn(_worker, args=(kind, _free_port(), str(tmp_path), world), nprocs=world, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _assert_weights_match_reference(results: list[dict]) -> None:
    reference = _reference()
    for result in results:
        for name, expected in reference.items():
            torch.testing.assert_close(torch.tensor(result["weights"][name]), expected, atol=2e-6, rtol=1e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip


def test_tensor_and_sequence_parallel_shards_fuse_and_match_one_process(tmp_path):
    results = _run("tensor_parallel", tmp_path)
    # stochastic rounding draws different bits on each rank's shard of a weight
    assert len({result["shard_seed"] for result in results}) == WORLD
    for result in results:
        assert result["partial_gradient_reduced"]
        assert result["fused"] == ["down.weight", "up.weight"], result
        assert result["rejected"]["gate.weight"] == "reduced_across_ranks", result
    _assert_weights_match_reference(results)


@pytest.mark.parametrize("kind,wrapper", [("ddp", "DistributedDataParallel"), ("fsdp", "FSDP (fully_shard)")])
def test_data_parallel_gradients_stay_unfused_and_match_one_process(kind, wrapper, tmp_path):
    results = _run(kind, tmp_path)
    for result in results:
        assert result["fused"] == [], result
        weights = {"gate.weight", "up.weight", "down.weight"}
        assert {name: result["rejected"].get(name) for name in weights} == dict.fromkeys(weights, "reduced_across_ranks")
        note = next((n for n in result["notes"] if n.startswith(wrapper)), None)
        assert note is not None and "reduced_across_ranks" in note, result["notes"]
        assert "up.weight" in note and "down.weight" in note and "gate.weight" in note, note
    _assert_weights_match_reference(results)




def test_tensor_parallel_inside_fsdp_fuses_nothing_fsdp_reduces(tmp_path):
    """A 2-D mesh, 2 x 2 ranks: TP inside, FSDP across. FSDP reduce-scatters every gradient
    across the data dimension in its hooks, so no update fuses; the step is still exact."""
    results = _run("tensor_parallel_inside_fsdp", tmp_path, world=4)
    for result in results:
        assert result["fused"] == [], result
        assert any(n.startswith("FSDP (fully_shard)") for n in result["notes"]), result["notes"]
    _assert_weights_match_reference(results)
