"""Gold reward against KL for the alignment methods, on the same held-out prompts and the same gold.

Best-of-n (an evaluation-time policy): sample N responses per prompt from the SFT model, keep the one the
reward model scores highest. Each n in `ns` is one point, estimated from the same N samples with the
unbiased best-of-n weights (`ppo_math.best_of_n_weights`); its KL to the SFT model is the analytic
log n - (n - 1)/n (`ppo_math.best_of_n_kl`) beside the KL measured on the samples
(`ppo_math.best_of_n_empirical_kl`, smaller where responses tie).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from llm_rlhf import ppo_math
from llm_rlhf.evaluate import sample_and_score
from llm_rlhf.gold import judge_details


def expectation(weights: torch.Tensor, x: torch.Tensor) -> float:
    """Mean over prompts of the weighted mean over each prompt's samples. weights, x: (P, N)."""
    return float((weights * x).sum(1).mean())


@torch.no_grad()
def best_of_n_points(
    model,
    tokenizer,
    prompts: list[str],
    *,
    reward_model,
    judge,
    ns: list[int],
    num_samples: int,
    seed: int = 0,
    batch_size: int = 32,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> list[dict[str, Any]]:
    """One point per n in `ns`: n, kl (analytic), kl_measured, rm_score, gold_score, sentiment,
    fluency_perplexity (the last two when the judge reports them), each the best-of-n expectation over the
    prompts. `model` is the policy best-of-n samples from (and its own reference: the SFT model).

    N = num_samples responses are drawn per prompt (prompt i's samples are rows i*N .. i*N + N - 1 of one
    `sample_and_score` call, batch b seeded with seed + b); the RM scores all of them and the judge each
    distinct (prompt, response) once."""
    if not ns or min(ns) < 1 or max(ns) > num_samples:
        raise ValueError(f"every n must be in [1, num_samples = {num_samples}] (got {ns})")
    P, N = len(prompts), num_samples
    rows = [prompt for prompt in prompts for _ in range(N)]
    records = sample_and_score(
        model,
        tokenizer,
        rows,
        reward_model=reward_model,
        seed=seed,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
    rm = torch.tensor([r["rm_score"] for r in records], dtype=torch.float64).view(P, N)  # (P, N)
    pairs = list(dict.fromkeys((r["prompt"], r["response"]) for r in records))  # distinct, in order
    parts = judge_details(judge, [p for p, _ in pairs], [r for _, r in pairs])
    index = {pair: i for i, pair in enumerate(pairs)}
    rows_of = torch.tensor([index[(r["prompt"], r["response"])] for r in records])  # (P * N,)
    per_sample = {
        key: torch.tensor(values, dtype=torch.float64)[rows_of].view(P, N)  # (P, N)
        for key, values in parts.items()
        if key in ("gold_score", "sentiment", "fluency_nll")
    }
    points = []
    for n in ns:
        weights = ppo_math.best_of_n_weights(rewards=rm, n=n)  # (P, N), rows sum to 1

        point = {
            "n": n,
            "kl": ppo_math.best_of_n_kl(n),
            "kl_measured": float(ppo_math.best_of_n_empirical_kl(rewards=rm, n=n).mean()),
            "rm_score": expectation(weights, rm),
            "gold_score": expectation(weights, per_sample["gold_score"]),
            "sentiment": expectation(weights, per_sample["sentiment"]) if "sentiment" in per_sample else None,
            "fluency_perplexity": (
                math.exp(expectation(weights, per_sample["fluency_nll"]))
                if "fluency_nll" in per_sample
                else None
            ),
        }
        points.append(point)
    return points
