"""The rollout collector: where PPO's episodes come from, apart from the update.

    prompts in  -> token ids (query | response), their masks, the sampler's log-probs, the scores and their parts

`RolloutCollector` holds the prompt stream (a seeded permutation per pass; the data position follows from the step,
`queries`), sampling (`generate`: the policy's own sampler, `rl.rollout.sample`), scoring (`score`: the one
`Scorer` of the reward model(s) and the reward function, its failures agreed over the processes) and DAPO's
dynamic sampling (`collect_untied`: rounds of groups until enough are untied, the selection, its statistics).
What it hands the trainer is `Samples` and `Scores` (`KeptGroups` for dynamic sampling): the trainer
(`llm_rlhf.ppo.trainer.PPOTrainer`) runs the policy's, the value's and the reference's forwards on them and the update.
Episodes of several turns are `EpisodeCollector`: the same methods, `generate` playing episodes with an
environment; another sampling back-end would be another collector with the same methods: `queries`, `in_groups`,
`generate`, `score`, `collect_untied`, `state_dict`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from llm_rlhf.core.errors import UserError
from llm_rlhf.models.scoring import Scorer, Scores
from llm_rlhf.ppo import metrics as ppo_metrics
from llm_rlhf.ppo.context import PPOContext, UsesContext
from llm_rlhf.rl import loss_math
from llm_rlhf.rl.episodes import Episode, EpisodeLimits, no_turn_played, run_episodes
from llm_rlhf.rl.rollout import Samples, Sampling, left_pad, sample


@dataclass
class KeptGroups:
    """Dynamic sampling's rollout before the forwards: the kept rows (`samples`, rollout_batch_size groups of
    samples_per_prompt rows on this process) and their `scores`; `dropped`, the rows sampled and not kept
    (None when every sampled row is kept), whose KL the controller still reads; the sampling/* statistics."""

    samples: Samples
    scores: Scores
    dropped: Samples | None
    stats: dict[str, float] = field(default_factory=dict)


def concat_samples(parts: list[Samples], pad_token_id: int) -> Samples:
    """The rows of several `Samples` in one (dynamic sampling's rounds), in order: the queries left-padded to
    the widest (pad_token_id, mask 0), the responses already max_new_tokens wide (`generate` pads them).

        round 1   pad q q | r r        round 2   q q q | r r     ->   pad q q | r r
                                                                      q   q q | r r
    """
    width = max(p.query.shape[1] for p in parts)  # P
    out = {}
    for f in dataclasses.fields(Samples):
        xs = [getattr(p, f.name) for p in parts]
        if xs[0] is None:
            out[f.name] = None
            continue
        if f.name in ("query", "query_mask"):  # (b, P_i) -> (b, P): columns added on the left
            fill = pad_token_id if f.name == "query" else 0
            xs = [torch.nn.functional.pad(x, (width - x.shape[1], 0), value=fill) for x in xs]
        out[f.name] = torch.cat(xs)  # (sum b, ...)
    return Samples(**out)


def concat_scores(parts: list[Scores], rows: torch.Tensor) -> Scores:
    """The rows `rows` (long, into the concatenation) of several `Scores` in one; member_scores is (K, B)."""
    out = {}
    for f in dataclasses.fields(Scores):
        xs = [getattr(p, f.name) for p in parts]
        if xs[0] is None:
            out[f.name] = None
        elif f.name == "member_scores":
            out[f.name] = torch.cat(xs, dim=1)[:, rows.to(xs[0].device)]  # (K, len(rows))
        else:
            out[f.name] = torch.cat(xs)[rows.to(xs[0].device)]  # (len(rows),)
    return Scores(**out)


class RolloutCollector(UsesContext):
    """Prompts, sampling, scoring and dynamic sampling for `PPOTrainer` (the module docstring).

    context: the trainer's `PPOContext` (config, processes, device plumbing, batch sizes, tokenizer, reductions);
    policy (as prepared: unwrapped to sample), prompts (token-id lists), sampling (`Sampling.of`); scorer: the
    `Scorer` of PPO's scores; verifier: the task's loaded accuracy_fn or None (dynamic sampling ties on its
    verdicts). `extra_prompts` (the global prompts dynamic sampling's further rounds drew) is its state."""

    def __init__(
        self,
        context: PPOContext,
        *,
        policy,
        prompts: list[list[int]],
        sampling: Sampling,
        scorer: Scorer,
        verifier=None,
    ):
        self.context, self.policy, self.prompts, self.sampling = context, policy, prompts, sampling
        self.scorer, self.verifier = scorer, verifier
        self.verifier_scorer = Scorer(None, verifier)  # its Scores.reward_fn: the verdicts, 1.0 / 0.0
        self.extra_prompts = 0  # global prompts drawn by dynamic sampling's further rounds (`queries`)

    def state_dict(self) -> dict[str, Any]:
        """With dynamic sampling the prompts its further rounds drew (the rest of the data position)."""
        return {"extra_prompts": self.extra_prompts} if self.cfg.dynamic_sampling else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.extra_prompts = state.get("extra_prompts", 0)

    # --- prompts ---------------------------------------------------------------------------------

    def queries(self, step: int) -> list[list[int]]:
        """This process's prompts for `step` (rollout_batch_size of them): a seeded permutation per pass over
        the data.

        Global prompt index e = step * prompts_per_step + process_index * rollout_batch_size + i, so the data
        position follows from the step alone (exact resume) and processes never share a prompt. Each prompt is
        then sampled samples_per_prompt times on this process (`in_groups`).
        With dynamic sampling, its further rounds draw the next prompts of the same stream: e is shifted by the
        global prompts they drew so far (`extra_prompts`, in the checkpoint).
        """
        n, per_step = len(self.prompts), self.sizes.prompts_per_step
        start = (
            step * per_step
            + self.extra_prompts
            + self.accelerator.process_index * self.sizes.prompts_per_process
        )
        out = []
        for e in range(start, start + self.sizes.prompts_per_process):
            epoch, i = divmod(e, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.seed * 100003 + epoch))
            out.append(self.prompts[perm[i]])
        return out

    def in_groups(self, queries: list[list[int]]) -> list[list[int]]:
        """Each query k = samples_per_prompt times in consecutive rows, the layout of `ppo_math.scores_by_prompt`:

            queries   q0 q1             k = 3
            rows      q0 q0 q0 q1 q1 q1      (row = prompt_index * k + sample_index)

        A group is on one process and is sampled in one `generate` call; with k = 1 the queries themselves."""
        return [q for q in queries for _ in range(self.cfg.samples_per_prompt)]

    # --- sampling and scoring ----------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, queries: list[list[int]], sampling: Sampling | None = None) -> Samples:
        """Sample responses with the KV cache from the global RNG (`self.sampling`, or `sampling`: greedy draws
        no random number); R = max_new_tokens on every process."""
        query, query_mask = left_pad(queries, self.tokenizer.pad_token_id, self.device)  # (B, P) each
        policy = self.accelerator.unwrap_model(self.policy)
        with self.accelerated.autocast(), self.accelerated.gathered_for_generation(policy):
            return sample(
                policy.lm,
                self.tokenizer,
                query,
                query_mask,
                sampling or self.sampling,
                pad_to_max_new_tokens=True,
            )

    @torch.no_grad()
    def score(self, samples: Samples) -> Scores:
        """The scores of this process's samples and their parts (`scoring.Scorer`, the one scorer evaluation
        uses too):

            scores = rm_score + reward_fn_weight * reward_fn(prompts, responses)      (B,)

        These are the scores `PPOTrainer.ppo_step` clips (score_clip), replaces for responses without EOS (eos_penalty)
        and adds at the last response token (`ppo_math.shaped_rewards`), and then whitens only as part of the
        per-token rewards (whiten_rewards) and the advantages. The RM runs under the policy's precision.

        Each process calls the reward function on its own samples; nothing inside it is a collective.
        Whether the call failed on any process (it raised, or returned a wrong number of scores or a
        non-finite one: `RewardFn` checks) is one sum over the processes, so every process stops with the
        same one-line error here instead of the others waiting at the next collective (`agreed`).

        Zeros without a reward model and a reward function: an environment's rewards (`samples.env_rewards`) or a
        teacher's signal (on-policy distillation) is then the whole reward."""
        if self.scorer.reward_model is None and self.scorer.reward_fn is None:
            return Scores(torch.zeros(samples.query.shape[0], device=self.device))
        if self.scorer.reward_fn is None:
            return self.scorer(samples, self.tokenizer)
        return self.agreed(self.scorer.reward_fn, lambda: self.scorer(samples, self.tokenizer))

    def agreed(self, fn, call):
        """`call()`, which calls the user's function `fn` (a `RewardFn`: the reward_fn or the accuracy_fn), with
        whether it failed on any process summed over the processes: every process raises the same one-line
        UserError, none waits at a collective that a failed one never reaches."""
        try:
            out, error = call(), None
        except UserError as e:
            out, error = None, e
        failed = self.global_sum(torch.tensor(float(error is not None)))  # processes whose call failed
        if error is not None:
            raise error
        if failed > 0:
            raise UserError(f"{fn.key} '{fn.spec}' failed on another process (see its error)")
        return out

    # --- dynamic sampling --------------------------------------------------------------------------

    def collect_untied(self, queries: list[list[int]], step: int, times: dict[str, float]) -> KeptGroups:
        """DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2), before the forwards: rounds of groups until every
        process holds rollout_batch_size whose verdicts (or unshaped scores, `tie_scores`) do not all tie, or
        dynamic_sampling_max_rounds were sampled (`sample_rounds`); the first rollout_batch_size untied groups
        kept, filled up with tied ones when too few (`loss_math.select_groups`: every step trains the same
        number of groups), the others handed back as `dropped`.

        The statistics: sampling/rounds, sampling/groups_dropped (sampled groups not trained, over every
        process), sampling/tied_groups_trained (the fill, over every process), sampling/sampled_per_trained
        (responses sampled per response trained, over the run, this step's too) and sampling/scores_sampled
        (the mean score of every response sampled this step, the dropped groups' too: what the policy earns,
        where objective/scores, over the kept groups, is raised by the selection)."""
        sizes, k, need = self.sizes, self.cfg.samples_per_prompt, self.sizes.prompts_per_process
        samples, scores, tied = self.sample_rounds(queries, step, times)  # tied: (rounds * P,)
        groups = loss_math.select_groups(tied=tied, num_groups=need)  # (P,)
        rows = loss_math.group_rows(groups=groups, samples_per_prompt=k)  # (P * k,)
        sampled = concat_samples(samples, self.tokenizer.pad_token_id)
        dropped = torch.ones(sampled.query.shape[0], dtype=torch.bool)  # (rounds * P * k,)
        dropped[rows] = False
        counts = self.global_sum(
            torch.stack([torch.tensor(float(len(tied) - need)), tied[groups].sum().float()])
        )
        trained = (step + 1) * sizes.prompts_per_step  # global prompts trained on, this step's too
        drawn = trained + self.extra_prompts  # and sampled
        stats = {
            ppo_metrics.SAMPLING_ROUNDS: float(len(samples)),
            ppo_metrics.SAMPLING_GROUPS_DROPPED: float(counts[0]),
            ppo_metrics.SAMPLING_TIED_GROUPS_TRAINED: float(counts[1]),
            ppo_metrics.SAMPLING_SAMPLED_PER_TRAINED: drawn / trained,
            # every process sampled the same rounds of the same size: the mean of the processes' means
            ppo_metrics.SAMPLING_SCORES_SAMPLED: self.global_mean(
                torch.cat([s.scores for s in scores]).float()
            ),
        }
        return KeptGroups(
            samples=sampled.select(rows.to(self.device)),
            scores=concat_scores(scores, rows),
            dropped=sampled.select(dropped.nonzero().flatten().to(self.device)) if dropped.any() else None,
            stats=stats,
        )

    def sample_rounds(
        self, queries: list[list[int]], step: int, times: dict[str, float]
    ) -> tuple[list[Samples], list[Scores], torch.Tensor]:
        """Dynamic sampling's rounds: each samples and scores the groups of `queries` and marks the tied ones
        (`loss_math.tied_groups` on `tie_scores`); while some process holds fewer untied groups than
        rollout_batch_size (one global sum, so every process takes the same number of rounds and its
        collectives match) and the rounds are fewer than dynamic_sampling_max_rounds, the next prompts of the
        stream are sampled (`extra_prompts`). Returns each round's samples and scores, and tied (rounds * P,)."""
        cfg, sizes, k = self.cfg, self.sizes, self.cfg.samples_per_prompt
        samples, scores, tied = [], [], []
        while True:
            t0 = time.perf_counter()
            part = self.generate(self.in_groups(queries))  # y ~ pi_theta(.|x)
            t1 = time.perf_counter()
            part_scores = self.score(part)
            tied.append(
                loss_math.tied_groups(scores=self.tie_scores(part, part_scores), samples_per_prompt=k)
            )
            times["generate"] = times.get("generate", 0.0) + t1 - t0
            times["score"] = times.get("score", 0.0) + time.perf_counter() - t1
            samples.append(part)
            scores.append(part_scores)
            # the untied groups this process lacks
            missing = max(sizes.prompts_per_process - int((~torch.cat(tied)).sum()), 0)
            if (
                self.global_sum(torch.tensor(float(missing))) == 0
                or len(tied) == cfg.dynamic_sampling_max_rounds
            ):
                return samples, scores, torch.cat(tied)  # tied: (rounds * P,)
            self.extra_prompts += sizes.prompts_per_step
            queries = self.queries(step)

    def tie_scores(self, samples: Samples, scores: Scores) -> torch.Tensor:
        """What dynamic sampling compares within a group, (B,): the verifier's verdicts (accuracy_fn: 1.0 or
        0.0) where the task has one, else the scorer's scores as they came, before score_clip, the overlong
        penalty and the EOS penalty. DAPO filters on accuracy (Yu et al. 2025, sec. 3.2), so a group is not
        untied by a length penalty alone separating correct answers: on the shaped scores an all-correct group of different lengths was
        kept, and GRPO's division by the group's std made a length-only penalty into advantages of full size,
        (1.16, 0.39, -0.39, -1.16). With a verifier a group of partial credits that are all wrong
        ties too (its verdicts are all 0.0)."""
        if self.verifier is None:
            return scores.scores
        verdicts = self.agreed(self.verifier, lambda: self.verifier_scorer(samples, self.tokenizer))
        return verdicts.reward_fn  # (B,) float64, 1.0 / 0.0


class EpisodeCollector(RolloutCollector):
    """The collector of episodes of several turns (`llm_rlhf.rl.episodes`): the same prompts, scoring and
    state as `RolloutCollector`, and `generate` plays one episode per row with a fresh environment instance
    (`make_environment`), returning them as `Samples` whose response holds the policy's turns and the
    environment's replies (env_mask), each turn's reward from the environment on its last token (env_rewards).
    The scorer (reward model, reward function) reads the policy's text; without either the scores are 0 and the
    environment's rewards are the whole reward. `last_episodes` keeps the latest call's episodes for the env/*
    statistics and the logged transcripts."""

    def __init__(self, context: PPOContext, *, make_environment: Callable[[], Any], **kwargs):
        super().__init__(context, **kwargs)
        self.make_environment = make_environment
        self.limits = EpisodeLimits.of(context.cfg)
        self.last_episodes: list[Episode] = []

    def agree_on_turn(self, active: bool, width: int) -> tuple[bool, int]:
        """Over every process: whether any has an unfinished episode, and the widest turn (one gather)."""
        mine = torch.tensor([[float(active), float(width)]], device=self.device)  # (1, 2)
        every = self.accelerator.gather(mine)  # (processes, 2)
        return bool(every[:, 0].max() > 0), int(every[:, 1].max())

    @torch.no_grad()
    def generate(self, queries: list[list[int]], sampling: Sampling | None = None) -> Samples:
        """One episode per query (`episodes.run_episodes`), R = max_episode_tokens on every process; every
        process takes as many turns (one global sum a turn), so sharded forwards stay matched."""
        policy = self.accelerator.unwrap_model(self.policy)
        with self.accelerated.autocast(), self.accelerated.gathered_for_generation(policy):
            samples, self.last_episodes = run_episodes(
                policy.lm,
                self.tokenizer,
                queries,
                self.make_environment,
                sampling or self.sampling,
                self.limits,
                device=self.device,
                agree=self.agree_on_turn,
            )
        if (
            self.global_sum(samples.response_mask.sum()) == 0
        ):  # on every process: nothing to train on anywhere
            raise UserError(no_turn_played(self.last_episodes))
        return samples

    @torch.no_grad()
    def episode_stats(self) -> dict[str, float]:
        """env/* of the latest episodes, means over every process: turns per episode, the environment's reward
        per episode, the share it ended (done), the share that ended on an environment error, and for tool
        environments (`ToolUse`: `calls`, `used`) tool calls per episode, the share of episodes with one, and
        the share whose final answer is a number a tool returned."""
        episodes = self.last_episodes
        tools = [e.environment for e in episodes if hasattr(e.environment, "calls")]
        values = {
            ppo_metrics.ENV_TURNS: [float(e.turns) for e in episodes],
            ppo_metrics.ENV_REWARD: [sum(r for _, r in e.rewards) for e in episodes],
            ppo_metrics.ENV_DONE: [float(e.done) for e in episodes],
            ppo_metrics.ENV_ERRORS: [float(e.error is not None) for e in episodes],
        }
        if tools:
            values[ppo_metrics.ENV_TOOL_CALLS] = [float(t.calls) for t in tools]
            values[ppo_metrics.ENV_TOOL_CALL_RATE] = [float(t.calls > 0) for t in tools]
            values[ppo_metrics.ENV_TOOL_ANSWER_USED] = [float(t.used) for t in tools]
        means = torch.tensor([sum(v) / max(len(v), 1) for v in values.values()])  # (n,) this process's
        means = self.accelerator.reduce(means.to(self.device), reduction="mean")  # every process's
        return {key: float(v) for key, v in zip(values, means)}
