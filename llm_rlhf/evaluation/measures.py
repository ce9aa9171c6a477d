"""Sampling a policy on prompts and measuring what it wrote: what `llm-rlhf eval` (`llm_rlhf.stages.evaluate`),
PPO's held-out evaluations (`llm_rlhf.ppo.heldout.evaluate_heldout`) and `llm-rlhf compare` share.

    sample_batch         left-padded batched sampling with its own seed, the global RNG untouched
    sequence_kl_to_ref   each sample's k1 KL to a reference (at temperature 1 and at the sampling temperature)
    sample_and_score     one record per prompt: the response, its scores' parts (the one `Scorer` PPO adds at
                         the last token), the gold judge's, the verifier's verdict, the KL, length and EOS
    summarize_records    the records' means and standard errors, diversity and degeneracy figures
    evaluate_policy      all of it for one already-loaded policy (PPO's held-out evaluation); heldout_record
                         makes its line of eval_log.jsonl, load_heldout_inputs reads a PPO config's held-out
                         prompts and gold judge

The metrics first: small pure functions over lists of scores and token ids.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from llm_rlhf.core.data import load_prompt_dataset, prompt_rules
from llm_rlhf.core.errors import UserError
from llm_rlhf.evaluation import metric_names
from llm_rlhf.evaluation.hacking import COLLAPSE_KEYS, DEGENERACY_KEYS, collapse_rates, degeneracy_rates
from llm_rlhf.models import trunk
from llm_rlhf.models.gold import judge_pairs, load_judge
from llm_rlhf.models.loading import (
    load_tokenizer,
)
from llm_rlhf.models.reward_fn import RewardFn, load_reward_fn, probe
from llm_rlhf.models.scoring import Scorer, Scores
from llm_rlhf.rl import ppo_math, token_math
from llm_rlhf.rl.episodes import (
    EPISODE_FIGURES,
    EpisodePlay,
    episode_figures,
    episode_record,
    run_episodes,
)
from llm_rlhf.rl.rollout import (
    Samples,
    Sampling,
    encode_prompt,
    left_pad,
    response_logits,
    sample,
)

# ---------------------------------------------------------------------------------------------
# Metrics: small pure functions
# ---------------------------------------------------------------------------------------------


def win_rate(scores: list[float], baseline_scores: list[float]) -> float:
    """Fraction of pairs where scores[i] > baseline_scores[i]; a tie counts one half."""
    if len(scores) != len(baseline_scores) or not scores:
        raise ValueError(
            f"need two equally long, non-empty lists (got {len(scores)} and {len(baseline_scores)})"
        )
    return sum(win_points(scores, baseline_scores)) / len(scores)


def win_points(scores: list[float], baseline_scores: list[float]) -> list[float]:
    """Per pair: 1 for a win, 0.5 for a tie, 0 for a loss."""
    return [1.0 if a > b else 0.5 if a == b else 0.0 for a, b in zip(scores, baseline_scores)]


def distinct_n(sequences: list[list], n: int) -> float:
    """Unique n-grams / total n-grams, pooled over all sequences (0.0 when there is no n-gram)."""
    grams = [tuple(seq[i : i + n]) for seq in sequences for i in range(len(seq) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample std / sqrt(n); 0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n)


def mean_and_stderr_over_prompts(values: list[float], samples_per_prompt: int) -> tuple[float, float]:
    """Mean and standard error with each prompt counted once: `values` holds samples_per_prompt consecutive
    values per prompt (prompt-major, as `llm-rlhf eval` lays out its samples). Each prompt's values are
    averaged first, m_i = mean_j values[i, j], then `mean_and_stderr` over the n prompts: sd(m, n - 1) / sqrt(n).
    The mean is the mean over all values; the stderr is not the one over the samples, which would count a
    prompt's samples as independent draws of the task (they share the prompt: an easy problem is easy for all)."""
    k = samples_per_prompt
    if k < 1 or not values or len(values) % k:
        raise ValueError(f"{len(values)} values are not whole groups of samples_per_prompt={k}")
    per_prompt = [sum(values[i : i + k]) / k for i in range(0, len(values), k)]  # (n,) m_i
    return mean_and_stderr(per_prompt)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code", eq. 1): the chance that k of the n, drawn without replacement,
    hold a correct one,

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

    (the product is the paper's numerically stable form; 1 when n - c < k). Worked example
    (tests/evaluation/test_pass_at_k.py): n = 4, c = 2: pass@1 = 1/2, pass@2 = 5/6, pass@3 = pass@4 = 1.
    Raises ValueError unless 0 <= c <= n and 1 <= k <= n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n = {n}, c = {c}, k = {k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_and_stderr(verdicts: list[float], samples_per_prompt: int, k: int) -> tuple[float, float]:
    """pass@k over the prompts and its standard error: `verdicts` holds samples_per_prompt = n consecutive
    verdicts (1.0 / 0.0) per prompt; each prompt's `pass_at_k` estimate from its c correct, then
    `mean_and_stderr` over the prompts (sd with n - 1, over sqrt(prompts)): the spread of the tasks, as for
    the accuracy (`mean_and_stderr_over_prompts`; pass@1 is the accuracy and its stderr)."""
    n = samples_per_prompt
    if n < 1 or not verdicts or len(verdicts) % n:
        raise ValueError(f"{len(verdicts)} verdicts are not whole groups of samples_per_prompt={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs k <= samples_per_prompt ({n}) samples of each prompt")
    correct = [round(sum(verdicts[i : i + n])) for i in range(0, len(verdicts), n)]
    return mean_and_stderr([pass_at_k(n, c, k) for c in correct])


# ---------------------------------------------------------------------------------------------
# Sampling and scoring
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PairedSampling:
    """How evaluation samples, so that two models' samples pair up: the prompts cut into the same batches of
    `batch_size`, batch b drawn with `sampling` after torch.manual_seed(seed + b) (in a fork of the RNG)."""

    sampling: Sampling
    seed: int = 0
    batch_size: int = 32
    play: EpisodePlay | None = None  # episodes of several turns with an environment

    def greedy(self) -> PairedSampling:
        """The same batches and ends (EOS, stop_strings, min_new_tokens, max_new_tokens), decoded greedily:
        temperature 0, the argmax at every token (`rollout.Sampling`), no random draw, so the same responses
        whatever the seed."""
        return dataclasses.replace(self, sampling=dataclasses.replace(self.sampling, temperature=0.0))


@dataclass(frozen=True)
class KLReference:
    """pi_ref of kl_to_ref: a causal LM, and with LoRA the context that turns the policy's adapter off (the
    reference is then the policy's own network, `lm.disable_adapter`). shared_blocks: K, the leading blocks
    whose output is the same in the policy and the reference (`llm_rlhf.models.trunk`: the blocks below
    the adapters, or `shared_block_count` of two loaded models), computed once for both; 0 = none."""

    lm: Any
    context: Any = None
    shared_blocks: int = 0


def _rng_devices(device: torch.device) -> list:
    return [device] if device.type == "cuda" else []


@torch.no_grad()
def sample_batch(model, tokenizer, prompts: list[str], sampling: Sampling, *, seed: int) -> Samples:
    """Left-padded batched `generate` (HF derives the positions from the attention mask), seeded with
    `seed` without touching the global RNG; stops at EOS (possibly at once, unless min_new_tokens) or at a
    stop string, sampled as in PPO (`rollout.sample`)."""
    device = next(model.parameters()).device
    queries = [encode_prompt(tokenizer, p) for p in prompts]  # as PPO, SFT and the RM tokenize prompts
    if any(len(q) == 0 for q in queries):
        raise UserError("a prompt tokenizes to no tokens; every prompt needs at least one")
    query, query_mask = left_pad(queries, tokenizer.pad_token_id, device)  # (B, P) each
    with torch.random.fork_rng(devices=_rng_devices(device)):
        torch.manual_seed(seed)
        return sample(model, tokenizer, query, query_mask, sampling)


@torch.no_grad()
def play_batch(model, tokenizer, prompts: list[str], sampling: Sampling, play: EpisodePlay, *, seed: int):
    """`sample_batch` for episodes: one episode per prompt with a fresh environment (`episodes.run_episodes`),
    seeded with `seed` without touching the global RNG. Returns the episodes as `Samples` and the `Episode`s."""
    device = next(model.parameters()).device
    queries = [encode_prompt(tokenizer, p) for p in prompts]
    if any(len(q) == 0 for q in queries):
        raise UserError("a prompt tokenizes to no tokens; every prompt needs at least one")
    with torch.random.fork_rng(devices=_rng_devices(device)):
        torch.manual_seed(seed)
        return run_episodes(
            model, tokenizer, queries, play.make_environment, sampling, play.limits, device=device
        )


@torch.no_grad()
def sequence_kl_to_ref(
    model, reference: KLReference, batch: Samples, sampling: Sampling, *, eos_token_id: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """k1 sequence KL of each sample, sum_t log pi(y_t|s_t) - log pi_ref(y_t|s_t) over its response tokens,
    with both log-probs at temperature 1 and at the sampling temperature, both from logits with EOS masked
    before min_new_tokens as in sampling (`token_math.mask_eos_logits`, as PPO). Returns two (B,) tensors.

    A model that is its own reference (the baseline of an evaluation whose reference is the baseline: the SFT
    model of the default pipeline, the instruct model of the arithmetic recipe) is not run twice: the second
    forward would give the same logits bit for bit, so its KL is exactly 0 either way. With
    `reference.shared_blocks` = K > 0 the first K blocks run once, in the model's forward, and both forwards
    start from their output (the same logits as two full forwards, bit for bit)."""
    mask = dict(eos_token_id=eos_token_id, min_new_tokens=sampling.min_new_tokens)
    own = reference.lm is model and reference.context is None
    k = 0 if own else reference.shared_blocks
    hidden = trunk.trunk_states(model, k, response_logits, model, batch) if k else None  # (B, P + R, H)

    def logits_of(lm) -> torch.Tensor:
        with trunk.from_trunk(lm, hidden, k) if k else nullcontext():
            return token_math.mask_eos_logits(logits=response_logits(lm, batch), **mask)  # (B, R, V)

    logits = logits_of(model)
    if own:
        ref_logits = logits
    else:
        with reference.context() if reference.context is not None else nullcontext():
            ref_logits = logits_of(reference.lm)
    out = []
    for tau in (1.0, sampling.temperature):
        logprobs = token_math.logprobs_from_logits(
            logits=logits, labels=batch.response, temperature=tau
        )  # (B, R)
        ref_logprobs = token_math.logprobs_from_logits(
            logits=ref_logits, labels=batch.response, temperature=tau
        )
        kl = ppo_math.kl_penalty(logprobs=logprobs, ref_logprobs=ref_logprobs, estimator="k1")  # (B, R)
        out.append(ppo_math.sequence_kl(kl=kl, response_mask=batch.response_mask))  # (B,)
    return out[0], out[1]


def _floats(x: torch.Tensor | None, i: int) -> float | None:
    return float(x[i]) if x is not None else None


@dataclass(frozen=True)
class Measures:
    """What scores a sample beside its KL, each None to skip its figures: the scorer (PPO's score,
    `scoring.Scorer`: the reward model or ensemble and the reward function), the gold judge (any (prompts,
    responses) -> list[float], `gold.load_judge`) and the verifier (a loaded accuracy_fn, `load_verifier`)."""

    scorer: Scorer | None = None
    judge: Any = None
    verifier: RewardFn | None = None


@torch.no_grad()
def sample_and_score(
    model,
    tokenizer,
    prompts: list[str],
    draws: PairedSampling,
    *,
    measures: Measures = Measures(),
    reference: KLReference | None = None,
    progress: str | None = None,
) -> list[dict[str, Any]]:
    """One record per prompt: prompt, response (text; a stop string that ended it is kept, as the RM scored
    it), response_ids (EOS excluded), length (tokens, EOS included), eos (ended: EOS or a stop string),
    kl_to_ref and kl_to_ref_at_temperature (None without `reference`), then the `measures.scorer`'s parts (PPO's
    score, `scoring.Scorer`): rm_score (None without a reward model; a `RewardEnsemble`'s combined score),
    rm_member_scores (a list of K floats) and rm_disagreement (their population std; both None unless the
    reward model is an ensemble), reward_fn (None without a reward function: its unweighted score of the
    prompt and the response text) and combined_score (rm_score + reward_fn_weight * reward_fn, the score PPO
    maximises; None without a reward function), then gold_score (None without a judge) and sentiment,
    fluency_nll, fluency_perplexity (None unless the judge reports them, as the fluency-aware gold does; each
    distinct (prompt, response) judged once, `llm_rlhf.models.gold.judge_pairs`), then correct: the verifier's verdict
    on the prompt and the response text, 1.0 or 0.0 (None without a verifier: `accuracy_fn`). Batch b is
    sampled with seed + b (`PairedSampling`)."""
    if not prompts:
        raise ValueError("no prompts to sample")
    sampling, scorer = draws.sampling, measures.scorer
    records: list[dict[str, Any]] = []
    starts = range(0, len(prompts), draws.batch_size)
    for b, start in enumerate(tqdm(starts, desc=progress, disable=progress is None, leave=False)):
        chunk = prompts[start : start + draws.batch_size]
        played = None
        if draws.play is None:
            batch = sample_batch(model, tokenizer, chunk, sampling, seed=draws.seed + b)
        else:  # an episode per prompt with its environment, the same seeds
            batch, played = play_batch(model, tokenizer, chunk, sampling, draws.play, seed=draws.seed + b)
        kls = (
            sequence_kl_to_ref(model, reference, batch, sampling, eos_token_id=tokenizer.eos_token_id)
            if reference is not None
            else (None, None)
        )
        scores = scorer(batch, tokenizer, chunk) if scorer is not None else Scores(None)
        records += batch_records(chunk, batch, tokenizer, kls, scores)
        for record, episode in zip(records[len(records) - len(chunk) :], played or []):
            record.update(episode_record(episode, tokenizer))  # the transcript, turns, tool calls
    texts = [r["prompt"] for r in records], [r["response"] for r in records]
    if measures.judge is not None:
        parts = judge_pairs(measures.judge, *texts)
        for i, record in enumerate(records):
            record.update({key: values[i] for key, values in parts.items() if key in record})
    if measures.verifier is not None:  # one checked call: every verdict 1.0 or 0.0 (`load_verifier`)
        for record, verdict in zip(records, measures.verifier(*texts)):
            record["correct"] = verdict
    return records


def batch_records(
    prompts: list[str], batch: Samples, tokenizer, kls: tuple, scores: Scores
) -> list[dict[str, Any]]:
    """`sample_and_score`'s records of one sampled batch: the response, its length and end, its two KLs
    (None each without a reference) and the scorer's parts; the judge's and the verifier's keys None."""
    combined = scores.scores if scores.reward_fn is not None else None  # (B,) the sum PPO maximises
    eos = (batch.response == tokenizer.eos_token_id) & batch.response_mask  # (B, R) the first EOS, if any
    ended = batch.ended(tokenizer.eos_token_id)  # (B,) EOS or a stop string
    records = []
    for i, prompt in enumerate(prompts):
        ids = batch.response[i][batch.response_mask[i] & ~eos[i]].tolist()  # the response without its EOS
        records.append(
            {
                "prompt": prompt,
                "response": tokenizer.decode(ids, skip_special_tokens=True),
                "response_ids": ids,
                "length": int(batch.response_mask[i].sum()),
                "eos": bool(ended[i]),
                "kl_to_ref": _floats(kls[0], i),
                "kl_to_ref_at_temperature": _floats(kls[1], i),
                "rm_score": _floats(scores.rm_score, i),
                "rm_member_scores": (
                    scores.member_scores[:, i].tolist() if scores.member_scores is not None else None
                ),
                "rm_disagreement": _floats(scores.disagreement, i),
                "reward_fn": _floats(scores.reward_fn, i),
                "combined_score": _floats(combined, i),
                "gold_score": None,
                "sentiment": None,
                "fluency_nll": None,
                "fluency_perplexity": None,
                "correct": None,
            }
        )
    return records


def greedy_records(model, tokenizer, prompts: list[str], draws: PairedSampling, verifier: RewardFn):
    """One greedy response per prompt (`PairedSampling.greedy`: the argmax at every token, in draws' batches,
    ending as draws' responses end), with the verifier's verdict: `sample_and_score`'s records, `correct` set
    and nothing else scored."""
    return sample_and_score(model, tokenizer, prompts, draws.greedy(), measures=Measures(verifier=verifier))


ACCURACY_KEYS = metric_names.ACCURACY_KEYS


def accuracy_figures(
    sampled: list[dict[str, Any]],
    greedy: list[dict[str, Any]] | None,
    *,
    samples_per_prompt: int = 1,
    suffix: str = "",
    pass_at: Sequence[int] = (),
) -> dict[str, float | None]:
    """`ACCURACY_KEYS` (+ suffix) from the verdicts (`correct`) of one model's records: accuracy, the mean over
    the sampled records (samples_per_prompt consecutive records per prompt), accuracy_greedy the mean over the
    greedy records (one per prompt), each with its standard error over the prompts
    (`mean_and_stderr_over_prompts`); for each k of pass_at, pass_at_<k> and pass_at_<k>_stderr
    (`pass_at_k_and_stderr`, `metric_names.pass_at_keys`). All None when greedy is None (no verifier: not
    measured)."""
    keys = ACCURACY_KEYS + tuple(key for k in pass_at for key in metric_names.pass_at_keys(k))
    if greedy is None:
        return {key + suffix: None for key in keys}
    verdicts = [r["correct"] for r in sampled]
    accuracy, stderr = mean_and_stderr_over_prompts(verdicts, samples_per_prompt)
    accuracy_greedy, greedy_stderr = mean_and_stderr_over_prompts([r["correct"] for r in greedy], 1)
    figures = [accuracy, stderr, accuracy_greedy, greedy_stderr]
    for k in pass_at:
        figures.extend(pass_at_k_and_stderr(verdicts, samples_per_prompt, k))
    return {key + suffix: value for key, value in zip(keys, figures)}


def load_verifier(spec: str, prompts: Sequence[str]) -> RewardFn:
    """`accuracy_fn: <callable>` loaded as a reward function is (`reward_fn.load_reward_fn`: its errors name
    accuracy_fn, and every score must be 1.0 or 0.0) and probed the same way (`reward_fn.probe`, on the first
    two prompts with dummy responses): a broken verifier, or one that grades, stops the run with one line
    before any model loads."""
    verifier = load_reward_fn(spec, key="accuracy_fn", binary=True)
    probe(verifier, prompts)
    return verifier


def summarize_records(
    records: list[dict[str, Any]], suffix: str = "", samples_per_prompt: int = 1
) -> dict[str, float | None]:
    """Means over the samples of one model, and standard errors over the prompts (`records` prompt-major,
    samples_per_prompt consecutive records per prompt: `mean_and_stderr_over_prompts`); keys end with `suffix`."""
    out: dict[str, float | None] = {}
    for key, name in (
        (metric_names.GOLD_SCORE, metric_names.GOLD_SCORE_MEAN),
        (metric_names.SENTIMENT, metric_names.SENTIMENT_MEAN),
        (metric_names.RM_SCORE, metric_names.RM_SCORE_MEAN),
        (metric_names.REWARD_FN, metric_names.REWARD_FN_MEAN),
        (metric_names.COMBINED_SCORE, metric_names.COMBINED_SCORE_MEAN),
        (metric_names.KL_TO_REF, metric_names.KL_TO_REF),
        (metric_names.KL_TO_REF_AT_TEMPERATURE, metric_names.KL_TO_REF_AT_TEMPERATURE),
    ):
        values = [r.get(key) for r in records]
        mean, stderr = None, None
        if None not in values:  # the mean over the samples, its standard error over the prompts
            mean = mean_and_stderr(values)[0]
            stderr = mean_and_stderr_over_prompts(values, samples_per_prompt)[1]
        out[name + suffix] = mean
        out[name.removesuffix("_mean") + metric_names.STDERR + suffix] = stderr
    nll = [r["fluency_nll"] for r in records]  # geometric mean of the per-response perplexities:
    out[metric_names.FLUENCY_PERPLEXITY + suffix] = (
        math.exp(mean_and_stderr(nll)[0]) if None not in nll else None
    )
    out[metric_names.RESPONSE_LENGTH_MEAN + suffix] = mean_and_stderr([r["length"] for r in records])[0]
    out[metric_names.EOS_RATE + suffix] = mean_and_stderr([float(r["eos"]) for r in records])[0]
    out[metric_names.DISTINCT_1 + suffix] = distinct_n([r["response_ids"] for r in records], 1)
    out[metric_names.DISTINCT_2 + suffix] = distinct_n([r["response_ids"] for r in records], 2)
    responses = [r["response"] for r in records]
    out.update(degeneracy_rates(responses, suffix))  # the hacking watch's degeneracy counters
    # a policy collapsed onto one phrase trips no degeneracy counter, hence the collapse counters; a repeat
    # counts across prompts, and not where the verifier judged it correct: a terse policy's right answers repeat
    prompts, verdicts = [r["prompt"] for r in records], [r.get("correct") for r in records]
    correct = verdicts if None not in verdicts else None
    out.update(collapse_rates(responses, prompts=prompts, correct=correct, suffix=suffix))
    if records[0].get("rm_member_scores") is not None:  # an ensemble: each member, and their disagreement
        per_member = zip(*[r["rm_member_scores"] for r in records])  # K tuples of one score per sample
        for k, scores in enumerate(per_member):
            out[f"{metric_names.RM_SCORE_MEMBER}{k}_mean" + suffix] = mean_and_stderr(list(scores))[0]
        out[metric_names.RM_DISAGREEMENT_MEAN + suffix] = mean_and_stderr(
            [r["rm_disagreement"] for r in records]
        )[0]
    return out


def evaluate_policy(
    policy,
    tokenizer,
    prompts: list[str],
    draws: PairedSampling,
    *,
    measures: Measures = Measures(),
    reference: KLReference | None = None,
    samples_out: list[dict[str, Any]] | None = None,
    samples_per_prompt: int = 1,
    pass_at: Sequence[int] = (),
) -> dict[str, float | None]:
    """Sample samples_per_prompt responses per prompt from `policy` and score them: for evaluation during
    training.

    policy: a causal LM (e.g. PPO's `policy.lm` unwrapped from DDP); reference: a `KLReference` (the
    reference's `lm`; with LoRA the policy's `lm` again with `context=lm.disable_adapter`), None to skip the
    KL; measures: the scorer (as PPO scores), the gold judge and the verifier (`Measures`). Deterministic for a
    given seed, and the global RNG is left untouched. The policy is put in eval mode for the call and restored.
    Returns `summarize_records`'s keys: gold_score_mean, rm_score_mean, reward_fn_mean, combined_score_mean,
    kl_to_ref, kl_to_ref_at_temperature, response_length_mean, eos_rate, distinct_1, distinct_2, the degeneracy rates
    (+ stderrs), and `ACCURACY_KEYS`: with a verifier (a loaded `accuracy_fn`, `load_verifier`) accuracy, the
    verifier's mean over these samples, and accuracy_greedy over one more, greedy response per prompt
    (`greedy_records`; no random draw), each with its stderr over the prompts; None without one. samples_out:
    a list that gets `sample_and_score`'s per-sample records appended (PPO logs them for the report's
    reward-hacking watch); None = not kept. samples_per_prompt: n responses to each prompt (consecutive
    records; the standard errors count each prompt once), pass_at: the k of each pass@k to report from them
    (`accuracy_figures`, with a verifier; k <= n).
    """
    was_training = policy.training
    policy.eval()
    prompts = list(prompts)
    rows = [prompt for prompt in prompts for _ in range(samples_per_prompt)]  # prompt-major
    try:
        records = sample_and_score(policy, tokenizer, rows, draws, measures=measures, reference=reference)
        verifier = measures.verifier
        greedy = greedy_records(policy, tokenizer, prompts, draws, verifier) if verifier is not None else None
    finally:
        policy.train(was_training)
    if samples_out is not None:
        samples_out.extend(records)
    n = samples_per_prompt
    return {
        **summarize_records(records, samples_per_prompt=n),
        **accuracy_figures(records, greedy, samples_per_prompt=n, pass_at=pass_at),
        **episode_figures(records),
    }


def load_heldout_inputs(cfg, tokenizer=None) -> tuple[list[str], Any]:
    """A PPO config's held-out prompts (the first eval_num_prompts of eval_prompt_file) and its gold judge, or
    nothing when its held-out evaluation is off (eval_every 0 or no eval_prompt_file). `compare` reads a PPO
    run's the same way. tokenizer: the policy's (chat prompts are rendered with it), else model_name_or_path's."""
    if not cfg.eval_every or not cfg.eval_prompt_file:
        return [], None
    tokenizer = tokenizer or load_tokenizer(cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code)
    prompts = load_prompt_dataset(cfg.eval_prompt_file, tokenizer, **prompt_rules(cfg))["prompt"]
    return list(prompts[: cfg.eval_num_prompts]), load_judge(cfg.gold_judge)


def heldout_record(step: int, result: dict[str, Any]) -> dict[str, Any]:
    """One line of PPO's eval_log.jsonl from `evaluate_policy`'s figures: step, kl, rm_score (with an ensemble
    also rm_score_member_<k> and rm_disagreement), gold_score, reward_fn (unweighted; None without one),
    sentiment, fluency_perplexity, eos_rate, response_length, the degeneracy rates (`hacking.DEGENERACY_KEYS`),
    the collapse counters (`hacking.COLLAPSE_KEYS`) and num_responses (their N, which the alarm's tests read),
    accuracy, accuracy_stderr, accuracy_greedy, accuracy_greedy_stderr (`ACCURACY_KEYS`; None without an
    accuracy_fn), and what the alarm's proxy-up /
    gold-down rule reads (`hacking.trajectory_point`): gold_score_stderr, and proxy with proxy_stderr, the mean
    and standard error of the score PPO maximised (combined_score with a reward function, else rm_score)."""
    members = {
        key.removesuffix("_mean"): value
        for key, value in result.items()
        if key.startswith((metric_names.RM_SCORE_MEMBER, metric_names.LOG_RM_DISAGREEMENT))
    }  # only with an ensemble
    with_fn = result[metric_names.COMBINED_SCORE_MEAN] is not None  # the proxy: what PPO maximised
    proxy, proxy_stderr = (
        (metric_names.COMBINED_SCORE_MEAN, metric_names.COMBINED_SCORE_STDERR)
        if with_fn
        else (metric_names.RM_SCORE_MEAN, metric_names.RM_SCORE_STDERR)
    )
    return {
        metric_names.LOG_STEP: step,
        metric_names.LOG_KL: result[metric_names.KL_TO_REF],
        metric_names.RM_SCORE: result[metric_names.RM_SCORE_MEAN],
        **members,
        metric_names.GOLD_SCORE: result[metric_names.GOLD_SCORE_MEAN],
        metric_names.REWARD_FN: result[metric_names.REWARD_FN_MEAN],
        metric_names.SENTIMENT: result[metric_names.SENTIMENT_MEAN],
        metric_names.FLUENCY_PERPLEXITY: result[metric_names.FLUENCY_PERPLEXITY],
        metric_names.EOS_RATE: result[metric_names.EOS_RATE],
        metric_names.LOG_RESPONSE_LENGTH: result[metric_names.RESPONSE_LENGTH_MEAN],
        **{key: result[key] for key in DEGENERACY_KEYS},
        **{key: result[key] for key in (*COLLAPSE_KEYS, metric_names.NUM_RESPONSES)},
        **{key: result[key] for key in ACCURACY_KEYS},
        **{key: value for key, value in result.items() if key.startswith(metric_names.PASS_AT)},
        metric_names.GOLD_SCORE_STDERR: result[metric_names.GOLD_SCORE_STDERR],
        metric_names.LOG_PROXY: result[proxy],
        metric_names.LOG_PROXY_STDERR: result[proxy_stderr],
        **{
            key: result[key] for key in EPISODE_FIGURES if result.get(key) is not None
        },  # episodes of several turns
    }
