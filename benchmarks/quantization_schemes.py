"""Which 8-bit code for Adam's moments? Measured on the moments of a real training run.

Trains a small byte-level Llama (benchmarks/convergence.py's model and corpus) with fp32
AdamW, then quantizes every weight's ``exp_avg`` and ``exp_avg_sq`` in blocks of 64
along the rows with each code and measures what the step would see:

* ``linear``: ``round(127 * x / absmax)`` (signed), ``round(255 * v / absmax)`` (unsigned);
* ``dynamic``: the signed and unsigned dynamic tree codes of 8-bit optimizers (Dettmers et
  al., 2022: an exponent run, an indicator bit, a linear fraction), nearest level;
* ``sqrt`` (forge's, :mod:`forge_compile.rules.storage`): ``sign(m) sqrt(|m| / absmax)``
  and ``(v / absmax) ** (1/4)`` on 127 and 255 levels, decoded without a table.

For each: relative L2 error of m, of sqrt(v) and of the Adam direction
``m / (sqrt(v) + eps)``, and the share of elements whose v decodes to zero while m does
not (an update of m / eps).

    PYTHONPATH=. python benchmarks/quantization_schemes.py      # CPU is enough (~2 minutes)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import convergence  # noqa: E402
from benchmarks.utils import causal_lm_train_step, write_result  # noqa: E402
from forge_compile import ops  # noqa: E402

EPS = 1e-8


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 levels of the dynamic tree code in [-1, 1] (signed) or [0, 1]."""
    exponent_bits, non_sign_bits = 7, 7
    levels = []
    for i in range(exponent_bits):
        items = 2 ** (i + non_sign_bits - exponent_bits) + 1 if signed else 2 ** (i + non_sign_bits - exponent_bits + 1) + 1
        boundaries = torch.linspace(0.1, 1, items, dtype=torch.float64)
        means = (boundaries[:-1] + boundaries[1:]) / 2
        scale = 10.0 ** (-(exponent_bits - 1) + i)
        levels += (scale * means).tolist()
        if signed:
            levels += (-scale * means).tolist()
    levels += [0.0, 1.0]
    levels += [0.0] * (256 - len(levels))
    return torch.tensor(sorted(levels), dtype=torch.float64)


def _blocks(x: torch.Tensor):
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x.double(), (0, -cols % 64)).reshape(rows, -1, 64)
    absmax = padded.abs().amax(dim=2, keepdim=True)
    return padded, torch.where(absmax > 0, absmax, torch.ones_like(absmax)), cols


def _unblock(blocks: torch.Tensor, cols: int) -> torch.Tensor:
    return blocks.reshape(blocks.shape[0], -1)[:, :cols]


def round_trip(x: torch.Tensor, scheme: str, signed: bool) -> torch.Tensor:
    if scheme == "sqrt":
        codes, scales = ops.quantize_state(x.float(), signed)
        return ops.dequantize_state(codes, scales, signed).double()
    blocks, absmax, cols = _blocks(x)
    unit = blocks / absmax
    if scheme == "linear":
        levels = 127 if signed else 255
        decoded = torch.round(unit * levels) / levels
    else:
        table = dynamic_map(signed)
        upper = torch.searchsorted(table, unit.clamp(table[0], table[-1]).contiguous()).clamp(1, 255)
        lower = upper - 1
        nearer_upper = (table[upper] - unit).abs() < (unit - table[lower]).abs()
        decoded = torch.where(nearer_upper, table[upper], table[lower])
    return _unblock(decoded * absmax, cols)


def measure(moments: list[tuple[torch.Tensor, torch.Tensor]], scheme: str) -> dict:
    sums = dict(m=[0.0, 0.0], root=[0.0, 0.0], direction=[0.0, 0.0])
    zero_denominators = elements = 0
    for m, v in moments:
        m, v = m.double(), v.double()
        m_q, v_q = round_trip(m, scheme, True), round_trip(v, scheme, False).clamp_min(0)
        direction = m / (v.sqrt() + EPS)
        direction_q = m_q / (v_q.sqrt() + EPS)
        for key, exact, approx in (("m", m, m_q), ("root", v.sqrt(), v_q.sqrt()), ("direction", direction, direction_q)):
            sums[key][0] += float((approx - exact).pow(2).sum())
            sums[key][1] += float(exact.pow(2).sum())
        zero_denominators += int(((v_q == 0) & (v > 0) & (m_q != 0)).sum())
        elements += m.numel()
    result = {f"relative_l2_{key}": (err / ref) ** 0.5 for key, (err, ref) in sums.items()}
    result["share_of_m_over_eps_updates"] = zero_denominators / elements
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    args.lr = 1e-3
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    train, _, corpus_info = convergence.corpus(device)
    model = convergence.build_model(args).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step = causal_lm_train_step(model, optimizer)
    losses = [float(step(b)) for b in convergence.batches(train, args.steps, args.batch, args.seq, seed=3)]
    moments = [(optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])
               for p in model.parameters() if p.dim() == 2]  # fmt: skip
    schemes = {scheme: measure(moments, scheme) for scheme in ("linear", "dynamic", "sqrt")}
    for scheme, r in schemes.items():
        print(f"{scheme:>8}: " + ", ".join(f"{k} {v:.3e}" for k, v in r.items()))
    write_result("quantization_schemes", {
        "settings": vars(args), "corpus": corpus_info, "loss_first_last": [losses[0], losses[-1]],
        "weights": len(moments), "elements": sum(m.numel() for m, _ in moments), "schemes": schemes,
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
