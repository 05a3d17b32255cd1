"""How much of A_hat the V-trace product form of GRPO leaves at a response's first token (README Decision 4).

    python benchmarks/trace_decay.py runs/toy/runs/remix-grpo/*/seed*/metrics.jsonl

With per-token log(pi_k/mu) = x_i, the product form gives token t the advantage A_hat * prod_{i>t} min(1, e^x_i).
For x_i independent N(m, s^2), a response of L tokens keeps at its first token
    typically   exp((L - 1) * E[min(0, x)]),   E[min(0, x)] = m Phi(-m/s) - s phi(m/s)
    on average  (E[min(1, e^x)])^(L - 1),      E[min(1, e^x)] = e^(m + s^2/2) Phi(-(m + s^2)/s) + Phi(m/s)
(the mean is carried by rare lucky draws; the typical value is what a response sees). A Monte Carlo run checks
the typical value. The metrics files (from remix.py or toy/toy.py runs) give the log-ratio moments that training
produced on historical samples (offpolicy/log_ratio_mean and _std) and the products measured at their lengths.
"""

import json
import math
import statistics
import sys

import torch

LENGTHS = (1000, 4000, 8000)
SIGMAS = (0.01, 0.02, 0.03, 0.04, 0.05)


def phi(z: float) -> float:
    return math.exp(-z * z / 2) / math.sqrt(2 * math.pi)


def cdf(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def typical(m: float, s: float, length: int) -> float:
    return math.exp((length - 1) * (m * cdf(-m / s) - s * phi(m / s)))


def average(m: float, s: float, length: int) -> float:
    return (math.exp(m + s * s / 2) * cdf(-(m + s * s) / s) + cdf(m / s)) ** (length - 1)


def monte_carlo(m: float, s: float, length: int, draws: int = 2000) -> float:
    x = m + s * torch.randn(draws, length - 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return torch.clamp(x, max=0.0).sum(-1).exp().median().item()


def main():
    rows = [json.loads(line) for path in sys.argv[1:] for line in open(path)]
    hist = [r for r in rows if r.get("batch/historical", 0) > 0]
    cases = [(f"s = {s}", 0.0, s) for s in SIGMAS]
    if hist:
        means = [r["offpolicy/log_ratio_mean"] for r in hist]
        stds = [r["offpolicy/log_ratio_std"] for r in hist]
        lengths = [r["response/length_mean"] for r in hist]
        print(f"{len(hist)} steps with historical samples in {len(sys.argv) - 1} runs: per-token log(pi_k/mu) mean "
              f"median {statistics.median(means):.2e} (range {min(means):.2e} .. {max(means):.2e}), sd median "
              f"{statistics.median(stds):.4f} (range {min(stds):.4f} .. {max(stds):.4f}); mean response length "
              f"{statistics.mean(lengths):.1f}; measured offpolicy/trace_prod_mean median "
              f"{statistics.median(r['offpolicy/trace_prod_mean'] for r in hist):.3f}, min "
              f"{min(r['offpolicy/trace_prod_mean'] for r in hist):.3f}\n")
        cases = [("training, median sd", statistics.median(means), statistics.median(stds)),
                 ("training, largest sd", statistics.median(means), max(stds))] + cases
    print("| log(pi_k/mu) per token | " + " | ".join(f"{n:,} tokens (typical / mean)" for n in LENGTHS) + " |")
    print("|---|" + "---|" * len(LENGTHS))
    for name, m, s in cases:
        cells = [f"{typical(m, s, n):.1e} / {average(m, s, n):.1e}" for n in LENGTHS]
        print(f"| {name}: m = {m:.1e}, s = {s:.4f} | " + " | ".join(cells) + " |")
    m, s, n = 0.0, 0.02, 4000
    print(f"\nMonte Carlo check, s = {s}, {n:,} tokens: median {monte_carlo(m, s, n):.2e} against {typical(m, s, n):.2e}")


if __name__ == "__main__":
    main()
