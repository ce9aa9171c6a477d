"""No compute on padding: the PPO forwards run on `Samples.trimmed()` rows and the RM on
`trim_padding_columns`, and give the same log-probs, values, entropy, ref log-probs, scores, gradients and
update as the same forwards over the padded rows, up to float rounding. The same comparisons catch a trim
that drops one real token (an off-by-one on either side)."""

from __future__ import annotations

import pytest
import torch
from helpers import ppo_config, tiny_ppo_trainer

from llm_rlhf.models import reward_model
from llm_rlhf.ppo import trainer as ppo_trainer
from llm_rlhf.rl import token_math
from llm_rlhf.rl.rollout import Rollout, Samples, left_pad, pad_columns

R = 12  # max_new_tokens; the longest real response below has 7 tokens
EOS_AT = [1, 3, 6, 0, 2, 4, 1, 3]  # the EOS's index in each row's response
EXTRA_QUERY_PAD = 2  # all-pad columns left of the queries

# The real trims, before a test swaps in one of the variants below.
TRIMMED, TRIM_PADDING_COLUMNS = Samples.trimmed, reward_model.trim_padding_columns


def no_trim(self):
    return self


def drops_last_response_column(self):
    return TRIMMED(self).columns(None, -1)


def drops_first_query_column(self):
    return TRIMMED(self).columns(1, None)


def rm_drops_last_column(input_ids, attention_mask):
    input_ids, attention_mask = TRIM_PADDING_COLUMNS(input_ids, attention_mask)
    return input_ids[:, :-1], attention_mask[:, :-1]


def assert_same(a: torch.Tensor, b: torch.Tensor, msg: str, *, atol: float = 1e-6, rtol: float = 1e-5):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=msg)


# --- the layout ----------------------------------------------------------------------------------


def test_trimmed_keeps_every_real_token_and_drops_only_padding_columns():
    """The docstring's example: P 5 -> 4 (longest real query), R 6 -> 3 (longest real response)."""
    pad = 0
    query = torch.tensor([[pad, pad, pad, 11, 12], [pad, 21, 22, 23, 24]])
    query_mask = torch.tensor([[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]])
    response = torch.tensor([[31, 32, 9, pad, pad, pad], [41, 9, pad, pad, pad, pad]])
    response_mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]]).bool()
    samples = Samples(query=query, query_mask=query_mask, response=response, response_mask=response_mask)
    t = samples.trimmed()
    assert type(t) is Samples
    assert t.query.tolist() == [[pad, pad, 11, 12], [21, 22, 23, 24]]
    assert t.query_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert t.response.tolist() == [[31, 32, 9], [41, 9, pad]]
    assert t.response_mask.tolist() == [[True, True, True], [True, True, False]]
    assert t.attention_mask.sum() == samples.attention_mask.sum()  # no real token dropped
    assert t.trimmed().query.shape == t.query.shape and t.trimmed().response.shape == t.response.shape

    values = torch.arange(12.0).reshape(2, 6)  # a Rollout's (B, R) fields are cut with the response
    rollout = Rollout.of(
        samples, logprobs=-values, values=values, entropy=values, ref_logprobs=-values, scores=torch.ones(2)
    )
    rt = rollout.trimmed()
    assert type(rt) is Rollout and rt.values.tolist() == [[0.0, 1.0, 2.0], [6.0, 7.0, 8.0]]
    assert rt.scores.tolist() == [1.0, 1.0] and rt.query.tolist() == t.query.tolist()
    assert pad_columns(rt.values, 6).tolist() == [[0, 1, 2, 0, 0, 0], [6, 7, 8, 0, 0, 0]]


def test_trim_padding_columns_any_padding_side():
    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [0, 8, 9, 0, 0, 0], [0, 0, 0, 4, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 0, 0]])
    t_ids, t_mask = reward_model.trim_padding_columns(ids, mask)
    assert t_ids.tolist() == [[0, 5, 6, 7], [8, 9, 0, 0], [0, 0, 4, 0]]
    assert t_mask.sum() == mask.sum()
    assert reward_model.last_token_index(t_mask).tolist() == [3, 1, 2]


# --- trimmed vs padded forwards and update on tiny models ----------------------------------------


def make_trainer(model_dir, rm_dir, prompt_file, out, **kw) -> ppo_trainer.PPOTrainer:
    """The real trainer (`helpers.tiny_ppo_trainer`) of one PPO epoch over R new tokens, no held-out evaluation."""
    cfg = ppo_config(
        model_dir,
        rm_dir,
        prompt_file,
        out,
        ppo_epochs=1,
        max_new_tokens=R,
        learning_rate=1e-2,
        eval_every=0,
        kl_target=6.0,
        kl_horizon=10000,
        **kw,
    )
    return tiny_ppo_trainer(cfg)


def fixed_samples(trainer: ppo_trainer.PPOTrainer) -> Samples:
    """8 prompts of 2-4 tokens, left-padded plus EXTRA_QUERY_PAD columns; responses of random tokens with
    the EOS at EOS_AT, right-padded to R: each micro-batch of 4 has its own longest query and response."""
    tok = trainer.tokenizer
    eos, pad = tok.eos_token_id, tok.pad_token_id
    query, query_mask = left_pad([trainer.collector.prompts[i] for i in range(8)], pad)  # (8, P)
    query = torch.cat([torch.full((8, EXTRA_QUERY_PAD), pad), query], dim=1)
    query_mask = torch.cat([torch.zeros((8, EXTRA_QUERY_PAD), dtype=torch.long), query_mask], dim=1)
    response = torch.randint(eos + 1, len(tok), (8, R), generator=torch.Generator().manual_seed(0))
    for i, t in enumerate(EOS_AT):
        response[i, t] = eos
    response_mask = token_math.response_mask_from_tokens(response=response, eos_token_id=eos)  # (8, R)
    response = torch.where(response_mask, response, pad)
    return Samples(query=query, query_mask=query_mask, response=response, response_mask=response_mask)


def rollout_with(trainer, samples, monkeypatch, trim=None, rm_trim=None) -> tuple[Rollout, list[int]]:
    """trainer.rollout on `samples`, with `Samples.trimmed` / the RM's trim replaced if given; also the
    widths (P' + R') of the sequences the policy network ran on."""
    widths = []
    handle = trainer.unwrapped_policy.lm.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    with monkeypatch.context() as m:
        if trim is not None:
            m.setattr(Samples, "trimmed", trim)
        if rm_trim is not None:
            m.setattr(reward_model, "trim_padding_columns", rm_trim)
        trainer.collector.generate = lambda queries, sampling=None: samples
        try:
            return trainer.rollout(trainer.collector.queries(trainer.step))[0], widths
        finally:
            handle.remove()
            del trainer.collector.generate


def assert_same_rollout(a: Rollout, b: Rollout) -> None:
    mask = a.response_mask
    for name in ("logprobs", "values", "entropy", "ref_logprobs"):
        assert_same(getattr(a, name)[mask], getattr(b, name)[mask], name)
    assert_same(a.scores, b.scores, "scores")


@pytest.fixture()
def tiny_policies(tiny_model_dir, tiny_llama_dir) -> dict:
    """The tiny policies by architecture: "gpt2" and "llama"."""
    return {"gpt2": tiny_model_dir, "llama": tiny_llama_dir}


@pytest.mark.parametrize(
    "policy, value_model, use_lora", [("gpt2", "policy", False), ("llama", "reward", True)]
)
@pytest.mark.slow
def test_trimmed_forwards_match_padded(
    policy, value_model, use_lora, tiny_policies, tiny_rm_dir, prompt_file, tmp_path, monkeypatch
):
    """Policy log-probs, values (value head or RM critic), entropy, reference log-probs (a frozen copy or
    the LoRA base) and RM scores: trimmed == padded at every real position."""
    model_dir = tiny_policies[policy]
    trainer = make_trainer(
        model_dir, tiny_rm_dir, prompt_file, tmp_path, value_model=value_model, use_lora=use_lora
    )
    samples = fixed_samples(trainer)
    P = samples.query.shape[1]
    trimmed, widths = rollout_with(trainer, samples, monkeypatch)
    padded, widths_padded = rollout_with(
        trainer, samples, monkeypatch, trim=no_trim, rm_trim=lambda ids, mask: (ids, mask)
    )
    assert set(widths_padded) == {P + R}
    assert max(widths) <= P - EXTRA_QUERY_PAD + max(EOS_AT) + 1  # the policy and reference ran trimmed
    assert_same_rollout(trimmed, padded)
    beyond = torch.arange(R) > max(EOS_AT)  # (R,) columns past every real response token
    for name in ("logprobs", "values", "entropy", "ref_logprobs"):
        assert (getattr(trimmed, name)[:, beyond] == 0).all(), name  # padded back with zeros

    # A trim that drops one real token does not pass the same comparison.
    for wrong in (
        dict(trim=drops_last_response_column),
        dict(trim=drops_first_query_column),
        dict(rm_trim=rm_drops_last_column),
    ):
        off_by_one, _ = rollout_with(trainer, samples, monkeypatch, **wrong)
        with pytest.raises(AssertionError):
            assert_same_rollout(off_by_one, padded)


def one_update(trainer, rollout, monkeypatch, trim=None) -> tuple[list[torch.Tensor], dict]:
    """One PPO epoch (2 minibatches of 2 micro-batches) on `rollout` with fixed advantages and returns:
    the raw gradients of the first minibatch (accumulated over its micro-batches, before clipping) and
    the parameters after the epoch's optimiser steps."""
    advantages = torch.randn(rollout.logprobs.shape, generator=torch.Generator().manual_seed(1))
    returns = torch.randn(rollout.logprobs.shape, generator=torch.Generator().manual_seed(2))
    grads, calls = [], []
    backward = trainer.accelerator.backward

    def backward_and_record(loss):
        backward(loss)
        calls.append(1)
        if len(calls) == trainer.cfg.gradient_accumulation_steps:  # the first minibatch is complete
            grads.extend(p.grad.detach().clone() for p in trainer.trainable_parameters())

    with monkeypatch.context() as m:
        m.setattr(trainer.accelerator, "backward", backward_and_record)
        if trim is not None:
            m.setattr(Samples, "trimmed", trim)
        torch.manual_seed(0)  # the minibatch shuffle
        trainer.train_on_rollout(rollout, advantages * rollout.response_mask, returns * rollout.response_mask)
    return grads, {n: p.detach().clone() for n, p in trainer.unwrapped_policy.named_parameters()}


def test_trimmed_update_matches_padded(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch):
    """The gradients before clipping and the parameters after the optimiser steps of one PPO epoch over
    shuffled minibatches and micro-batches, each trimmed to its own rows: as with no trimming."""
    kw = dict(gradient_accumulation_steps=2)
    first = make_trainer(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "a", **kw)
    rollout, _ = rollout_with(first, fixed_samples(first), monkeypatch)
    results = {}
    for name, trim in (("trimmed", None), ("padded", no_trim), ("off_by_one", drops_last_response_column)):
        trainer = (
            first
            if name == "trimmed"
            else make_trainer(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / name, **kw)
        )
        results[name] = one_update(trainer, rollout, monkeypatch, trim=trim)
    (grads, params), (grads_padded, params_padded) = results["trimmed"], results["padded"]
    assert len(grads) == len(grads_padded) > 0
    for i, (g, h) in enumerate(zip(grads, grads_padded)):
        assert g.abs().sum() > 0
        assert_same(g, h, f"gradient {i}", atol=1e-6, rtol=1e-4)
    for n in params:
        assert_same(params[n], params_padded[n], n, atol=5e-6, rtol=1e-5)
    grads_wrong, _ = results["off_by_one"]
    assert len(grads_wrong) == len(grads_padded)
    with pytest.raises(AssertionError):
        for i, (g, h) in enumerate(zip(grads_wrong, grads_padded)):
            assert_same(g, h, f"gradient {i}", atol=1e-6, rtol=1e-4)
