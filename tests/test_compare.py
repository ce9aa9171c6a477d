"""Gold against KL for the alignment methods (`llm_rlhf.compare`): best-of-n on a tiny model, checked
against the samples it is built from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llm_rlhf import compare, ppo_math
from llm_rlhf.evaluate import sample_and_score
from llm_rlhf.gold import GoldJudge
from llm_rlhf.models import freeze, load_causal_lm, load_tokenizer
from llm_rlhf.reward_model import load_reward_model

REPO = Path(__file__).resolve().parent.parent
SENTIMENT_JUDGE = str(REPO / "data" / "reviews" / "gold_judge.json")


def test_best_of_n_points_are_the_expectations_over_the_samples(tiny_model_dir, tiny_rm_dir, prompt_file):
    model = freeze(load_causal_lm(str(tiny_model_dir)))
    tokenizer = load_tokenizer(str(tiny_model_dir))
    reward_model = freeze(load_reward_model(str(tiny_rm_dir)))
    judge = GoldJudge.load(SENTIMENT_JUDGE)
    prompts = [json.loads(line)["prompt"] for line in prompt_file.read_text().splitlines()][:3]
    N, sampling = 8, dict(seed=3, batch_size=8, max_new_tokens=6)
    points = compare.best_of_n_points(
        model,
        tokenizer,
        prompts,
        reward_model=reward_model,
        judge=judge,
        ns=[1, 2, 8],
        num_samples=N,
        **sampling,
    )
    # The same samples, drawn again by the evaluation's own sampler with the same seeds.
    records = sample_and_score(
        model,
        tokenizer,
        [p for p in prompts for _ in range(N)],
        reward_model=reward_model,
        judge=judge,
        **sampling,
    )
    rm = torch.tensor([r["rm_score"] for r in records]).view(3, N)
    gold = torch.tensor([r["gold_score"] for r in records]).view(3, N)
    by_n = {p["n"]: p for p in points}
    # n = 1 is the SFT model itself: the plain means, KL 0.
    assert by_n[1]["rm_score"] == pytest.approx(rm.mean().item(), abs=1e-6)
    assert by_n[1]["gold_score"] == pytest.approx(gold.mean().item(), abs=1e-6)
    assert by_n[1]["kl"] == 0.0 and by_n[1]["kl_measured"] == pytest.approx(0.0, abs=1e-12)
    # n = N keeps each prompt's best-scored sample (the RM scores of the 8 samples of a prompt do not tie here).
    assert all(len(set(row.tolist())) == N for row in rm)
    best = rm.argmax(1)
    assert by_n[8]["rm_score"] == pytest.approx(rm.max(1).values.mean().item(), abs=1e-6)
    assert by_n[8]["gold_score"] == pytest.approx(gold[torch.arange(3), best].mean().item(), abs=1e-6)
    assert by_n[2]["kl"] == ppo_math.best_of_n_kl(2)
    assert by_n[1]["rm_score"] <= by_n[2]["rm_score"] <= by_n[8]["rm_score"]
    with pytest.raises(ValueError, match="num_samples"):
        compare.best_of_n_points(
            model, tokenizer, prompts, reward_model=reward_model, judge=judge, ns=[16], num_samples=N
        )
