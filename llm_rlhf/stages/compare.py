"""Gold reward against KL for the alignment methods, on the same held-out prompts and the same gold.

    llm-rlhf compare --config recipes/reviews/compare.yaml      (or the pipeline's `compare` stage)

For the KL one is willing to spend, which method buys the most gold reward? Three methods from one SFT model
and one proxy, each a set of points (sqrt(KL to the SFT model), RM score, gold score) on the held-out prompts
of the PPO run (its `eval_prompt_file`, first `eval_num_prompts`), sampled with its settings and seed. The
proxy is the scorer PPO trained against, built from the PPO run's config.yaml (`scoring.build_scorer`): its
reward model or ensemble combined as it combined them, and its reward function with its weight. DPO's and
best-of-n's points are scored with it as PPO's held-out evaluations were (rm_score the reward model's part,
reward_fn the function's, unweighted), and best-of-n keeps the response it scores highest:

    PPO        the held-out evaluations it logged along its run (DIR/ppo/eval_log.jsonl: run PPO with
               eval_every > 0); KL = the k1 sequence estimate on the samples. Further RL runs from the same
               SFT model (`more_ppo_dirs`: other advantage estimators, other KL settings) are methods of their
               own, named by their folder, each with its own fit; they must have been evaluated on the same
               held-out prompts, sampled the same way and judged by the same gold (a ConfigError otherwise)
    DPO        one DPO stage per beta in `dpo_betas` (TRL's DPOTrainer, `llm_rlhf.stages.dpo`) on the RM's
               preference pairs, each evaluated like PPO's held-out evaluations
    best-of-n  see below

Gao et al. (2022) fitted  R(d) = d (alpha - beta d)  to best-of-n and  R(d) = d (alpha - beta log d)  to RL,
with d = sqrt(KL) and R the gold gain over the initial policy; `reward_math.fit_gao_law` fits them here (the RL
form to PPO and to DPO) with the coefficients' standard errors and R^2, and a fit is flagged poor when
R^2 < 0.8 or it rests on fewer than 4 points.

Best-of-n (an evaluation-time policy): sample N responses per prompt from the SFT model, keep the one the
proxy scores highest (rm_score + reward_fn_weight * reward_fn with a reward function, as PPO maximised). Each
n in `ns` is one point, estimated from the same N samples with the unbiased best-of-n weights
(`reward_math.best_of_n_weights`); its KL to the SFT model is the analytic log n - (n - 1)/n
(`reward_math.best_of_n_kl`) beside the KL measured on the samples (`reward_math.best_of_n_empirical_kl`, smaller
where responses tie).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import PartialState

from llm_rlhf.core.config import (
    check_not_placeholder,
    format_config,
    help_field,
    is_off,
    load_yaml_config,
    require,
    save_config,
)
from llm_rlhf.core.data import prompt_rules
from llm_rlhf.core.errors import ConfigError, UserError
from llm_rlhf.core.utils import atomic_write_json, atomic_write_text
from llm_rlhf.evaluation.measures import (
    KLReference,
    Measures,
    PairedSampling,
    evaluate_policy,
    load_heldout_inputs,
    sample_and_score,
)
from llm_rlhf.models.loading import freeze, load_causal_lm, load_tokenizer
from llm_rlhf.models.reward_model import check_members_exist
from llm_rlhf.models.scoring import Scorer, build_scorer
from llm_rlhf.ppo import config as ppo_config
from llm_rlhf.rl import reward_math
from llm_rlhf.rl.rollout import Sampling
from llm_rlhf.stages import dpo
from llm_rlhf.training.hf_stage import trainer_checkpoint


def expectation(weights: torch.Tensor, x: torch.Tensor) -> float:
    """Mean over prompts of the weighted mean over each prompt's samples. weights, x: (P, N)."""
    return float((weights * x).sum(1).mean())


def proxy_score(record: dict[str, Any]) -> float | None:
    """The score PPO maximised, of one `sample_and_score` record: rm_score + reward_fn_weight * reward_fn
    (combined_score) with a reward function, else the reward model's rm_score."""
    return record["combined_score"] if record["reward_fn"] is not None else record["rm_score"]


@torch.no_grad()
def best_of_n_points(
    model,
    tokenizer,
    prompts: list[str],
    draws: PairedSampling,
    *,
    measures: Measures,
    ns: list[int],
    num_samples: int,
) -> list[dict[str, Any]]:
    """One point per n in `ns`: n, kl (analytic), kl_measured, rm_score, reward_fn, gold_score, sentiment,
    fluency_perplexity (each None where not measured: no reward model, no reward function, a judge without
    those parts), each the best-of-n expectation over the prompts. `model` is the policy best-of-n samples
    from (and its own reference: the SFT model); `measures.scorer`, PPO's, selects (`proxy_score`), and
    `measures.judge` judges.

    N = num_samples responses are drawn per prompt (prompt i's samples are rows i*N .. i*N + N - 1 of one
    `sample_and_score` call, batch b seeded with seed + b, which scores all of them and judges each distinct
    (prompt, response) once)."""
    if not ns or min(ns) < 1 or max(ns) > num_samples:
        raise ValueError(f"every n must be in [1, num_samples = {num_samples}] (got {ns})")
    P, N = len(prompts), num_samples
    rows = [prompt for prompt in prompts for _ in range(N)]
    records = sample_and_score(
        model, tokenizer, rows, draws, measures=Measures(measures.scorer, measures.judge)
    )
    proxy = torch.tensor([proxy_score(r) for r in records], dtype=torch.float64).view(P, N)  # (P, N)
    per_sample = {  # (P, N) each, for the parts that were measured
        key: torch.tensor([r[key] for r in records], dtype=torch.float64).view(P, N)
        for key in ("rm_score", "reward_fn", "gold_score", "sentiment", "fluency_nll")
        if records[0][key] is not None
    }
    points = []
    for n in ns:
        weights = reward_math.best_of_n_weights(rewards=proxy, n=n)  # (P, N), rows sum to 1
        mean = {key: expectation(weights, x) for key, x in per_sample.items()}
        point = {
            "n": n,
            "kl": reward_math.best_of_n_kl(n),
            "kl_measured": float(reward_math.best_of_n_empirical_kl(rewards=proxy, n=n).mean()),
            "rm_score": mean.get("rm_score"),
            "reward_fn": mean.get("reward_fn"),
            "gold_score": mean["gold_score"],
            "sentiment": mean.get("sentiment"),
            "fluency_perplexity": math.exp(mean["fluency_nll"]) if "fluency_nll" in mean else None,
        }
        points.append(point)
    return points


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    sft_path: str = help_field(
        "runs/reviews/sft", "The SFT model: best-of-n's sampler, DPO's start, every KL's reference."
    )
    ppo_dir: str = help_field(
        "runs/reviews/ppo",
        "The PPO run: its eval_log.jsonl gives the PPO points and its config.yaml the held-out prompts, the "
        "sampling settings, the seed, the gold judge and the proxy (its reward model(s), ensemble_combine, "
        "reward_fn and reward_fn_weight: best-of-n's selector) every method is scored with.",
    )
    output_dir: str = help_field(
        "runs/reviews/compare", "points.jsonl, metrics.json and one dpo-beta-<b>/ per beta."
    )
    dpo_config: str | None = help_field(
        "recipes/reviews/dpo.yaml", "Recipe of the DPO stages (null: its defaults)."
    )
    dpo: dict = help_field({}, "Overrides of DPO config keys for every beta, e.g. {max_steps: 50}.")
    dpo_betas: list[float] = help_field([0.03, 0.1, 0.3, 1.0], "One DPO run per beta (empty: no DPO points).")
    best_of_n: list[int] = help_field(
        [1, 2, 4, 8, 16, 32, 64], "The n of each best-of-n point (empty: none)."
    )
    best_of_n_samples: int = help_field(
        64, "N, responses sampled per prompt for every best-of-n point (>= max n)."
    )
    more_ppo_dirs: list[str] = help_field(
        [],
        "Further RL runs from the same SFT model (other advantage estimators, other KL settings): each run's "
        "held-out evaluations are a method of its own, named by its folder (a pipeline run's DIR/<name>/ppo: "
        "<name>), with its own law fit. Each must share ppo_dir's held-out prompts, sampling settings, gold judge "
        "and reference model.",
    )

    def __post_init__(self):
        require(all(b > 0 for b in self.dpo_betas), "dpo_betas", "every beta must be > 0")
        require(len(set(self.dpo_betas)) == len(self.dpo_betas), "dpo_betas", "a beta is listed twice")
        require(all(n >= 1 for n in self.best_of_n), "best_of_n", "every n must be >= 1")
        require(
            not self.best_of_n or max(self.best_of_n) <= self.best_of_n_samples,
            "best_of_n_samples",
            f"must be >= the largest n ({max(self.best_of_n, default=0)})",
        )
        names = [run_name(Path(d)) for d in self.more_ppo_dirs]
        clash = [n for n in names if names.count(n) > 1 or n in METHODS]
        require(
            not clash,
            "more_ppo_dirs",
            f"the run name '{clash[0] if clash else ''}' is taken (a run is named by its folder; the methods "
            f"{list(METHODS)} and every other run need their own name)",
        )


def dpo_config(cfg: Config, beta: float):
    """The DPO stage for one beta: recipe < the SFT model, the output folder and beta < `cfg.dpo`."""
    valid = [f.name for f in dataclasses.fields(dpo.Config)]
    values = load_yaml_config(cfg.dpo_config, valid) if cfg.dpo_config else {}
    values.update(
        model_name_or_path=cfg.sft_path, output_dir=str(Path(cfg.output_dir) / f"dpo-beta-{beta:g}")
    )
    for key in cfg.dpo:
        if key not in valid:
            raise ConfigError(f"config key 'dpo': unknown DPO key '{key}'")
    values.update(cfg.dpo)
    values["beta"] = beta
    return dpo.Config(**values)


def ppo_settings(ppo_dir: Path):
    """The PPO run's resolved config (its config.yaml) and its held-out evaluations (eval_log.jsonl)."""
    if not (ppo_dir / "config.yaml").is_file():
        raise UserError(f"'{ppo_dir}': no config.yaml; run the PPO stage first (llm-rlhf ppo)")
    cfg = ppo_config.Config(
        **load_yaml_config(ppo_dir / "config.yaml", [f.name for f in dataclasses.fields(ppo_config.Config)])
    )
    log = ppo_dir / "eval_log.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    if not records or not cfg.eval_every or not cfg.eval_prompt_file:
        raise UserError(
            f"'{log}': no held-out evaluations; run PPO with eval_every > 0 (e.g. --ppo \"{{eval_every: 10}}\")"
        )
    return cfg, records


def proxy_scorer(ppo_dir: Path, ppo_cfg) -> Scorer:
    """The scorer the PPO run trained against (`scoring.build_scorer` on its config.yaml): its reward model(s)
    combined as it combined them, its reward function and weight. A reward model or function the run was
    given as a Python object (`<reward_model>` in its config) is a ConfigError naming the key."""
    check_not_placeholder("reward_model_path", ppo_cfg.reward_model_path, str(ppo_dir / "config.yaml"))
    if not is_off(ppo_cfg.reward_model_path):
        check_members_exist(ppo_cfg.reward_model_path)
    return build_scorer(ppo_cfg)


def sft_origin(ppo_log: list[dict[str, Any]]) -> float | None:
    """The SFT model's gold score, where every law starts (gain 0 at d = 0): PPO's step-0 held-out evaluation,
    when policy == reference. Found by its step, not by KL == 0: under bf16 or on other hardware the
    step-0 KL need not be exactly 0. None if the log has no step 0 (a resumed run's partial log)."""
    return next((r["gold_score"] for r in ppo_log if r["step"] == 0), None)


def law_fit(points: list[dict[str, Any]], origin: float, form: str) -> dict[str, Any] | None:
    """Gao et al.'s law fitted to the points with KL > 0, gain = gold - origin; None with < 3 points."""
    fitted = [p for p in points if p["kl"] > 0]
    if len(fitted) < 3:
        return None
    d = torch.tensor([math.sqrt(p["kl"]) for p in fitted], dtype=torch.float64)
    gain = torch.tensor([p["gold_score"] - origin for p in fitted], dtype=torch.float64)
    fit = reward_math.fit_gao_law(d=d, gain=gain, form=form)
    total = float((gain - gain.mean()).pow(2).sum())
    r2 = 1 - fit.rmse**2 * len(fitted) / total if total > 0 else float("nan")
    law = reward_math.gao_bon_law if form == "bon" else reward_math.gao_rl_law
    grid = torch.linspace(float(d.min()), float(d.max()), 50, dtype=torch.float64)  # (50,)
    curve = origin + law(grid, alpha=fit.alpha, beta=fit.beta)  # (50,) the fitted gold, for the plot
    return {
        **dataclasses.asdict(fit),
        "form": form,
        "origin": origin,
        "r2": r2,
        "poor": not (r2 >= 0.8) or len(fitted) < 4,
        "curve": [[float(x), float(y)] for x, y in zip(grid, curve)],
    }


def run_name(ppo_dir: Path) -> str:
    """What a PPO run is called on the plot: its folder's name, or for a pipeline run's stage folder
    (DIR/<name>/ppo) the run's: <name>."""
    return ppo_dir.parent.name if ppo_dir.name == "ppo" and ppo_dir.parent.name else ppo_dir.name


def heldout_settings(cfg) -> dict[str, Any]:
    """What makes two PPO runs' held-out points comparable: the same prompts (file, how many, how read), drawn
    the same way (`Sampling`), judged by the same gold, the KL measured to the same reference. A path that
    exists is compared resolved (runs/x and ./runs/x are one file)."""
    settings = {
        "eval_prompt_file": cfg.eval_prompt_file,
        "eval_num_prompts": cfg.eval_num_prompts,
        **prompt_rules(cfg),
        **{  # sampling_compile: how the decode steps run, not what they draw
            k: v for k, v in dataclasses.asdict(Sampling.of(cfg)).items() if k != "sampling_compile"
        },
        "gold_judge": cfg.gold_judge,
        "model_name_or_path": cfg.model_name_or_path,
    }
    return {
        k: str(Path(v).resolve()) if isinstance(v, str) and Path(v).exists() else v
        for k, v in settings.items()
    }


def more_runs(cfg: Config, ppo_cfg) -> list[tuple[str, str, Any, list[dict[str, Any]]]]:
    """(name, folder, config, held-out log) of each run of `more_ppo_dirs`, checked against ppo_dir's settings: a run
    evaluated on other prompts, sampled otherwise, judged by another gold or measured against another reference
    is a ConfigError naming the setting (its points would not be comparable)."""
    want = heldout_settings(ppo_cfg)
    runs = []
    for folder in cfg.more_ppo_dirs:
        run_cfg, log = ppo_settings(Path(folder))
        got = heldout_settings(run_cfg)
        key = next((key for key in want if got[key] != want[key]), None)
        if key is not None:
            raise ConfigError(
                f"config key 'more_ppo_dirs': '{folder}' has {key} {got[key]!r}, ppo_dir '{cfg.ppo_dir}' has "
                f"{want[key]!r}: its held-out points would not be comparable"
            )
        runs.append((run_name(Path(folder)), folder, run_cfg, log))
    return runs


def rl_points(method: str, log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An RL run's points: its held-out evaluations along the run, in step order."""
    return [
        {"method": method, "label": f"step {r['step']}", **{k: r.get(k) for k in POINT_KEYS}} for r in log
    ]


def dpo_points(cfg: Config, dpo_cfgs: list, inputs: dict[str, Any]) -> list[dict[str, Any]]:
    """One point per beta: DPO trained (or a finished run reused), then evaluated as PPO's held-out evaluations
    are. `inputs`: the prompts, draws, measures (PPO's scorer, the gold judge) and tokenizer every method is
    scored with."""
    points = []
    for beta, dpo_cfg in zip(cfg.dpo_betas, dpo_cfgs):
        if not (Path(dpo_cfg.output_dir) / "metrics.json").exists():
            print(f"== DPO beta {beta:g}: training in {dpo_cfg.output_dir}")
            # resume only from a checkpoint: a run killed before its first save starts over
            dpo.run(dataclasses.replace(dpo_cfg, resume=trainer_checkpoint(dpo_cfg.output_dir) is not None))
        policy = freeze(load_causal_lm(dpo_cfg.output_dir))
        result = evaluate_policy(
            policy,
            inputs["tokenizer"],
            inputs["prompts"],
            inputs["draws"],
            measures=inputs["measures"],
            reference=KLReference(inputs["sft_model"]),
        )
        points.append(
            {
                "method": "dpo",
                "label": f"beta {beta:g}",
                "kl": result["kl_to_ref"],
                "rm_score": result["rm_score_mean"],
                "reward_fn": result["reward_fn_mean"],
                "gold_score": result["gold_score_mean"],
                "sentiment": result["sentiment_mean"],
                "fluency_perplexity": result["fluency_perplexity"],
            }
        )
        del policy
    return points


def run(cfg: Config) -> dict[str, Any]:
    """PPO points from its log (and from each run of more_ppo_dirs), DPO points (training each beta, or reusing a
    finished one), best-of-n points; the fits and the best gold of each method; points.jsonl, config.yaml,
    metrics.json (last)."""
    started = time.time()
    if PartialState().num_processes > 1:
        raise UserError(
            "llm-rlhf compare runs in one process (not under a multi-process `accelerate launch`)"
        )
    print(format_config(cfg))
    out = Path(cfg.output_dir)
    ppo_cfg, ppo_log = ppo_settings(Path(cfg.ppo_dir))
    # every RL run and DPO config checked before any work
    rl_runs = [("ppo", cfg.ppo_dir, ppo_cfg, ppo_log), *more_runs(cfg, ppo_cfg)]
    dpo_cfgs = [dpo_config(cfg, beta) for beta in cfg.dpo_betas]
    prompts, judge = load_heldout_inputs(ppo_cfg)  # PPO's held-out prompts and gold judge, as it loads them
    # sampled as PPO's held-out evaluation samples (its settings, seed and batches): responses end as in PPO
    draws = PairedSampling(Sampling.of(ppo_cfg), seed=ppo_cfg.seed, batch_size=ppo_cfg.heldout_batch_size)
    measures = Measures(scorer=proxy_scorer(Path(cfg.ppo_dir), ppo_cfg), judge=judge)  # as PPO scored
    inputs = {
        "tokenizer": load_tokenizer(cfg.sft_path),
        "prompts": prompts,
        "draws": draws,
        "measures": measures,
        "sft_model": freeze(load_causal_lm(cfg.sft_path)),
    }

    points = [p for method, _, _, log in rl_runs for p in rl_points(method, log)]
    points += dpo_points(cfg, dpo_cfgs, inputs)
    if cfg.best_of_n:
        for p in best_of_n_points(
            inputs["sft_model"],
            inputs["tokenizer"],
            prompts,
            draws,
            measures=measures,
            ns=cfg.best_of_n,
            num_samples=cfg.best_of_n_samples,
        ):
            points.append({"method": "best_of_n", "label": f"n {p['n']}", **p})
    metrics = {
        **summarize_comparison(points, {method: log for method, _, _, log in rl_runs}),
        "runs": {method: run_record(folder, run_cfg) for method, folder, run_cfg, _ in rl_runs},
        "num_prompts": len(prompts),
        "gold_judge": ppo_cfg.gold_judge,
        "time_s": time.time() - started,
    }
    atomic_write_text(out / "points.jsonl", "".join(json.dumps(p) + "\n" for p in points))
    save_config(cfg, out)
    atomic_write_json(out / "metrics.json", metrics)  # last: marks the stage done
    print(format_summary(metrics))
    return metrics


def run_record(folder: str, run_cfg) -> dict[str, Any]:
    """Which RL run a method is: its folder, its name and its estimator (the report's labels)."""
    return {
        "ppo_dir": folder,
        "name": run_name(Path(folder)),
        "advantage_estimator": run_cfg.advantage_estimator,
        "samples_per_prompt": run_cfg.samples_per_prompt,
    }


def summarize_comparison(
    points: list[dict[str, Any]], rl_logs: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """The fits and the best gold of each method. Every law starts at the SFT model's gold (`sft_origin`): an RL
    run's own step-0 evaluation (else ppo_dir's), DPO's that of ppo_dir, best-of-n's its n = 1 point."""
    origin = sft_origin(rl_logs["ppo"])
    methods = [*rl_logs, "dpo", "best_of_n"]
    by_method = {m: [p for p in points if p["method"] == m] for m in methods}
    origins = {m: origin if sft_origin(log) is None else sft_origin(log) for m, log in rl_logs.items()}
    origins["dpo"] = origin
    origins["best_of_n"] = next((p["gold_score"] for p in by_method["best_of_n"] if p["n"] == 1), origin)
    fits = {
        m: law_fit(by_method[m], origins[m], "bon" if m == "best_of_n" else "rl")
        if origins[m] is not None
        else None
        for m in methods
    }
    best = {}
    for method, ps in by_method.items():
        if ps:
            top = max(ps, key=lambda p: p["gold_score"])
            best[method] = {"gold_score": top["gold_score"], "kl": top["kl"], "label": top["label"]}
    return {
        **{f"{method}_best_gold": b["gold_score"] for method, b in best.items()},
        "best": best,
        "fits": fits,
    }


METHODS = ("ppo", "dpo", "best_of_n")
POINT_KEYS = ("kl", "rm_score", "reward_fn", "gold_score", "sentiment", "fluency_perplexity")


def format_summary(metrics: dict[str, Any]) -> str:
    """The best gold of each method and where, then each fit."""
    lines = [f"{'method':<12}{'best gold':>10}{'at KL':>8}  point"]
    for method, b in metrics["best"].items():
        lines.append(f"{method:<12}{b['gold_score']:>+10.3f}{b['kl']:>8.2f}  {b['label']}")
    for method, fit in metrics["fits"].items():
        if fit:
            flag = "  (poor fit)" if fit["poor"] else ""
            lines.append(
                f"fit {method} ({fit['form']}): alpha {fit['alpha']:.3f} +/- {fit['alpha_stderr']:.3f}, "
                f"beta {fit['beta']:.3f} +/- {fit['beta_stderr']:.3f}, R^2 {fit['r2']:.2f}{flag}"
            )
    return "\n".join(lines)
