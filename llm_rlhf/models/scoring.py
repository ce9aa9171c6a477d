"""The one scorer of sampled responses: what PPO adds at the last response token, and what `llm-rlhf eval`,
PPO's held-out evaluation and `compare` (best-of-n, DPO's points) report, computed in one place, so the
evaluation of a run scores exactly as its PPO did:

    scores = rm_score + reward_fn_weight * reward_fn(prompts, responses)          (B,)

    rm_score   r_phi(x, y + EOS), normalised with the RM's stored mean/std (`RewardModel.score_samples`: every
               response ends with the RM's own EOS, as in RM training, also one cut by a stop string or
               truncated at max_new_tokens; an RM with another vocabulary re-reads the text,
               `RewardModel.score_tokens`), or a reward-model ensemble's combined score (`RewardEnsemble`:
               every member, then ensemble_combine); 0 without a reward model
    reward_fn  a loaded `reward_fn.RewardFn` on the prompt and response texts, unweighted; without one the
               scores are rm_score alone

    Scorer        the reward model (or ensemble) and the reward function, loaded once; a call scores one batch
    Scores        the scores and their parts: rm_score, reward_fn, each member's score and their disagreement
    ScoreSettings the keys of a flat config that choose the scorer; `scored_as(cfg)` adds where a response
                  ends (the RM scores the text up to its end): what an evaluation takes from the PPO run it
                  judges (`pipeline.stage_config`)
    build_scorer  the scorer a flat config names, its reward model loaded by `scoring_reward_model`: the one
                  loading of a config's reward model(s) for PPO (`llm_rlhf.ppo.building.build_models`),
                  `llm-rlhf eval` and `compare` (the PPO run's own config: its points are scored as PPO
                  scored its rollouts)

A scorer holds no collective: each process scores its own samples (PPO agrees across processes on a failed
reward function itself, `RolloutCollector.score`).
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from llm_rlhf.core.callables import split_callable_spec
from llm_rlhf.core.config import is_off, require
from llm_rlhf.models.loading import freeze, use_fused_gelu
from llm_rlhf.models.reward_fn import RewardFn, decode_texts, load_reward_fn
from llm_rlhf.models.reward_model import RewardEnsemble, check_ensemble_keys, load_reward_models
from llm_rlhf.rl import reward_math
from llm_rlhf.rl.rollout import Samples, Sampling


@dataclass(frozen=True)
class ScoreSettings:
    """The keys that choose the scorer, as PPO's and evaluation's flat configs declare them (the help texts
    are theirs): the reward model folder or an ensemble's list (None: no reward model), how an ensemble
    combines, and the reward function with its weight."""

    reward_model_path: str | list[str] | None
    ensemble_combine: str = "mean"
    ensemble_uncertainty_coef: float = 1.0
    reward_fn: str | None = None
    reward_fn_weight: float = 1.0

    @classmethod
    def of(cls, cfg: Any) -> ScoreSettings:
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


def check_score_keys(cfg: Any) -> None:
    """The scorer's keys of a PPO or evaluation config (a ConfigError naming the key): the reward function's
    form (imported when the stage starts, `load_reward_fn`), a finite weight, the ensemble keys."""
    if cfg.reward_fn is not None:
        split_callable_spec(cfg.reward_fn, "reward_fn")
    require(math.isfinite(cfg.reward_fn_weight), "reward_fn_weight", "must be a finite number")
    check_ensemble_keys(cfg)


def scored_as(cfg: Any) -> dict[str, Any]:
    """The keys of a flat config that decide the score of a sample: the scorer's (`ScoreSettings`) and where a
    response ends (`Sampling.ends`), by name. An evaluation given these from a PPO run's config scores its
    samples as that PPO run scored its rollouts."""
    return {**dataclasses.asdict(ScoreSettings.of(cfg)), **Sampling.of(cfg).ends()}


@dataclass
class Scores:
    """One batch's scores and their parts, aligned with its rows.

    scores         (B,) float32: rm_score + reward_fn_weight * reward_fn (None when nothing scores)
    rm_score       (B,) float32: the reward model's normalised score, an ensemble's combined (None: no RM)
    reward_fn      (B,) float64: the reward function's numbers as it returned them, unweighted (None: none)
    member_scores  (K, B) float32: each ensemble member's normalised score (None: not an ensemble)
    disagreement   (B,) float32: the std across the members (`reward_math.member_disagreement`; None likewise)
    """

    scores: torch.Tensor | None
    rm_score: torch.Tensor | None = None
    reward_fn: torch.Tensor | None = None
    member_scores: torch.Tensor | None = None
    disagreement: torch.Tensor | None = None

    def terms(self) -> dict[str, torch.Tensor]:
        """The parts PPO logs as objective/<name>, (B,) each: with an ensemble each member's score
        (scores_member_<k>) and their disagreement (scores_disagreement); with a reward function the RM's
        score (rm_score, when there is an RM) and the function's (reward_fn, in float32 as the scores add it)."""
        out = {}
        if self.member_scores is not None:
            out.update({f"scores_member_{k}": s for k, s in enumerate(self.member_scores)})
            out["scores_disagreement"] = self.disagreement
        if self.reward_fn is not None:
            if self.rm_score is not None:
                out["rm_score"] = self.rm_score
            out["reward_fn"] = self.reward_fn.float()
        return out


class Scorer:
    """scores = rm_score + reward_fn_weight * reward_fn of sampled responses, and their parts (`Scores`).

    reward_model: a frozen `RewardModel`, a `RewardEnsemble` or None; reward_fn: a loaded `RewardFn` or None.
    rm_context: a context manager factory around the reward model's forwards (PPO: its autocast, so the RM
    runs in the policy's precision; the reward function is not called inside it).
    """

    def __init__(
        self,
        reward_model=None,
        reward_fn: RewardFn | None = None,
        *,
        reward_fn_weight: float = 1.0,
        rm_context=nullcontext,
    ):
        self.reward_model, self.reward_fn = reward_model, reward_fn
        self.reward_fn_weight, self.rm_context = reward_fn_weight, rm_context

    @torch.no_grad()
    def __call__(self, samples: Samples, tokenizer, prompts: list[str] | None = None) -> Scores:
        """Scores of `samples`, written in `tokenizer`'s ids. The reward function sees the response text
        without its EOS (`reward_fn.decode_texts`) and `prompts` when given (the caller's prompt strings), else
        the prompt decoded from the query."""
        rm = members = disagreement = None
        if self.reward_model is not None:
            with self.rm_context():
                rm, members = self.rm_scores(samples, tokenizer)
            if members is not None:
                disagreement = reward_math.member_disagreement(member_scores=members)  # (B,)
        if self.reward_fn is None:
            return Scores(scores=rm, rm_score=rm, member_scores=members, disagreement=disagreement)
        fn = self.reward_fn_scores(samples, tokenizer, prompts)  # (B,) float64
        base = rm if rm is not None else torch.zeros(fn.shape[0], device=fn.device)  # (B,)
        scores = base + self.reward_fn_weight * fn.float()  # (B,) float32
        return Scores(scores, rm_score=rm, reward_fn=fn, member_scores=members, disagreement=disagreement)

    def rm_scores(self, samples: Samples, tokenizer) -> tuple[torch.Tensor, torch.Tensor | None]:
        """r_phi(x, y) normalised, (B,), and with an ensemble the members' scores (K, B) it combines
        (`RewardEnsemble.combine`, ensemble_combine). Every response is read as the RM was trained to read
        text, ending with the RM's own EOS, also one cut by a stop string or truncated at max_new_tokens
        (`RewardModel.score_samples`); the RM drops the columns that are padding in every row
        before its forward (`reward_model.trim_padding_columns`)."""
        sequence, mask = samples.sequence, samples.attention_mask  # (B, P + R) each
        if isinstance(self.reward_model, RewardEnsemble):  # each member reads the rows its own way
            members = self.reward_model.member_scores(sequence, mask, tokenizer)  # (K, B)
            return self.reward_model.combine(members), members
        return self.reward_model.score_samples(sequence, mask, tokenizer).float(), None

    def reward_fn_scores(self, samples: Samples, tokenizer, prompts: list[str] | None) -> torch.Tensor:
        """reward_fn(prompts, responses) of the samples, checked (`RewardFn`: one finite number per response,
        else a one-line UserError naming it), unweighted: (B,) float64, the function's numbers exactly."""
        decoded, responses = decode_texts(
            tokenizer, samples.query, samples.query_mask, samples.response, samples.response_mask
        )
        values = self.reward_fn(decoded if prompts is None else prompts, responses)
        return torch.tensor(values, dtype=torch.float64, device=samples.query.device)  # (B,)


def scoring_reward_model(cfg: Any, given=None, *, device=None, fused_gelu: bool = False):
    """The frozen reward model of a flat config (PPO's or evaluation's keys: reward_model_path, ensemble_combine,
    ensemble_uncertainty_coef, dtype, trust_remote_code), or None when reward_model_path is none.

    given: the Python API's object in place of reward_model_path, a `RewardModel` or a list of them (a
    `RewardEnsemble` combined with the config's ensemble keys); else the folder, or the list of folders (an
    ensemble, each member with its own normalisation), loaded in `dtype` (`reward_model.load_reward_models`).
    device: where it goes (None: where it is). fused_gelu: GPT-2's gelu swapped for the one-kernel form in a
    loaded model (`loading.use_fused_gelu`: PPO, whose RM runs every step; a given object stays as it is)."""
    if given is None and is_off(cfg.reward_model_path):
        return None
    if isinstance(given, list):
        given = RewardEnsemble(
            given, combine=cfg.ensemble_combine, uncertainty_coef=cfg.ensemble_uncertainty_coef
        )
    if given is not None:
        return freeze(given.to(device) if device is not None else given)
    loaded = load_reward_models(
        cfg.reward_model_path,
        combine=cfg.ensemble_combine,
        uncertainty_coef=cfg.ensemble_uncertainty_coef,
        dtype=cfg.dtype,
        trust_remote_code=cfg.trust_remote_code,
        device=device,
    )
    return freeze(use_fused_gelu(loaded) if fused_gelu else loaded)


def build_scorer(cfg: Any, *, reward_model=None, reward_fn: RewardFn | None = None, device=None) -> Scorer:
    """The scorer a flat config names: its reward model (`scoring_reward_model`; reward_model: the Python
    API's object in place of the folders), its reward function (reward_fn: one already loaded, else the
    config's imported, `reward_fn.load_reward_fn`; None when the key is null) and reward_fn_weight. What
    `llm-rlhf eval` scores with, and `compare` given the PPO run's config: PPO's own trainer wraps the same
    reward model (`llm_rlhf.ppo.building.build_models`) with the same keys, after accelerate has placed it."""
    if reward_fn is None and cfg.reward_fn is not None:
        reward_fn = load_reward_fn(cfg.reward_fn)
    model = scoring_reward_model(cfg, reward_model, device=device)
    return Scorer(model, reward_fn, reward_fn_weight=cfg.reward_fn_weight)
