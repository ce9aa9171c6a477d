"""Episodes of several turns: exact ids, the policy's tokens only in every loss and KL, bounded
environments, every estimator and loss on episodes, exact resume."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from envs import play
from helpers import ROOT, code_blocks, doc_section, ppo_config, tiny_chat_model, tiny_ppo_trainer
from processes import killed_and_resumed

from llm_rlhf.core.errors import UserError
from llm_rlhf.models.loading import load_tokenizer
from llm_rlhf.models.reward_fn import RewardFn
from llm_rlhf.models.scoring import Scorer
from llm_rlhf.rl import episodes, ppo_math
from llm_rlhf.rl.episodes import ENVIRONMENT, POLICY, EpisodeLimits, Step, run_episodes
from llm_rlhf.rl.rollout import Samples, Sampling
from llm_rlhf.stages import ppo
from llm_rlhf.tasks.environments import ToolUse, calculator, describe_tools, environment_factory

ECHO = "tests/envs.py:Echo"


def env_config(model_dir, prompt_file, out, **kw):
    """A tiny PPO run with the Echo environment and no other reward: 8 episodes of at most 3 turns."""
    base = dict(
        environment=ECHO,
        max_turns=3,
        max_episode_tokens=24,
        max_new_tokens=8,
        max_reply_tokens=6,
        gold_judge="none",
        eval_every=0,
    )
    base.update(kw)
    return ppo_config(model_dir, None, prompt_file, out, **base)


# --- the ids of an episode -----------------------------------------------------------------


class Scripted:
    """A sampler standing in for `rollout.sample`: turn n of row i is the fixed ids TURNS[n][i] (an EOS or the
    pause ends them as the sampler would); records the contexts it was given."""

    def __init__(self, turns, pad):
        self.turns, self.pad, self.contexts, self.n = turns, pad, [], 0

    def __call__(self, lm, tokenizer, query, query_mask, sampling):
        rows = [q[m.bool()].tolist() for q, m in zip(query, query_mask)]
        self.contexts.append(rows)
        ids = self.turns[self.n][: len(rows)]
        self.n += 1
        R = max(len(x) for x in ids)
        response = torch.full((len(ids), R), self.pad)
        mask = torch.zeros((len(ids), R), dtype=torch.bool)
        for i, x in enumerate(ids):
            response[i, : len(x)], mask[i, : len(x)] = torch.tensor(x), True
        return Samples(query, query_mask, response, mask, stopped=torch.ones(len(ids), dtype=torch.bool))


class Replies:
    """Replies 'r<turn>' after each turn and ends after the third with reward 1."""

    def reset(self, prompt):
        self.turn = 0

    def step(self, turn):
        self.turn += 1
        return Step(reward=1.0, done=True) if self.turn == 3 else Step(reply=f"r{self.turn}", reward=0.25)


def test_three_turn_episode_is_the_concatenation_of_its_sampled_and_encoded_pieces(
    tiny_model_dir, monkeypatch
):
    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    queries = [tok("The film is")["input_ids"], tok("A gorgeous")["input_ids"]]
    # turn n of row i: one id per character, a split the tokenizer never makes itself, so re-tokenizing an
    # episode's context (decode, encode) would change its ids and fail this test
    chars = lambda text: [tok(c, add_special_tokens=False)["input_ids"][0] for c in text]  # noqa: E731
    turns = [[chars(" the"), chars(" so")], [chars(" film"), chars(" a")], [chars(" it"), chars(" movie")]]
    for turn in (t for n in turns for t in n):
        assert tok(tok.decode(turn), add_special_tokens=False)["input_ids"] != turn
    scripted = Scripted(turns, tok.pad_token_id)
    monkeypatch.setattr(episodes, "sample", scripted)
    samples, played = run_episodes(
        None,
        tok,
        queries,
        Replies,
        Sampling(max_new_tokens=4),
        EpisodeLimits(max_turns=5, max_episode_tokens=40),
    )
    for i, q in enumerate(queries):
        r1, r2 = (tok(f"r{n}", add_special_tokens=False)["input_ids"] for n in (1, 2))  # inline replies
        pieces = [turns[0][i], r1, turns[1][i], r2, turns[2][i]]
        expected = [t for p in pieces for t in p]
        row = samples.response[i][samples.tokens_mask[i]].tolist()
        assert row == expected  # never re-tokenized: the sampled ids and the encoded replies, in order
        assert (
            samples.response[i][samples.response_mask[i]].tolist() == turns[0][i] + turns[1][i] + turns[2][i]
        )
        assert samples.response[i][samples.env_mask[i]].tolist() == r1 + r2
        # each turn was sampled on the prompt and every piece before it
        for n in range(3):
            assert scripted.contexts[n][i] == q + [t for p in pieces[: 2 * n] for t in p]
        # the turns' rewards on their last tokens: 0.25 after turns 1 and 2, 1.0 after turn 3
        ends = [len(turns[0][i]) - 1, len(turns[0][i] + r1 + turns[1][i]) - 1, len(expected) - 1]
        assert samples.env_rewards[i].nonzero().flatten().tolist() == ends
        assert samples.env_rewards[i][ends].tolist() == [0.25, 0.25, 1.0]
    assert samples.turns.tolist() == [3, 3] and samples.stopped.tolist() == [True, True]
    assert [owner for owner, _ in played[0].pieces] == [POLICY, ENVIRONMENT, POLICY, ENVIRONMENT, POLICY]
    # the attention covers both, the masks never overlap
    assert not (samples.response_mask & samples.env_mask).any()
    assert samples.attention_mask[:, -samples.response.shape[1] :].bool().equal(samples.tokens_mask)


CHATML = (  # SmolLM2's template's form (ChatML), the EOS after each message
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_reply_after_an_ended_message_is_a_chat_message_of_the_template(tmp_path):
    tok = load_tokenizer(str(tiny_chat_model(tmp_path / "chatml", CHATML)))
    eos = tok.eos_token
    before, after = episodes.chat_reply_text(tok, "tool")
    assert (before, after) == ("\n<|im_start|>tool\n", f"{eos}\n<|im_start|>assistant\n")
    ids = episodes.reply_ids(tok, "<result>7</result>", inline=False, role="tool", max_reply_tokens=16)
    # the policy's sampled turn and EOS + these ids render the conversation as the template does
    said = tok("Let me see.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    text = tok.decode(said + ids)
    rendered = tok.apply_chat_template(
        [
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "Let me see."},
            {"role": "tool", "content": "<result>7</result>"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rendered.endswith(text)


# --- the policy's tokens only ------------------------------------------------------------------


def episode_trainer(tiny_model_dir, prompt_file, tmp_path, **kw):
    trainer = tiny_ppo_trainer(env_config(tiny_model_dir, prompt_file, tmp_path, **kw))
    torch.manual_seed(0)
    return trainer


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_gradient_and_kl_are_exactly_zero_on_environment_tokens(
    tiny_model_dir, prompt_file, tmp_path, estimator
):
    """The update's gradient with respect to every token's log-prob is 0 at the environment's tokens (and not 0
    at the policy's), and the per-token KL and rewards are 0 there: unmasking them (the loss mask = the
    attention) fails this test."""
    kw = {"advantage_estimator": estimator, "samples_per_prompt": 2} if estimator == "grpo" else {}
    trainer = episode_trainer(tiny_model_dir, prompt_file, tmp_path, **kw)
    rollout, _ = trainer.rollout(trainer.collector.in_groups(trainer.collector.queries(0)))
    env = rollout.env_mask
    assert env.any() and rollout.response_mask.any()
    kl_coef = 0.3
    trainer.kl_ctl.value = kl_coef
    rollout.ref_logprobs = rollout.ref_logprobs + torch.randn_like(rollout.ref_logprobs)  # a KL everywhere
    noise = torch.randn_like(rollout.env_rewards)  # where the collector never puts an environment's reward
    rollout.env_rewards = torch.where(env, noise, rollout.env_rewards)
    rewards, kl = trainer.rewards(rollout, kl_coef)
    assert rewards[env].abs().sum() == 0  # no KL penalty, no score there
    seq = ppo_math.sequence_kl(kl=kl, response_mask=rollout.response_mask)
    assert torch.allclose(seq, (kl * rollout.response_mask).sum(-1))
    advantages, returns = trainer.advantages(rollout, rewards)
    grads = []
    real = trainer.forward_policy

    def recording(part, **kwargs):
        out = real(part, **kwargs)
        if kwargs.get("train"):
            out[0].register_hook(lambda g, m=part.env_mask, p=part.response_mask: grads.append((g, m, p)))
        return out

    trainer.forward_policy = recording
    trainer.train_on_rollout(rollout, advantages, returns)
    assert grads
    for g, env_part, _ in grads:
        assert g[env_part].abs().max() == 0  # exactly zero: no loss term reads an environment token
    assert any(g[p].abs().max() > 0 for g, _, p in grads)


def with_noise(x, where, generator):
    """x with noise of sd 3 added at the positions `where` (B, R), drawn from `generator` (not the global RNG the
    update shuffles its minibatches with); None stays None."""
    return None if x is None else torch.where(where, x + 3.0 * torch.randn(x.shape, generator=generator), x)


def noised_at(rollout, where, advantages, returns):
    """Copies of the rollout's per-token inputs of the update with noise at the positions `where` (B, R)."""
    g = torch.Generator().manual_seed(1)
    fields = ("logprobs", "values", "ref_logprobs", "sampler_logprobs")
    noised = dataclasses.replace(rollout, **{f: with_noise(getattr(rollout, f), where, g) for f in fields})
    return noised, with_noise(advantages, where, g), with_noise(returns, where, g)


def recorded_update(trainer, rollout, advantages, returns):
    """The update's statistics, each train forward's (gradient at the log-probs, entropy, policy mask) and the
    trained parameters, for one `train_on_rollout`."""
    seen, real = [], trainer.forward_policy

    def recording(part, **kwargs):
        out = real(part, **kwargs)
        if kwargs.get("train"):
            record = {"entropy": out[2].detach(), "policy": part.response_mask}
            out[0].register_hook(lambda g: record.__setitem__("grad", g))
            seen.append(record)
        return out

    trainer.forward_policy = recording
    stats = trainer.train_on_rollout(rollout, advantages, returns)
    trainer.forward_policy = real
    params = [p.detach().clone() for p in trainer.policy.parameters() if p.requires_grad]
    return stats, seen, params


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_noise_at_environment_tokens_leaves_the_update_bit_identical_and_its_means_count_the_policy(
    tiny_model_dir, prompt_file, tmp_path, estimator
):
    """Two trainers from one seed train on one rollout, the second with noise at the environment's tokens in
    every per-token input of the update (advantages, returns, old values, old and reference log-probs): the
    statistics, the gradients at the log-probs and the trained weights are bit-identical. gae trains the value
    head; grpo puts the KL in the loss. And the logged entropy is the token mean over the policy's tokens of
    what the forwards computed (each minibatch's 2 micro-batches weighted by their policy tokens, the
    minibatches' means averaged): unmasking any loss term,
    the loss mask or a micro-batch's token count fails this test."""
    kw = dict(ppo_epochs=1, mini_batch_size=8, gradient_accumulation_steps=2, ent_coef=0.01)
    if estimator == "grpo":
        kw.update(advantage_estimator="grpo", samples_per_prompt=2)
    trainers = [episode_trainer(tiny_model_dir, prompt_file, tmp_path / str(i), **kw) for i in range(2)]
    first = trainers[0]
    rollout, _ = first.rollout(first.collector.in_groups(first.collector.queries(0)))
    env = rollout.env_mask
    assert env.any() and rollout.response_mask.any() and not (env & rollout.response_mask).any()
    rewards, _ = first.rewards(rollout, first.kl_ctl.value)
    advantages, returns = first.advantages(rollout, rewards)
    clean = recorded_update(first, rollout, advantages, returns)
    noisy = recorded_update(trainers[1], *noised_at(rollout, env, advantages, returns))
    assert clean[0] == noisy[0]  # every statistic of the update
    assert len(clean[1]) == len(noisy[1]) and len(clean[1]) % 2 == 0  # 2 micro-batches a minibatch
    for a, b in zip(clean[1], noisy[1]):
        assert torch.equal(a["grad"], b["grad"])
        assert a["grad"][~a["policy"]].abs().max() == 0 and a["grad"][a["policy"]].abs().max() > 0
    assert all(torch.equal(a, b) for a, b in zip(clean[2], noisy[2]))
    minibatches = [clean[1][i : i + 2] for i in range(0, len(clean[1]), 2)]
    means = [torch.cat([r["entropy"][r["policy"]] for r in mb]).mean() for mb in minibatches]
    assert clean[0]["policy/entropy"] == pytest.approx(float(torch.stack(means).mean()), rel=1e-5)


STEP_ESTIMATORS = [
    dict(advantage_estimator="gae", whiten_rewards=True),
    dict(advantage_estimator="grpo", samples_per_prompt=2),
    dict(advantage_estimator="dr_grpo", samples_per_prompt=2),
    dict(advantage_estimator="rloo", samples_per_prompt=2),
    dict(advantage_estimator="reinforce_pp"),
    dict(advantage_estimator="remax"),
]


@pytest.mark.parametrize("kw", STEP_ESTIMATORS, ids=lambda kw: kw["advantage_estimator"])
def test_noise_at_environment_tokens_leaves_a_ppo_step_bit_identical(
    tiny_model_dir, prompt_file, tmp_path, kw
):
    """A whole PPO step of two trainers from one seed, the second's rollouts (ReMax's greedy one too) with noise
    at the environment's tokens in every per-token tensor (old, reference and sampler log-probs, values,
    entropy, the environment's rewards): every metric but the times, the KL controller's next coefficient and
    the trained weights are bit-identical, for every estimator (gae with whitened rewards); and the logged
    response length counts the policy's tokens, the rewards are whitened over them. Unmasking the KL penalty, the environment's rewards, the
    whitening, the advantages, ReMax's baseline, the controller's KL or a step metric fails this test."""
    kw = dict(kw, init_kl_coef=0.2)
    trainers = [episode_trainer(tiny_model_dir, prompt_file, tmp_path / str(i), **kw) for i in range(2)]
    rollouts = []
    for trainer, noisy in zip(trainers, (False, True)):
        real = trainer.rollout

        def rollout(*args, real=real, noisy=noisy, **kwargs):
            out, scores = real(*args, **kwargs)
            rollouts.append(out)
            if not noisy:
                return out, scores
            g = torch.Generator().manual_seed(1)
            fields = ("logprobs", "values", "ref_logprobs", "sampler_logprobs", "entropy", "env_rewards")
            noised = {f: with_noise(getattr(out, f), out.env_mask, g) for f in fields}
            return dataclasses.replace(out, **noised), scores

        trainer.rollout = rollout
    given, advantages = [], trainers[0].advantages

    def recording(rollout, rewards, *args):
        given.append((rollout, rewards, trainers[0].kl_ctl.value))
        return advantages(rollout, rewards, *args)

    trainers[0].advantages = recording
    torch.manual_seed(0)
    clean = trainers[0].ppo_step()
    torch.manual_seed(0)
    noisy = trainers[1].ppo_step()
    timeless = lambda m: {k: v for k, v in m.items() if not k.startswith("time/") and k != "tokens_per_s"}  # noqa: E731
    assert timeless(clean) == timeless(noisy)
    assert trainers[0].kl_ctl.value == trainers[1].kl_ctl.value
    weights = [[p for p in t.policy.parameters() if p.requires_grad] for t in trainers]
    assert all(torch.equal(a, b) for a, b in zip(*weights))
    first = rollouts[0]
    assert first.env_mask.any()
    assert clean["response_length"] == pytest.approx(float(first.response_mask.sum(-1).float().mean()))
    if kw.get("whiten_rewards"):  # whitened over the policy's tokens
        rollout, rewards, kl_coef = given[0]
        raw, _ = trainers[0].rewards(rollout, kl_coef)
        expected = ppo_math.masked_whiten(raw, rollout.response_mask, shift_mean=False)
        assert torch.allclose(rewards, expected, atol=1e-6)


def test_a_reward_function_reads_the_policy_s_text_of_an_episode_without_the_replies(tiny_model_dir):
    """The scorer's reward function sees an episode's policy tokens decoded (its turns in order, EOS dropped),
    never the environment's replies, which sit between them in the response."""
    import envs

    samples, played = play(tiny_model_dir, envs.Echo)
    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    seen = []

    def recording(prompts, responses):
        seen.extend(responses)
        return [0.0] * len(responses)

    Scorer(None, RewardFn(recording, "recording"))(samples, tok)
    assert samples.env_mask.any()
    policy = [
        [t for owner, ids in e.pieces if owner == POLICY for t in ids if t != tok.eos_token_id]
        for e in played
    ]
    assert seen == [tok.decode(ids, skip_special_tokens=True) for ids in policy]
    replies = [
        tok.decode([t for owner, ids in e.pieces if owner == ENVIRONMENT for t in ids]) for e in played
    ]
    assert any(r.strip() and r.strip() not in text for r, text in zip(replies, seen))


def test_the_evaluation_s_kl_and_lengths_of_an_episode_count_the_policy_s_tokens(tiny_model_dir, monkeypatch):
    """Evaluation's KL to the reference of an episode is the sum over the policy's tokens of log pi - log pi_ref
    (a reference with other weights, so the environment's tokens have a KL of their own), and its record's
    length is the policy's tokens."""
    import envs
    from transformers import AutoModelForCausalLM

    from llm_rlhf.evaluation import measures
    from llm_rlhf.rl.rollout import response_logits

    samples, _ = play(tiny_model_dir, envs.Echo)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    kl, _ = measures.sequence_kl_to_ref(
        policy, measures.KLReference(reference), samples, Sampling(max_new_tokens=16)
    )
    with torch.no_grad():
        per_token = [
            torch.log_softmax(response_logits(lm, samples).float(), -1).gather(
                -1, samples.response[..., None]
            )[..., 0]
            for lm in (policy, reference)
        ]  # (B, R) each
    k1 = per_token[0] - per_token[1]
    assert samples.env_mask.any() and k1[samples.env_mask].abs().max() > 1e-3
    assert torch.allclose(kl, (k1 * samples.response_mask).sum(-1), atol=1e-5)
    tok = load_tokenizer(str(tiny_model_dir), padding_side="left")
    scores = Scorer(None, RewardFn(lambda p, r: [0.0] * len(r), "zero"))(samples, tok)
    records = measures.batch_records(["a", "b"], samples, tok, (kl, kl), scores)
    assert [r["length"] for r in records] == samples.response_mask.sum(-1).tolist()


def test_per_turn_rewards_land_in_the_rewards_and_gae_skips_environment_tokens(
    tiny_model_dir, prompt_file, tmp_path
):
    trainer = episode_trainer(tiny_model_dir, prompt_file, tmp_path, init_kl_coef=0.0, kl_controller="fixed")
    rollout, _ = trainer.rollout(trainer.collector.queries(0))
    rewards, _ = trainer.rewards(rollout, 0.0)
    assert torch.equal(rewards, rollout.env_rewards * rollout.response_mask)  # Echo: 0.5 a turn, no RM
    assert (rollout.env_rewards.sum(-1) > 0).any()
    # GAE over the policy's tokens only: the same as on the policy's tokens packed together
    values = torch.randn(rewards.shape)
    adv, ret = ppo_math.compute_gae(
        rewards=rewards, values=values, response_mask=rollout.response_mask, gamma=0.9, lam=0.8
    )
    for b in range(rewards.shape[0]):
        m = rollout.response_mask[b]
        a, _ = ppo_math.compute_gae(
            rewards=rewards[b][m][None],
            values=values[b][m][None],
            response_mask=torch.ones(1, int(m.sum()), dtype=torch.bool),
            gamma=0.9,
            lam=0.8,
        )
        assert torch.allclose(adv[b][m], a[0])


ESTIMATOR_LOSSES = [
    dict(advantage_estimator="gae"),
    dict(advantage_estimator="grpo", samples_per_prompt=2),
    dict(advantage_estimator="dr_grpo", samples_per_prompt=2),
    dict(advantage_estimator="rloo", samples_per_prompt=2),
    dict(advantage_estimator="reinforce_pp"),
    dict(advantage_estimator="remax"),
    dict(advantage_estimator="grpo", samples_per_prompt=2, policy_loss="gspo"),
    dict(advantage_estimator="grpo", samples_per_prompt=2, policy_loss="cispo"),
    dict(advantage_estimator="grpo", samples_per_prompt=2, policy_loss="sapo"),
    dict(
        advantage_estimator="grpo",
        samples_per_prompt=2,
        loss_aggregation="token_sum_norm",
        mask_truncated=True,
    ),
]


@pytest.mark.parametrize("kw", ESTIMATOR_LOSSES, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_every_estimator_and_policy_loss_trains_on_episodes(tiny_model_dir, prompt_file, tmp_path, kw):
    out = tmp_path / "run"
    ppo.run(env_config(tiny_model_dir, prompt_file, out, **kw))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    for m in lines:
        assert 1 <= m["env/turns"] <= 3 and m["env/reward"] > 0 and m["env/error_rate"] == 0
        assert all(v == v for v in m.values() if isinstance(v, float))  # no NaN


def test_the_overlong_penalty_and_token_sum_norm_count_an_episode_against_its_own_budget(
    tiny_model_dir, prompt_file, tmp_path
):
    """Worked example, max_episode_tokens 24, overlong_buffer 4 (the ramp starts at 20), max_new_tokens 8, each
    episode ending with EOS: policy 6 + environment 8 + policy 6 = 20 tokens -> 0; 6 + 8 + 8 = 22 -> -0.5; and
    6 + 2 + 6 = 14 -> 0, though its 12 policy tokens exceed one turn's max_new_tokens (counted against 8, the
    ramp would start at 4 and give -1). token_sum_norm's constant for the 3 episodes: B * L = 3 * 24."""
    cfg = env_config(
        tiny_model_dir, prompt_file, tmp_path, overlong_buffer=4, loss_aggregation="token_sum_norm"
    )
    trainer = tiny_ppo_trainer(cfg)
    eos = trainer.tokenizer.eos_token_id
    pieces = [(6, 8, 6), (6, 8, 8), (6, 2, 6)]  # policy, environment, policy
    B, R = len(pieces), cfg.max_episode_tokens
    response = torch.full((B, R), 5)
    policy, env = torch.zeros((B, R), dtype=torch.bool), torch.zeros((B, R), dtype=torch.bool)
    for b, (p1, e, p2) in enumerate(pieces):
        policy[b, :p1] = policy[b, p1 + e : p1 + e + p2] = True
        env[b, p1 : p1 + e] = True
        response[b, p1 + e + p2 - 1] = eos
    samples = Samples(
        query=torch.ones((B, 2), dtype=torch.long),
        query_mask=torch.ones((B, 2), dtype=torch.bool),
        response=response,
        response_mask=policy,
        stopped=torch.zeros(B, dtype=torch.bool),
        env_mask=env,
    )
    assert trainer.overlong(samples).tolist() == [0.0, -0.5, 0.0]
    tokens, normaliser = trainer.update.minibatch_counts(torch.arange(B), policy)
    assert tokens == policy.sum() and normaliser == B * R


# --- bounded environments ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, reason",
    [
        ("Raises", "step raised RuntimeError: the environment broke"),
        ("Hangs", "step did not return within 0.5 s"),
        ("NotAStep", "step returned str 'a string', not a Step"),
    ],
)
def test_an_environment_that_raises_hangs_or_misbehaves_ends_its_episode_with_a_note(
    tiny_model_dir, capsys, name, reason
):
    import envs

    samples, played = play(tiny_model_dir, getattr(envs, name), environment_timeout=0.5)
    failed = [e for e in played if e.error is not None]  # the others' first turn never paused: no step
    assert failed and all(e.error == reason and e.turns == 1 for e in failed)
    err = capsys.readouterr().err
    assert f"note: environment {name} {reason}; its episode ends at turn 1, the run goes on" in err
    assert not samples.env_mask.any()  # no reply was added


def test_a_reply_of_megabytes_is_cut_to_max_reply_tokens(tiny_model_dir):
    import envs

    samples, played = play(tiny_model_dir, envs.Megabytes, max_reply_tokens=5, max_episode_tokens=80)
    tok = load_tokenizer(str(tiny_model_dir))
    cut = len(tok(" [cut]", add_special_tokens=False)["input_ids"])
    replies = [ids for e in played for owner, ids in e.pieces if owner == ENVIRONMENT]
    assert replies and all(len(ids) == 5 + cut for ids in replies)


def test_an_environment_that_never_ends_is_ended_by_max_turns_and_the_token_budget(tiny_model_dir):
    import envs

    samples, played = play(tiny_model_dir, envs.Echo, max_turns=2, max_episode_tokens=200)
    assert all(e.turns <= 2 for e in played) and not any(e.done for e in played)
    samples, played = play(tiny_model_dir, envs.Echo, max_turns=100, max_episode_tokens=12)
    assert samples.response.shape[1] == 12 and all(e.length <= 12 for e in played)


def test_a_tool_that_raises_answers_the_model_in_one_line():
    def broken(x: str) -> str:
        """Always fails."""
        raise ValueError("no such thing\nsecond line")

    env = ToolUse([broken, calculator])
    env.reset("p")
    assert env.step("<tool>broken(1)</tool>").reply == "<result>error: no such thing</result>"
    assert (
        env.step("<tool>nope(1)</tool>").reply
        == "<result>error: no tool nope; tools: broken, calculator</result>"
    )
    assert env.step("<tool>calculator(2 * (3 + 4))</tool>") == Step(reply="<result>14</result>")
    assert env.step("So the answer is 14.").done and env.used and env.calls == 3


def test_a_call_whose_pausing_token_runs_past_the_stop_string_is_a_call_and_its_reply_goes_on_from_there():
    """SmolLM2 writes "</tool><result>" with a "><" token: the turn pauses at "...</tool><" (the token completing
    the stop string is kept), which is still a call, and the reply continues the text the policy began."""
    env = ToolUse([calculator])
    env.reset("p")
    assert env.step("<tool>calculator(6 - 3 - 7)</tool><") == Step(reply="result>-4</result>")
    assert env.step("<tool>calculator(6 - 3 - 7)</tool>\n") == Step(reply="<result>-4</result>")
    assert env.step("<tool>calculator(1)</tool> so the answer is -4").done  # text after the call: an answer
    assert env.calls == 2 and env.used


def test_the_calculator_parses_arithmetic_and_never_evaluates_python():
    assert [calculator(e) for e in ("9 + 6 + 8", "4 - 8 - 3", "-(2) * 3", "7 / 2", " 12−5 ")] == [
        "23",
        "-7",
        "-6",
        "3.5",
        "7",
    ]
    # exact for the integers and decimals it accepts; a result with no finite decimal has 12 digits
    assert [
        calculator(e) for e in ("123456.7 + 0.1", "1234567.5", "0.1 + 0.2", "-1 / 8", "999999999999999")
    ] == [
        "123456.8",
        "1234567.5",
        "0.3",
        "-0.125",
        "999999999999999",
    ]
    assert calculator("1 / 3") == "0.333333333333" and calculator("2 / 3 * 3") == "2"
    bad = ("__import__('os')", "2 ** 3", "1 / 0", "(1 + 2", "9" * 20, "1" + "+1" * 200, "", "٣ + ٤", "1e5")
    for expression in bad:
        with pytest.raises(ValueError):
            calculator(expression)
    assert describe_tools([calculator]).startswith("calculator(expression: str) -> str: Evaluate")


def test_a_bad_environment_spec_is_one_line_naming_the_key():
    with pytest.raises(UserError, match="environment 'tests/envs.py:Nope': 'tests/envs.py' has no attribute"):
        environment_factory("tests/envs.py:Nope")
    with pytest.raises(UserError, match="environment 'feedback' judges answers with the task's verifier"):
        environment_factory("feedback")
    assert isinstance(environment_factory("calculator")(), ToolUse)


# --- evaluation, resume --------------------------------------------------------------------------------


def test_heldout_evaluation_and_the_eval_stage_play_episodes(tiny_model_dir, prompt_file, tmp_path):
    from helpers import eval_config

    from llm_rlhf.stages import evaluate

    out = tmp_path / "ppo"
    ppo.run(
        env_config(
            tiny_model_dir,
            prompt_file,
            out,
            eval_every=1,
            eval_prompt_file=str(prompt_file),
            eval_num_prompts=6,
        )
    )
    log = [json.loads(x) for x in (out / "eval_log.jsonl").read_text().splitlines()]
    assert len(log) == 3 and all(1 <= r["turns_mean"] <= 3 and r["env_reward_mean"] > 0 for r in log)
    samples = [json.loads(x) for x in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert samples and all(t["role"] in (POLICY, ENVIRONMENT) for s in samples for t in s["turns"])
    ev = tmp_path / "eval"
    evaluate.run(
        eval_config(
            out,
            tiny_model_dir,
            prompt_file,
            ev,
            environment=ECHO,
            max_turns=3,
            max_episode_tokens=24,
            max_reply_tokens=6,
            gold_judge="none",
        )
    )
    metrics = json.loads((ev / "metrics.json").read_text())
    assert 1 <= metrics["turns_mean"] <= 3 and 1 <= metrics["turns_mean_baseline"] <= 3
    rows = [json.loads(x) for x in (ev / "samples.jsonl").read_text().splitlines()]
    assert any(t["role"] == ENVIRONMENT for r in rows for t in r["policy_turns"])
    assert all(r["baseline_num_turns"] >= 1 for r in rows)


def test_resume_mid_run_with_episodes_is_exact(tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    kw = dict(steps=4, save_steps=2)
    a, b = killed_and_resumed(
        lambda out, **more: env_config(tiny_model_dir, prompt_file, out, **kw, **more), tmp_path, monkeypatch
    )
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for ma, mb in zip(a, b):
        for k, v in ma.items():
            if not k.startswith(("time/", "tokens_per_s")):
                assert mb[k] == pytest.approx(v, rel=1e-6, abs=1e-7, nan_ok=True), (ma["step"], k)


# --- the calculator recipes ----------------------------------------------------------------------

TOOL_RECIPES = ROOT / "recipes" / "gym-chain_sum-t3d1"


def test_the_calculator_recipe_the_traces_and_the_environment_share_one_system_prompt(tmp_path, monkeypatch):
    """recipes/gym-chain_sum-t3d1/tool (rung 2) and gym-chain_sum-t2d2/tool (rung 3): PPO plays the calculator with `CALCULATOR_SYSTEM_PROMPT`, the SFT traces
    are rendered with it and regenerate byte for byte (data/make_tool_traces.py); the control (answer/) is the
    rung's PPO from its own SFT; both are sweeps of seeds 0, 1, 2 over one shared SFT."""
    import subprocess
    import sys

    from llm_rlhf.core.config import parse_config
    from llm_rlhf.interfaces import pipeline
    from llm_rlhf.tasks.environments import CALCULATOR_SYSTEM_PROMPT

    monkeypatch.chdir(ROOT)
    for rung, kind in [
        (r, k) for r in ("gym-chain_sum-t3d1", "gym-chain_sum-t2d2") for k in ("tool", "answer")
    ]:
        cfg = parse_config(
            pipeline.Config, ["--config", str(ROOT / "recipes" / rung / kind / "pipeline.yaml")]
        )
        assert cfg.task == rung.removeprefix("gym-")
        runs = pipeline.sweep_runs(cfg)
        ppo = [pipeline.stage_config(run, "ppo") for run in runs[1:]]  # runs[0]: the shared SFT
        assert [c.seed for c in ppo] == [0, 1, 2] and pipeline.stage_config(runs[0], "sft").use_lora
        assert {c.environment for c in ppo} == {"calculator" if kind == "tool" else None}
        if kind == "tool":
            assert ppo[0].system_prompt == CALCULATOR_SYSTEM_PROMPT
    from llm_rlhf.stages import evaluate, sft

    for path in (
        sorted((ROOT / "recipes").glob("gym-chain_sum-*/*/*.yaml"))
        + sorted((ROOT / "recipes").glob("gym-chain_sum-*/tool/generalise/*.yaml"))
    ):  # every stage file of the episode recipes (tool, answer, feedback, the probe and generalise evaluations)
        if path.parent.name in ("tool", "answer", "feedback") or path.parent.parent.name == "tool":
            if path.stem == "sft":
                parse_config(sft.Config, ["--config", str(path)])
            elif path.stem == "pipeline":
                for run in pipeline.sweep_runs(parse_config(pipeline.Config, ["--config", str(path)])):
                    for stage in run.stages:
                        pipeline.stage_config(run, stage)
            elif path.stem != "ppo":  # ppo.yaml: through its pipeline (the task's keys)
                cfg = parse_config(evaluate.Config, ["--config", str(path)])
                assert cfg.environment == "calculator" and cfg.system_prompt == CALCULATOR_SYSTEM_PROMPT, path
    out = tmp_path / "traces"
    subprocess.run([sys.executable, "data/make_tool_traces.py", "--out", str(out)], check=True, cwd=ROOT)
    for path in sorted((ROOT / "data" / "tool_traces").rglob("*.jsonl")):
        assert (out / path.relative_to(ROOT / "data" / "tool_traces")).read_bytes() == path.read_bytes(), path
    first = json.loads((ROOT / "data/tool_traces/chain_sum-t3d1/tool_train.jsonl").open().readline())
    assert first["messages"][0] == {"role": "system", "content": CALCULATOR_SYSTEM_PROMPT}


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.slow
def test_the_calculator_recipe_runs_through_the_pipeline_on_a_tiny_chat_llama(tmp_path, monkeypatch):
    """`llm-rlhf pipeline --config recipes/gym-chain_sum-t3d1/tool/pipeline.yaml` with a tiny chat Llama in place
    of SmolLM2: the SFT on the traces, then one seed's PPO of 2 steps with the calculator, held-out episodes."""
    from llm_rlhf.core.config import parse_config
    from llm_rlhf.interfaces import pipeline

    monkeypatch.chdir(ROOT)
    model = tiny_chat_model(tmp_path / "tiny_chat_llama", CHAT_TEMPLATE)
    out = tmp_path / "run"
    sft_keys = {
        "model_name_or_path": str(model),
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "max_length": 600,
    }
    ppo_keys = {
        "steps": 2,
        "rollout_batch_size": 2,
        "mini_batch_size": 4,
        "max_new_tokens": 8,
        "max_prompt_length": 600,
        "max_episode_tokens": 40,
        "eval_every": 1,
        "eval_num_prompts": 3,
    }
    argv = [
        "--config",
        str(TOOL_RECIPES / "tool" / "pipeline.yaml"),
        "--output_dir",
        str(out),
        "--sft",
        json.dumps(sft_keys),
        "--ppo",
        json.dumps(ppo_keys),
        "--sweep",
        json.dumps([{"name": "seed0", "seed": 0}]),
    ]
    pipeline.run(parse_config(pipeline.Config, argv))
    heldout = [json.loads(x) for x in (out / "seed0" / "ppo" / "eval_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in heldout] == [0, 1, 2] and all(r["turns_mean"] >= 1 for r in heldout)
    metrics = [json.loads(x) for x in (out / "seed0" / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert all("env/tool_call_rate" in m for m in metrics)
    page = (out / "seed0" / "report.html").read_text()  # the run's own page (report.html: the sweep's)
    assert "Held-out episodes at step 0" in page and 'class="turn policy"' in page


def test_the_readme_environment_trains_as_written(tiny_model_dir, prompt_file, tmp_path):
    """docs/guides/environments.md's environment example, copied out of the page as a user would, trains a PPO
    run."""
    (code,) = code_blocks(doc_section("guides/environments.md"), "python")
    envs_file = tmp_path / "my_envs.py"
    envs_file.write_text(code)
    out = tmp_path / "run"
    ppo.run(env_config(tiny_model_dir, prompt_file, out, environment=f"{envs_file}:Countdown", max_turns=4))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["env/error_rate"] == 0 and 1 <= m["env/turns"] <= 3 for m in lines)


def test_the_episode_step_benchmark_times_both_and_prints_the_ratio(tmp_path, monkeypatch, capsys):
    """benchmarks/episode_step.py on a tiny chat Llama: the calculator recipe's PPO with and without episodes."""
    import sys

    monkeypatch.chdir(ROOT)
    model = tiny_chat_model(tmp_path / "tiny_chat_llama", CHAT_TEMPLATE)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import episode_step

    out = tmp_path / "bench.json"
    argv = [
        "episode_step.py",
        "--model",
        str(model),
        "--steps",
        "2",
        "--max-prompt-length",
        "600",
        "--json",
        str(out),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    episode_step.main()
    text = capsys.readouterr().out
    assert "episodes / single turns:" in text
    result = json.loads(out.read_text())
    assert result["single"]["turns"] == 1.0 and result["episodes"]["turns"] >= 1.0
    assert result["ratio"] == pytest.approx(result["episodes"]["s_per_step"] / result["single"]["s_per_step"])
