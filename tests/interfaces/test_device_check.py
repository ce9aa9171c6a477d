"""The device check: the placement tracer (`device_check.on_device`) raises what CUDA raises where an
op mixes a tensor on the device with one on the host, and the Python API's entry points, given models that
live on the device, run under it: each moves what it makes to its model's device."""

from __future__ import annotations

import pytest
import torch
from device_check import MESSAGE, on_device
from helpers import SENTENCES, SENTIMENT_JUDGE, preference_rows

import llm_rlhf
from llm_rlhf.models.loading import load_causal_lm, load_tokenizer
from llm_rlhf.models.reward_model import load_reward_model, score_pairs

SAME_DEVICE = r"^Expected all tensors to be on the same device"
TINY_PPO = dict(
    steps=1,
    rollout_batch_size=4,
    mini_batch_size=2,
    ppo_epochs=1,
    max_new_tokens=4,
    save_steps=0,
    eval_every=0,
    log_samples_every=0,
    learning_rate=1e-3,
)
PROMPTS = [" ".join(s.split(" ")[:3]) for s in SENTENCES[:4]]


# --- the tracer ------------------------------------------------------------------------------------------


def tiny_lm():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(16, 4), torch.nn.Linear(4, 3))


def test_host_ids_into_a_placed_model_raise_and_moved_ids_pass():
    model, ids = tiny_lm(), torch.tensor([[1, 2, 3]])  # ids as a tokenizer makes them: on the host
    expected = model(ids)
    with on_device(model) as tracer:
        with pytest.raises(RuntimeError, match=SAME_DEVICE) as error:
            model(ids)
        assert str(error.value).startswith(MESSAGE) and "embedding" in str(error.value)
        moved = ids.to(next(model.parameters()).device)
        out = model(moved)
        assert tracer.is_placed(moved) and tracer.is_placed(out) and not tracer.is_placed(ids)
        assert torch.equal(out.cpu(), expected)  # torch.equal across devices raises, as on CUDA
        with pytest.raises(RuntimeError, match=SAME_DEVICE):
            out + torch.ones(3)  # a host tensor made without a device
        assert tracer.is_placed(out + torch.ones(3, device=out.device))  # a factory told the device
        assert tracer.is_placed(out * torch.tensor(2.0))  # a 0-dim host tensor: CUDA takes CPU scalars
        assert tracer.is_placed(out[torch.tensor([0])])  # host indices into a placed tensor
        back = out.cpu()
        assert not tracer.is_placed(back) and tracer.is_placed(out)  # a move copies
        assert not tracer.is_placed(out.to("cpu")) and tracer.is_placed(torch.ones(2).cuda())
        with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy"):
            out.detach().numpy()
        assert out.tolist() == expected.tolist()
        with pytest.raises(RuntimeError, match=SAME_DEVICE):
            torch.ones(3)[torch.tensor([0]).to(out.device)]  # placed indices into a host tensor


def test_a_model_that_is_moved_is_placed_and_one_that_is_not_raises():
    """What the library loads is placed once it moves it (`model.to(device)`, `accelerator.prepare`, the
    Trainer); a model it forgets to move stays on the host and its moved inputs raise."""
    placed, forgotten = tiny_lm(), tiny_lm()
    with on_device() as tracer:
        placed.to(torch.device("cpu"))
        assert all(tracer.is_placed(p) for p in placed.parameters())
        ids = torch.tensor([[1, 2]]).to(next(placed.parameters()).device)
        placed(ids).sum().backward()
        assert all(tracer.is_placed(p.grad) for p in placed.parameters())
        torch.optim.AdamW(placed.parameters()).step()  # its state is made like the weights: placed
        with pytest.raises(RuntimeError, match=SAME_DEVICE):
            forgotten(ids)
        import copy

        assert all(tracer.is_placed(p) for p in copy.deepcopy(placed).parameters())


# --- the entry points, models on the device ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_rm(tiny_rm_dir):
    return load_reward_model(tiny_rm_dir)


def test_scoring_a_placed_reward_model(tiny_rm, tiny_model_dir):
    """score_pairs and the RewardModel's own scorers, the reward model on the device."""
    expected = score_pairs(tiny_rm, PROMPTS, [" good", " bad", " fine", " dull"])
    tokenizer = load_tokenizer(str(tiny_model_dir))
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with on_device(tiny_rm) as tracer:
        scores = score_pairs(tiny_rm, PROMPTS, [" good", " bad", " fine", " dull"])
        assert torch.equal(scores, expected)
        ids, mask = (encoded[k].to(tiny_rm.model.device) for k in ("input_ids", "attention_mask"))
        assert tracer.is_placed(tiny_rm.score(ids, mask))
        assert tracer.is_placed(tiny_rm.score_samples(ids, mask, tokenizer))


def test_a_placed_reward_model_scores_host_samples(tiny_rm, tiny_model_dir):
    """A policy's samples on the host (a CPU policy, or one on another card) scored by a reward model on the
    device: the RM moves the ids to itself, and `score_samples` gives the scores back beside the samples.
    (On an H200 this raised inside the RM's embedding before RewardModel.forward moved its inputs.)"""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    ids, mask = encoded["input_ids"], encoded["attention_mask"]  # on the host
    expected = tiny_rm.score_samples(ids, mask, tokenizer)
    with on_device(tiny_rm) as tracer:
        scores = tiny_rm.score_samples(ids, mask, tokenizer)
        assert tracer.is_placed(tiny_rm.score(ids, mask))  # forward's scores: on the RM's device
    torch.testing.assert_close(scores, expected, rtol=0, atol=0)


@pytest.mark.parametrize("peft", [False, True])
def test_train_ppo_with_a_placed_policy_and_reward_model(
    peft, tiny_model_dir, tiny_rm, prompt_file, tmp_path
):
    """Objects on the device, with the held-out evaluation PPO runs between steps and keep_best's reload of
    the best evaluation's weights; a peft policy (its reference: the policy with the adapter disabled)."""
    policy, tokenizer = load_causal_lm(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir))
    if peft:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM")
        policy = get_peft_model(policy, lora)
    keys = dict(
        TINY_PPO,
        steps=2,
        eval_every=1,
        eval_prompt_file=str(prompt_file),
        eval_num_prompts=4,
        keep_best=True,
        gold_judge=SENTIMENT_JUDGE,
        output_dir=str(tmp_path / "ppo"),
    )
    with on_device(policy, tiny_rm):
        result = llm_rlhf.train_ppo(
            keys,
            policy=policy,
            tokenizer=tokenizer,
            reward_model=[tiny_rm, tiny_rm],
            reward_fn=lambda prompts, responses: [len(r) for r in responses],
            prompts=PROMPTS,
        )
    assert result.model is policy and result.metrics["returned_step"] is not None


def test_train_ppo_from_folders(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """The command's path: every model loaded from a folder, placed where the run moves it."""
    keys = dict(
        model_name_or_path=str(tiny_model_dir),
        reward_model_path=str(tiny_rm_dir),
        prompt_file=str(prompt_file),
        output_dir=str(tmp_path / "ppo"),
        **TINY_PPO,
    )
    with on_device():
        llm_rlhf.train_ppo(keys)


def test_train_reward_model_on_a_placed_model(tiny_model_dir, tmp_path):
    model = load_causal_lm(str(tiny_model_dir))
    rows = preference_rows()
    keys = dict(
        output_dir=str(tmp_path / "rm"),
        max_steps=1,
        per_device_train_batch_size=4,
        logging_steps=1,
        eval_steps=0,
        max_length=48,
    )
    with on_device(model):
        result = llm_rlhf.train_reward_model(
            keys,
            model=model,
            tokenizer=load_tokenizer(str(tiny_model_dir)),
            train_data=rows * 2,
            eval_data=rows,
            test_data=rows,
        )
    assert result.metrics["global_step"] == 1


def test_train_sft_on_a_placed_model(tiny_model_dir, tmp_path):
    model = load_causal_lm(str(tiny_model_dir))
    rows = [
        {"prompt": "the film was", "completion": " good and fun"},
        {"prompt": "a plot", "completion": " dull"},
    ]
    keys = dict(
        output_dir=str(tmp_path / "sft"),
        max_steps=1,
        per_device_train_batch_size=2,
        logging_steps=1,
        eval_steps=0,
        num_samples=2,
        max_new_tokens=4,
        max_length=32,
    )
    with on_device(model):
        result = llm_rlhf.train_sft(
            keys,
            model=model,
            tokenizer=load_tokenizer(str(tiny_model_dir)),
            train_data=rows * 2,
            eval_data=rows,
        )
    assert result.metrics["global_step"] == 1


def test_run_eval_with_placed_models(tiny_model_dir, tiny_rm, tmp_path):
    from helpers import build_model

    baseline_dir = build_model(tmp_path / "baseline", seed=1)
    models = dict(
        policy=load_causal_lm(str(tiny_model_dir)),
        baseline=load_causal_lm(str(baseline_dir)),
        reference=load_causal_lm(str(baseline_dir)),
    )
    keys = dict(
        gold_judge=SENTIMENT_JUDGE,
        num_prompts=4,
        max_new_tokens=4,
        print_samples=0,
        output_dir=str(tmp_path / "eval"),
    )
    with on_device(tiny_rm, *models.values()):
        metrics = llm_rlhf.run_eval(
            keys,
            **models,
            tokenizer=load_tokenizer(str(tiny_model_dir)),
            reward_model=tiny_rm,
            reward_fn=lambda prompts, responses: [len(r) for r in responses],
            prompts=PROMPTS,
        )
    assert metrics["rm_score_mean"] is not None and metrics["kl_to_ref"] is not None


def test_run_eval_from_folders(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    keys = dict(
        policy_path=str(tiny_model_dir),
        baseline_path=str(tiny_model_dir),
        reward_model_path=str(tiny_rm_dir),
        gold_judge=SENTIMENT_JUDGE,
        prompt_file=str(prompt_file),
        num_prompts=4,
        max_new_tokens=4,
        print_samples=0,
        output_dir=str(tmp_path / "eval"),
    )
    with on_device():
        metrics = llm_rlhf.run_eval(keys)
    assert metrics["rm_score_mean"] is not None


def test_helpers_a_user_calls_with_a_model_object(tiny_model_dir, tiny_rm):
    """The scoring and sampling helpers that take a model object: `score.score_texts`, DPO's
    `response_logprobs`, evaluation's `sample_batch` and `evaluate_policy` with the scorer PPO uses."""
    from llm_rlhf.evaluation.measures import (
        KLReference,
        Measures,
        PairedSampling,
        evaluate_policy,
        sample_batch,
    )
    from llm_rlhf.models.scoring import Scorer
    from llm_rlhf.rl.rollout import Sampling
    from llm_rlhf.stages.dpo import response_logprobs
    from llm_rlhf.stages.score import score_texts

    policy, reference = load_causal_lm(str(tiny_model_dir)), load_causal_lm(str(tiny_model_dir))
    tokenizer = load_tokenizer(str(tiny_model_dir))
    responses = [" good", " bad", " fine", " dull"]
    draws = PairedSampling(Sampling(max_new_tokens=4))
    with on_device(policy, reference, tiny_rm) as tracer:
        assert len(score_texts(tiny_rm, PROMPTS, responses)) == 4
        assert response_logprobs(policy, tokenizer, PROMPTS, responses).shape == (4,)
        assert tracer.is_placed(sample_batch(policy, tokenizer, PROMPTS, draws.sampling, seed=0).response)
        measures = Measures(scorer=Scorer(tiny_rm, reward_fn=None))
        figures = evaluate_policy(
            policy, tokenizer, PROMPTS, draws, measures=measures, reference=KLReference(reference)
        )
    assert figures["rm_score_mean"] is not None and figures["kl_to_ref"] == 0.0


def test_dpo_from_folders(tiny_model_dir, pref_files, tmp_path):
    """`llm-rlhf dpo`: TRL's trainer places the policy and the reference; the stage's own log-probs follow."""
    from llm_rlhf.stages import dpo

    train, val = pref_files
    cfg = dpo.Config(
        model_name_or_path=str(tiny_model_dir),
        train_file=str(train),
        eval_file=str(val),
        output_dir=str(tmp_path / "dpo"),
        max_length=32,
        max_steps=1,
        per_device_train_batch_size=4,
        logging_steps=1,
        eval_steps=0,
        save_steps=100,
    )
    with on_device():
        metrics = dpo.run(cfg)
    assert metrics["global_step"] == 1
