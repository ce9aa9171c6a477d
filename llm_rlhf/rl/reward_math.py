"""The reward model's equations, one small pure function each, to be read against the papers: the pairwise
loss a reward model is trained with, the ensembles of several reward models, and best-of-n sampling with the
over-optimisation laws that `compare` fits (Gao et al. 2022).

Every function takes keyword-only tensors named after the glossary (`ppo_math`) and returns tensors; the
caller turns them into metrics. Shapes: B sequences (or prompts), K reward models, N samples of a prompt.

    scores            (B,)   one reward-model scalar per sequence
    chosen_scores     (B,)   the scores of the preferred responses of B comparison pairs;
    rejected_scores   (B,)   those of the other responses (`bradley_terry_loss`)
    member_scores     (K, B) the scores of each of K reward models (an ensemble), one row per member
    rewards           (B, N) best-of-n: one score per sample, N samples of each of B prompts (a score per
                      sample here, not `ppo_math`'s per-token rewards)
    n                 best-of-n's n, 1 <= n <= N
    d, gain           (m,) the over-optimisation laws' points: d = sqrt(KL to the initial policy), gain = the
                      gold score minus the initial policy's

Only torch is imported, so this module can be reviewed and tested on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# ---------------------------------------------------------------------------------------------
# Reward model
# ---------------------------------------------------------------------------------------------


def bradley_terry_loss(
    *,
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Pairwise reward-model loss (Bradley & Terry 1952; Stiennon et al. 2020, eq. 1; Ouyang et al.
    2022, eq. 1), with the optional margin of Touvron et al. 2023 (Llama 2, eq. 2):

        L = -mean( log sigmoid(r(x, y_w) - r(x, y_l) - margin) )

    `logsigmoid` keeps large score gaps finite. chosen_scores, rejected_scores, margin: (B,).
    Returns a scalar.
    """
    diff = chosen_scores - rejected_scores  # (B,)
    if margin is not None:
        diff = diff - margin
    return -torch.nn.functional.logsigmoid(diff).mean()


# ---------------------------------------------------------------------------------------------
# Reward-model ensembles
# ---------------------------------------------------------------------------------------------

ENSEMBLE_COMBINES = ("mean", "min", "uncertainty")


def member_disagreement(*, member_scores: torch.Tensor) -> torch.Tensor:
    """How much K reward models disagree on each sequence: the population std across the members,

        std_k(s) = sqrt( (1/K) * sum_k (s_k - mean_k(s))^2 )

    Population (1/K), not sample (1/(K-1)): it describes the K members at hand rather than estimating the
    spread of some larger population of reward models, it is defined for K = 1 (0, so one member is an
    ensemble that never disagrees) and its square is the intra-ensemble variance of Coste et al. (2024).
    member_scores: (K, B) -> (B,).
    """
    return member_scores.std(dim=0, correction=0)  # (B,)


def combine_member_scores(
    *, member_scores: torch.Tensor, combine: str, uncertainty_coef: float = 1.0
) -> torch.Tensor:
    """One score per sequence from the scores of K reward models (Coste et al. 2024, "Reward Model
    Ensembles Help Mitigate Overoptimization", sec. 3), s_k the k-th member's (normalised) score:

        mean          scores = (1/K) * sum_k s_k
        min           scores = min_k s_k                                   worst-case optimisation (WCO)
        uncertainty   scores = mean_k(s) - uncertainty_coef * std_k(s)     uncertainty-weighted (UWO)

    std_k is `member_disagreement` (population std). Coste et al. penalise the variance; the std is in score
    units, so the same lambda means the same thing whatever the scale of the scores. With K = 1 every mode
    returns the member's score exactly (mean of one value, min of one value, std 0).
    Hand example, two members on two sequences, s = [[1, 0], [3, 0]] (K=2, B=2), lambda = 1:
    mean [2, 0], min [1, 0], std [1, 0], uncertainty [1, 0].
    member_scores: (K, B) -> (B,).
    """
    if combine == "mean":
        return member_scores.mean(dim=0)  # (B,)
    if combine == "min":
        return member_scores.min(dim=0).values  # (B,)
    if combine == "uncertainty":
        std = member_disagreement(member_scores=member_scores)  # (B,)
        return member_scores.mean(dim=0) - uncertainty_coef * std  # (B,)
    raise ValueError(f"unknown ensemble combine {combine!r}; expected one of {', '.join(ENSEMBLE_COMBINES)}")


# --- best-of-n and the over-optimisation law ---------------------------------------------------


def best_of_n_kl(n: int) -> float:
    """KL(pi_bon || pi_ref) = log n - (n - 1) / n: best-of-n sampling against the policy it samples from, for a
    reward with no ties (Stiennon et al. 2020, appendix G.3; Gao et al. 2022, sec. 2). With ties it is an
    upper bound (Beirami et al. 2024); `best_of_n_empirical_kl` measures it on samples."""
    if n < 1:
        raise ValueError(f"n must be >= 1 (got {n})")
    return math.log(n) - (n - 1) / n


def best_of_n_weights(*, rewards: torch.Tensor, n: int) -> torch.Tensor:
    """Unbiased best-of-n weights from N >= n samples of each prompt (Gao et al. 2022, appendix: every
    n-subset of the N samples is one draw of best-of-n).

    The sample of rank k (1 = lowest reward of its row) is the best of a uniformly random n-subset with
    probability  w_k = C(k - 1, n - 1) / C(N, n);  sum_k w_k f(y_k) is an unbiased estimate of E[f(best of n)].
    Samples with tied rewards share their weights equally (which of them best-of-n keeps is arbitrary).
    rewards: (B, N). Returns (B, N) weights, each row summing to 1, in the samples' own order.
    """
    B, N = rewards.shape
    if not 1 <= n <= N:
        raise ValueError(f"best-of-{n} needs 1 <= n <= N = {N} samples per prompt")
    k = torch.arange(1, N + 1, dtype=torch.float64)  # ranks
    log_w = (  # log C(k - 1, n - 1) - log C(N, n), -inf where k < n
        torch.lgamma(k) - math.lgamma(n) - torch.lgamma(k - n + 1).where(k >= n, torch.tensor(math.inf))
    ) - (math.lgamma(N + 1) - math.lgamma(n + 1) - math.lgamma(N - n + 1))
    by_rank = log_w.exp()  # (N,)
    order = rewards.double().argsort(dim=1, stable=True)  # (B, N) sample index of each rank
    weights = torch.zeros(B, N, dtype=torch.float64).scatter(1, order, by_rank.expand(B, N))  # (B, N)
    same = rewards.unsqueeze(2) == rewards.unsqueeze(1)  # (B, N, N) tied pairs, the diagonal included
    return (same.double() @ weights.unsqueeze(2)).squeeze(2) / same.sum(2)  # tie-group means: (B, N)


def best_of_n_empirical_kl(*, rewards: torch.Tensor, n: int) -> torch.Tensor:
    """KL(bon || ref) measured on samples: best-of-n drawn (with replacement) from the empirical
    distribution of each row's N samples, exact for that distribution. Per distinct reward value v:

        p_v = F(v) - F(v-)    (the share of samples scoring v),    q_v = F(v)^n - F(v-)^n,
        KL  = sum_v q_v log(q_v / p_v).

    With N distinct rewards it is within 0.05 nats of `best_of_n_kl` up to n = N = 64; samples that tie
    (identical responses, e.g. an immediate EOS) make it smaller. rewards: (B, N). Returns (B,).
    """
    B, N = rewards.shape
    if n < 1:
        raise ValueError(f"n must be >= 1 (got {n})")
    r = rewards.double()
    below_or_equal = (r.unsqueeze(1) <= r.unsqueeze(2)).double().mean(2)  # (B, N) F(v) at each sample's v
    below = (r.unsqueeze(1) < r.unsqueeze(2)).double().mean(2)  # (B, N) F(v-)
    p = below_or_equal - below  # (B, N) p_v, repeated once per sample of value v
    q = below_or_equal.pow(n) - below.pow(n)  # (B, N) q_v
    # Each value v appears N * p_v times in the row, so weight each sample's term by 1 / (N * p_v).
    terms = torch.where(q > 0, q * (q / p).log(), torch.zeros_like(q)) / (N * p)  # (B, N)
    return terms.sum(1)  # (B,)


def gao_bon_law(d: torch.Tensor, *, alpha: float, beta: float) -> torch.Tensor:
    """Gold reward of best-of-n against d = sqrt(KL): R(d) = d (alpha - beta d) (Gao et al. 2022, eq. 1)."""
    return d * (alpha - beta * d)


def gao_rl_law(d: torch.Tensor, *, alpha: float, beta: float) -> torch.Tensor:
    """Gold reward of RL against d = sqrt(KL): R(d) = d (alpha - beta log d) (Gao et al. 2022, eq. 2)."""
    return d * (alpha - beta * torch.log(d))


@dataclass
class LawFit:
    """A least-squares fit of one of Gao et al.'s forms: coefficients, their standard errors, the RMS
    residual and the number of points."""

    alpha: float
    beta: float
    alpha_stderr: float
    beta_stderr: float
    rmse: float
    num_points: int


def fit_gao_law(*, d: torch.Tensor, gain: torch.Tensor, form: str) -> LawFit:
    """Fit alpha, beta of `gao_bon_law` (form "bon") or `gao_rl_law` (form "rl") to points (d_i, gain_i),
    where d = sqrt(KL to the initial policy) and gain = gold score - the initial policy's gold score
    (both laws pass through R(0) = 0). Both forms are linear in (alpha, beta):

        gain = alpha * d - beta * g(d),    g(d) = d^2 (bon)  or  d log d (rl),

    so ordinary least squares on the design [d, -g(d)] gives them; stderr = sqrt(diag(s^2 (X^T X)^-1)) with
    s^2 = RSS / (m - 2). d, gain: (m,), d > 0, m >= 3 points.
    """
    if form not in ("bon", "rl"):
        raise ValueError(f"form must be 'bon' or 'rl' (got {form!r})")
    d, gain = d.double(), gain.double()
    if d.shape != gain.shape or d.dim() != 1 or d.numel() < 3 or bool((d <= 0).any()):
        raise ValueError("need at least 3 points with d > 0, as two 1-d tensors of one length")
    g = d * d if form == "bon" else d * torch.log(d)  # (m,)
    X = torch.stack([d, -g], dim=1)  # (m, 2)
    xtx_inv = torch.linalg.inv(X.T @ X)  # (2, 2)
    coef = xtx_inv @ X.T @ gain  # (2,) alpha, beta
    residual = gain - X @ coef  # (m,)
    m = d.numel()
    s2 = float(residual.pow(2).sum()) / (m - 2)
    stderr = (s2 * torch.diagonal(xtx_inv)).sqrt()  # (2,)
    return LawFit(
        alpha=float(coef[0]),
        beta=float(coef[1]),
        alpha_stderr=float(stderr[0]),
        beta_stderr=float(stderr[1]),
        rmse=float(residual.pow(2).mean().sqrt()),
        num_points=m,
    )
