"""How closely one set of next-token logits follows a reference: the measures that stay stable
across CPU kinds and kernel choices, for every test that compares logits.

Plain top-1 agreement is luck where the reference itself hesitates: when its top two logits are
within rounding noise of each other, any change of kernel (AVX2 vs AVX-512, a quantized
activation, a bf16 KV cache) may flip the argmax, and over 96 positions one flip moves the
agreement by 1%. So a test asserts on
- `mean_kl`: KL(reference || actual), averaged over positions (smooth, all of the vocabulary);
- `top1_confident`: top-1 agreement over the positions whose reference top-2 margin exceeds
  `margin` (a disagreement there is a real error of at least `margin` logits, not a tie);
- `worst_regret`: the largest reference-logit gap between the reference's choice and the
  actual choice (0 where they agree): how wrong the worst disagreement is, not how many there are.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Positions whose reference top-2 margin is below this are ties for top-1 agreement (logit
# units); each test states its own margin from its own noise. Measured 2026-11-30: of SmolLM2's
# 586 positions of FIDELITY_TEXT (llama.cpp's logits), 7% have a margin under 0.1, 13% under
# 0.2, 29% under 0.5; of the tiny synthetic models' 96 positions, 20-32% are under 0.2.
DEFAULT_MARGIN = 0.2


@dataclass(frozen=True)
class Fidelity:
    n_positions: int
    mean_kl: float          # mean over positions of KL(softmax(expected) || softmax(actual))
    top1: float             # top-1 agreement over all positions
    top1_confident: float   # top-1 agreement over positions with a reference top-2 margin > margin
    n_confident: int        # how many positions that is
    worst_regret: float     # max over positions of expected[argmax expected] - expected[argmax actual]
    max_abs_diff: float     # max |expected - actual| over all logits
    margin: float

    # The names of reference_forward's former LogitComparison, still used by other test files.
    @property
    def top1_agreement(self) -> float:
        return self.top1

    @property
    def max_top1_regret(self) -> float:
        return self.worst_regret

    def __str__(self) -> str:
        return (f"{self.n_positions} positions: mean KL {self.mean_kl:.2e}, top-1 {self.top1:.4f}, "
                f"top-1 where margin > {self.margin} {self.top1_confident:.4f} (of {self.n_confident}), "
                f"worst regret {self.worst_regret:.3f}, max |diff| {self.max_abs_diff:.3g}")


CHUNK_ELEMENTS = 1 << 20     # logits per slice of rows: the float64 temporaries stay in cache


def fidelity(expected, actual, margin: float = DEFAULT_MARGIN) -> Fidelity:
    """Compare `actual` (T, n_vocab) logits with the reference `expected`; any float arrays or
    CPU tensors. Computed a slice of rows at a time (every measure is per row, then reduced):
    for 793 x 262k logits the whole-array temporaries took 48 s, mostly in fresh pages."""
    expected, actual = np.asarray(expected), np.asarray(actual)
    assert expected.shape == actual.shape and expected.ndim == 2, (expected.shape, actual.shape)
    T, V = expected.shape
    kl, agree, confident, regret = np.empty(T), np.empty(T, bool), np.empty(T, bool), np.empty(T)
    max_abs_diff, step = 0.0, max(1, CHUNK_ELEMENTS // V)
    for r0 in range(0, T, step):
        e = np.asarray(expected[r0:r0 + step], dtype=np.float64)
        a = np.asarray(actual[r0:r0 + step], dtype=np.float64)
        rows, part = np.arange(e.shape[0]), slice(r0, r0 + e.shape[0])
        log_p = e - _logsumexp(e)
        log_q = a - _logsumexp(a)
        kl[part] = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
        top_e, top_a = e.argmax(-1), a.argmax(-1)
        agree[part] = top_e == top_a
        top2 = np.partition(e, -2, axis=-1)[:, -2:]            # (rows, 2): second and first
        confident[part] = (top2[:, 1] - top2[:, 0]) > margin
        regret[part] = e[rows, top_e] - e[rows, top_a]
        max_abs_diff = max(max_abs_diff, float(np.abs(e - a).max()))
    return Fidelity(
        n_positions=T,
        mean_kl=float(np.mean(kl)),
        top1=float(np.mean(agree)),
        top1_confident=float(np.mean(agree[confident])) if confident.any() else 1.0,
        n_confident=int(confident.sum()),
        worst_regret=float(np.max(regret)),
        max_abs_diff=max_abs_diff,
        margin=margin,
    )


def _logsumexp(x: np.ndarray) -> np.ndarray:
    top = x.max(axis=-1, keepdims=True)
    return top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True))
