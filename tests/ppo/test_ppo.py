"""PPO stage: invariants at step 0, the frozen reference, padding invariance, gradient accumulation,
every parameter trained, exact resume, LoRA with one copy of the base weights; and the global batch however it
is cut: two data-parallel ranks draw different prompts, the critic-free token mean and REINFORCE++'s whitening
are over the minibatch and every process, not per micro-batch or per process."""

from __future__ import annotations

import dataclasses
import json
import threading
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    SENTENCES,
    one_update,
    perturb,
    ppo_config,
    record_raw_grads,
    recording_rollouts,
    tiny_ppo_trainer,
    use_fixed_responses,
    write_jsonl,
)
from processes import killed_and_resumed

from llm_rlhf.ppo import trainer as ppo_trainer
from llm_rlhf.ppo.config import Config, batch_sizes
from llm_rlhf.rl import ppo_math
from llm_rlhf.rl.estimators import ESTIMATORS
from llm_rlhf.rl.rollout import Samples
from llm_rlhf.stages import ppo

# --- pure helpers ------------------------------------------------------------------------------


def test_batch_size_arithmetic():
    s = batch_sizes(
        rollout_batch_size=64,
        mini_batch_size=16,
        gradient_accumulation_steps=4,
        ppo_epochs=4,
        steps=10,
        num_processes=2,
    )
    assert (s.micro_batch_per_process, s.num_mini_batches, s.optimizer_steps_per_ppo_step) == (4, 4, 16)
    assert (s.episodes_per_step, s.total_episodes) == (128, 1280)


def test_config_rejects_inconsistent_batch_sizes():
    from llm_rlhf.core.errors import ConfigError

    with pytest.raises(ConfigError, match="mini_batch_size"):
        Config(rollout_batch_size=10, mini_batch_size=4)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        Config(mini_batch_size=4, gradient_accumulation_steps=3)


# --- invariants --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "use_lora, mixed_precision, extra",
    [
        (False, "no", {}),
        (True, "no", {}),
        (False, "bf16", {}),
        (True, "bf16", {}),
        (False, "no", {"bf16": True}),
        (True, "no", {"bf16": True, "lora_layers": 1}),
    ],
)
def test_first_step_kl_zero_and_ratio_one(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, use_lora, mixed_precision, extra
):
    """mixed_precision bf16 (the sharded accelerate configs): `prepare` runs the policy under autocast,
    so the reference and the RM must run under it too. The config's own bf16 autocast (what `bf16: auto`
    turns on for a CPU with AVX512-BF16), with adapters in the last block only: still exact."""
    cfg = ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, use_lora=use_lora, **extra)
    trainer = tiny_ppo_trainer(cfg, mixed_precision=mixed_precision)
    assert trainer.accelerator.mixed_precision == mixed_precision
    rollout, _ = trainer.rollout(trainer.collector.queries(trainer.step))
    assert (rollout.trunk is not None) == (
        "lora_layers" in extra
    )  # block 0's output reused (reuse_frozen_blocks)
    ref = trainer.reference_logprobs(rollout)
    kl = (rollout.logprobs - ref)[rollout.response_mask]
    assert torch.equal(kl, torch.zeros_like(kl))  # exactly 0: same weights, same code path
    # The first PPO epoch's forwards: the rollout's micro-batches in rollout order, each trimmed to its own
    # rows (`train_on_rollout`). The same shapes as the rollout's chunks, so equal bit for bit on any CPU; a
    # forward over the whole batch at once would change the matmul shapes and with them the float rounding.
    logprobs = trainer.in_chunks(lambda part: trainer.forward_policy(part, train=True)[0], rollout)
    ratio = torch.exp(logprobs - rollout.logprobs)[rollout.response_mask]
    assert torch.equal(ratio, torch.ones_like(ratio))


def test_value_head_starts_at_zero_and_learns(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """Zero-initialised value head: V = 0 at every position of the first rollout; one step moves it."""
    trainer = tiny_ppo_trainer(ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, ppo_epochs=1))
    rollout, _ = trainer.rollout(trainer.collector.queries(trainer.step))
    assert torch.equal(rollout.values, torch.zeros_like(rollout.values))
    trainer.ppo_step()
    assert trainer.unwrapped_policy.value_head.summary.weight.abs().sum() > 0


def test_reference_bit_identical_after_steps(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    trainer = tiny_ppo_trainer(ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, steps=3))
    before = {k: v.clone() for k, v in trainer.ref_model.state_dict().items()}
    rm_before = {k: v.clone() for k, v in trainer.collector.scorer.reward_model.state_dict().items()}
    assert trainer.ref_model.lm is not trainer.unwrapped_policy.lm
    for _ in range(3):
        trainer.ppo_step()
    for k, v in trainer.ref_model.state_dict().items():
        assert torch.equal(v, before[k]), k
    for k, v in trainer.collector.scorer.reward_model.state_dict().items():
        assert torch.equal(v, rm_before[k]), k


def test_logprobs_and_values_independent_of_padding_and_batch(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path
):
    trainer = tiny_ppo_trainer(ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path))
    tok = trainer.tokenizer
    q_short, q_long = tok("The film")["input_ids"], tok("It's a wonderful movie that")["input_ids"]
    r_short, r_long = tok(" is good")["input_ids"], tok(" everyone should see this one")["input_ids"]

    def rollout_of(pairs, extra_query_pad=0, extra_response_pad=0):
        P = max(len(q) for q, _ in pairs) + extra_query_pad
        R = max(len(r) for _, r in pairs) + extra_response_pad
        query = torch.full((len(pairs), P), tok.pad_token_id)
        qmask = torch.zeros((len(pairs), P), dtype=torch.long)
        response = torch.full((len(pairs), R), tok.pad_token_id)
        rmask = torch.zeros((len(pairs), R), dtype=torch.bool)
        for i, (q, r) in enumerate(pairs):
            query[i, P - len(q) :], qmask[i, P - len(q) :] = torch.tensor(q), 1
            response[i, : len(r)], rmask[i, : len(r)] = torch.tensor(r), True
        return Samples(query=query, query_mask=qmask, response=response, response_mask=rmask)

    with torch.no_grad():
        alone = trainer.forward_policy(rollout_of([(q_short, r_short)]))
        batched = trainer.forward_policy(rollout_of([(q_long, r_long), (q_short, r_short)]))
        padded = trainer.forward_policy(
            rollout_of([(q_short, r_short)], extra_query_pad=5, extra_response_pad=4)
        )
    n = len(r_short)
    for a, b, c in zip(alone, batched, padded):
        torch.testing.assert_close(a[0, :n], b[1, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a[0, :n], c[0, :n], atol=1e-5, rtol=1e-5)


def test_gradient_accumulation_equivalence(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """One minibatch of 8 == 8 accumulated micro-batches of 1: the RAW gradient before clipping (an Adam
    step or a clipped gradient would hide a wrong loss scale), and the update. The responses have
    different lengths (2 to 8 tokens, `use_fixed_responses`), so averaging per micro-batch instead of per
    token of the minibatch gives another gradient and fails this test."""
    results, grads = [], []
    for ga in (1, 8):
        cfg = ppo_config(
            tiny_model_dir,
            tiny_rm_dir,
            prompt_file,
            tmp_path / str(ga),
            rollout_batch_size=8,
            mini_batch_size=8,
            gradient_accumulation_steps=ga,
            ppo_epochs=1,
            learning_rate=1e-2,
            max_grad_norm=1e9,
        )
        raw = []
        results.append(
            one_update(cfg, lambda trainer, raw=raw: record_raw_grads(trainer, raw), fixed_responses=True)
        )
        assert len(raw) == 1, "one optimiser step"
        grads.append(raw[0])
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-7, rtol=1e-4)
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], atol=2e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize("policy", ["gpt2", "llama"])
def test_first_epoch_ratio_exactly_one_with_responses_that_end_early(
    tiny_model_dir, tiny_llama_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch, policy
):
    """rho == 1 exactly before the first update (the old policy is the policy). Every micro-batch of the first minibatch comes
    before that update; responses ending at different positions give the micro-batches different trimmed
    widths (and the old log-probs must come from forwards of the same rows at the same widths)."""
    model_dir = tiny_model_dir if policy == "gpt2" else tiny_llama_dir
    cfg = ppo_config(
        model_dir,
        tiny_rm_dir,
        prompt_file,
        tmp_path,
        rollout_batch_size=8,
        max_new_tokens=16,
        mini_batch_size=8,
        gradient_accumulation_steps=4,
        ppo_epochs=1,
    )
    trainer = tiny_ppo_trainer(cfg)
    use_fixed_responses(trainer)
    ratios, policy_loss = [], ppo_trainer.ppo_math.policy_loss

    def recording(**kw):
        loss, stats = policy_loss(**kw)
        ratios.append(stats.ratio[kw["response_mask"]])
        return loss, stats

    monkeypatch.setattr(ppo_trainer.ppo_math, "policy_loss", recording)
    metrics = trainer.ppo_step()
    assert len(ratios) == 4 and metrics["policy/approxkl"] == 0.0
    widths = {int(r.numel()) for r in ratios}
    assert len(widths) > 1, "the micro-batches hold responses of different lengths"
    ratio = torch.cat(ratios)
    assert torch.equal(ratio, torch.ones_like(ratio))


def test_response_logprobs_sum_to_the_models_own_lm_loss(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """An independent check of the token alignment: the sum of a response's log-probs from the PPO
    forward (padded on both sides, batched with a longer row) equals minus the model's own shifted LM
    loss (transformers shifts the labels) on the unpadded query + response, times the response length."""
    trainer = tiny_ppo_trainer(ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path))
    tok, lm = trainer.tokenizer, trainer.unwrapped_policy.lm
    pairs = [
        (tok("The film")["input_ids"], tok(" is good")["input_ids"] + [tok.eos_token_id]),
        (tok("It's a wonderful movie that")["input_ids"], tok(" everyone should see this one")["input_ids"]),
    ]
    P, R = max(len(q) for q, _ in pairs) + 3, max(len(r) for _, r in pairs) + 4  # extra padding both sides
    query, qmask = torch.full((2, P), tok.pad_token_id), torch.zeros((2, P), dtype=torch.long)
    response, rmask = torch.full((2, R), tok.pad_token_id), torch.zeros((2, R), dtype=torch.bool)
    for i, (q, r) in enumerate(pairs):
        query[i, P - len(q) :], qmask[i, P - len(q) :] = torch.tensor(q), 1
        response[i, : len(r)], rmask[i, : len(r)] = torch.tensor(r), True
    with torch.no_grad():
        logprobs, _, _ = trainer.forward_policy(
            Samples(query=query, query_mask=qmask, response=response, response_mask=rmask)
        )
        for i, (q, r) in enumerate(pairs):
            ids = torch.tensor([q + r])
            labels = ids.clone()
            labels[:, : len(q)] = -100  # loss on the response tokens only
            expected = -lm(input_ids=ids, labels=labels).loss * len(r)
            assert logprobs[i][rmask[i]].sum().item() == pytest.approx(expected.item(), abs=1e-4, rel=1e-5)
            assert torch.all(logprobs[i][~rmask[i]] == 0)


def test_reusing_the_frozen_blocks_trains_as_the_full_forwards(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path
):
    """reuse_frozen_blocks (adapters in block 1 of 2): block 0 runs once per rollout, and three PPO steps log
    the metrics and leave the adapters of the run whose every forward runs both blocks, up to float rounding
    (the shuffled epochs' micro-batches are trimmed to other widths than the chunks block 0 ran on)."""
    runs = {}
    for reuse in (True, False):
        cfg = ppo_config(
            tiny_model_dir,
            tiny_rm_dir,
            prompt_file,
            tmp_path / str(reuse),
            use_lora=True,
            lora_layers=1,
            reuse_frozen_blocks=reuse,
            steps=3,
        )
        trainer = tiny_ppo_trainer(cfg)
        assert trainer.trunk_blocks == (1 if reuse else 0)
        calls = []  # block 0's own computation (its first layer norm), not a skipped call
        block0 = trainer.unwrapped_policy.lm.base_model.model.transformer.h[0]
        block0.ln_1.register_forward_pre_hook(lambda m, a, calls=calls: calls.append(1))
        metrics = [trainer.ppo_step() for _ in range(cfg.steps)]
        adapters = {
            n: p.detach().clone() for n, p in trainer.unwrapped_policy.named_parameters() if p.requires_grad
        }
        runs[reuse] = metrics, adapters, len(calls)
    (reused, reused_adapters, reused_calls), (full, full_adapters, full_calls) = runs[True], runs[False]
    # per step: the sampler's prefill and decode steps run block 0 either way; with reuse its rollout chunks
    # run it once, without it the old policy's, the reference's and each epoch's micro-batches do
    assert reused_calls < full_calls
    for a, b in zip(reused, full):
        for key in ("objective/scores", "objective/kl", "loss/policy", "loss/value", "policy/approxkl"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    for name, p in full_adapters.items():
        torch.testing.assert_close(reused_adapters[name], p, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("use_lora, lora_layers", [(False, None), (True, None), (True, 1)])
def test_every_trainable_parameter_changes(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, use_lora, lora_layers
):
    """lora_layers 1: the adapters (peft's default, c_attn for GPT-2) are in the last of the two blocks only."""
    cfg = ppo_config(
        tiny_model_dir,
        tiny_rm_dir,
        prompt_file,
        tmp_path,
        use_lora=use_lora,
        lora_layers=lora_layers,
        steps=2,
    )
    trainer = tiny_ppo_trainer(cfg)
    before = {
        n: p.detach().clone() for n, p in trainer.unwrapped_policy.named_parameters() if p.requires_grad
    }
    assert before
    adapters = [n for n in before if "lora_" in n]
    assert len(adapters) == (0 if not use_lora else 4 if lora_layers is None else 2), adapters
    if lora_layers == 1:
        assert all(".h.1.attn.c_attn." in n for n in adapters), adapters
    for _ in range(cfg.steps):
        metrics = trainer.ppo_step()
    unchanged = [
        n
        for n, p in trainer.unwrapped_policy.named_parameters()
        if p.requires_grad and torch.equal(p, before[n])
    ]
    assert not unchanged
    for key in (
        "objective/scores",
        "objective/kl",
        "objective/kl_coef",
        "policy/approxkl",
        "policy/clipfrac",
        "loss/policy",
        "loss/value",
        "val/clipfrac",
        "val/explained_variance",
        "eos_rate",
        "tokens_per_s",
    ):
        assert key in metrics


def test_lora_holds_one_copy_of_base_weights(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    trainer = tiny_ppo_trainer(ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, use_lora=True))
    policy_ptrs = {p.data_ptr() for p in trainer.unwrapped_policy.parameters()}
    ref_ptrs = {p.data_ptr() for p in trainer.ref_model.parameters()}
    assert ref_ptrs <= policy_ptrs  # the reference owns no weights of its own
    base = sum(p.numel() for n, p in trainer.unwrapped_policy.lm.named_parameters() if "lora_" not in n)
    from transformers import AutoModelForCausalLM

    plain = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert base == plain


def test_run_writes_hf_folder_and_metrics(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    final = ppo.run(ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, out, steps=3))
    metrics = json.loads((out / "metrics.json").read_text())
    for key in (
        "objective/scores",
        "objective/kl",
        "objective/kl_coef",
        "scores_first",
        "scores_last",
        "scores_std_first",
        "kl_last",
        "kl_target",
    ):
        assert key in metrics
    assert metrics["scores_last"] == final["scores_last"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size > 0
    assert (out / "value_head.safetensors").exists() and (out / "config.yaml").exists()


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch
):
    kw = dict(steps=4, save_steps=2, lr_scheduler_type="linear")
    a, b = killed_and_resumed(
        lambda out, **more: ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, out, **kw, **more),
        tmp_path,
        monkeypatch,
    )
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for ma, mb in zip(a, b):
        for k, v in ma.items():
            if not k.startswith(("time/", "tokens_per_s")):
                assert mb[k] == pytest.approx(v, rel=1e-6, abs=1e-7, nan_ok=True), (ma["step"], k)


def test_config_dataclass_is_flat(tmp_path, monkeypatch):
    """One flat dataclass: every field is a scalar or a list of scalars (no nested config) with its help
    text, and every one is reachable from the command line and from a YAML recipe: each set to a value
    other than its default comes back as given, so any key of a recipe can be overridden by a flag."""
    import yaml

    from llm_rlhf.core.config import _base_types, parse_config

    ONLY_VALUE = ("top_k", "top_p")  # PPO accepts one value of these (off), given explicitly here
    hints = typing.get_type_hints(Config)
    default = Config()
    for f in dataclasses.fields(Config):
        assert "help" in f.metadata and f.metadata["help"], f.name
        assert set(_base_types(hints[f.name])) <= {bool, int, float, str, list, type(None)}, f.name
        assert not dataclasses.is_dataclass(getattr(default, f.name)), f.name
    changed = {  # a value of each field's type, valid together, none equal to the default but the estimator's
        "reward_model_path": ["a", "b"],
        "reward_fn": "m:f",
        "accuracy_fn": "m:g",
        "lora_target_modules": ["c_attn"],
        "stop_strings": ["\n"],
        "eos_penalty": -1.0,
        "score_clip": 3.0,
        "target_approxkl": 0.5,
        "eval_prompt_file": "eval.jsonl",
        "data_format": "hh",
        "system_prompt": "",
        "dtype": "bfloat16",
        "value_model": "reward",
        "lr_scheduler_type": "linear",
        "kl_estimator": "k3",
        "kl_controller": "fixed",
        "report_to": "tensorboard",
        "ensemble_combine": "min",
        "rollout_batch_size": 32,
        "mini_batch_size": 8,
        "min_new_tokens": 2,
        "advantage_estimator": "gae",
        "kl_in_loss": True,
        "eval_batch_size": 16,
        "sampling_dtype": "bfloat16",
        "sampling_compile": False,  # compiled steps sample float32 only: set in the critic-free config below
        **{key: getattr(default, key) for key in ONLY_VALUE},
        # the policy-loss family: cispo with gae here; dual_clip and cliprange_low with ppo_clip, dynamic
        # sampling with a group baseline in the configs below
        "policy_loss": "cispo",
        "cliprange_low": None,
        "cliprange_high": 0.28,
        "dual_clip": None,
        "loss_aggregation": "token_sum_norm",
        "sampler_correction": "tis",
        "sampler_correction_cap": 1.5,
        "overlong_buffer": 4,
        "overlong_penalty": 0.5,
        "dynamic_sampling": False,
        "environment": None,  # episodes: set in the critic-free config below (min_new_tokens 0 there)
        "task": None,  # set in the grouped config below (its files: tests/recipes_and_docs/test_stage_files.py)
        "lora_layers": 2,  # the tiny model's 2 blocks
        "pass_k": 1,  # read by pass_at_k alone: set in its config below
        "eval_samples_per_prompt": 4,
        "eval_pass_at_k": [1, 2],
        "teacher_model_path": "runs/teacher",
        "teacher_dtype": "bfloat16",
        "teacher_device": "cpu",
        "distill_loss": "jsd",
        "distill_jsd_beta": 0.3,
    }
    for f in dataclasses.fields(Config):
        value = getattr(default, f.name)
        if f.name not in changed:
            changed[f.name] = (
                (not value)
                if isinstance(value, bool)
                else value + 1
                if isinstance(value, (int, float))
                else value + "x"
            )
    # A critic-free estimator reads none of the value function's keys nor gamma (each is an error when set):
    # its value in a config of its own, theirs at their defaults.
    critic_free = {
        **changed,
        **{key: getattr(default, key) for key in ESTIMATORS["remax"].ignored_keys},
        "advantage_estimator": "remax",
        "sampling_compile": True,
        "sampling_dtype": "float32",
        "policy_loss": "ppo_clip",
        "cliprange_low": 0.1,
        "dual_clip": 3.0,
        "environment": "calculator",
        "min_new_tokens": 0,
    }
    grouped = {
        **critic_free,
        "advantage_estimator": "grpo",
        "dynamic_sampling": True,
        "policy_loss": "gspo",
        "environment": None,
        "task": "chain_sum-t2d1",  # fills nothing here: every key it would fill is set
    }
    grouped["dual_clip"] = None
    passk = {**grouped, "advantage_estimator": "pass_at_k", "samples_per_prompt": 4, "pass_k": 2}
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the task's folder, relative to the repo root
    for values in (changed, critic_free, grouped, passk):
        recipe = tmp_path / "ppo.yaml"
        recipe.write_text(yaml.safe_dump(values))
        from_yaml = parse_config(Config, ["--config", str(recipe)])
        flags = [
            item
            for key, value in values.items()
            for item in (
                f"--{key}",
                yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip(),
            )
        ]
        from_flags = parse_config(Config, flags)
        for key, value in values.items():
            assert getattr(from_yaml, key) == getattr(from_flags, key) == value, key
    for key in changed:  # each key set to another value than its default in one of the two
        assert (
            key in ONLY_VALUE
            or getattr(default, key) != changed[key]
            or getattr(default, key) != critic_free[key]
            or getattr(default, key) != grouped[key]
            or getattr(default, key) != passk[key]
        ), key


def test_gradient_checkpointing_recomputes_and_gives_the_same_update(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path
):
    """With checkpointing each transformer block's insides run twice per training micro-batch (once more
    when the backward pass recomputes them) and the update is the same as without it."""
    calls = {}

    def count_block_forwards(trainer):
        block = trainer.unwrapped_policy.lm.transformer.h[0].attn  # inside the checkpointed block forward
        calls["n"] = 0
        block.register_forward_pre_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))

    results = {}
    for ckpt in (False, True):
        cfg = ppo_config(
            tiny_model_dir,
            tiny_rm_dir,
            prompt_file,
            tmp_path / str(ckpt),
            rollout_batch_size=8,
            mini_batch_size=4,
            ppo_epochs=1,
            gradient_checkpointing=ckpt,
        )
        results[ckpt] = one_update(cfg, count_block_forwards)
        results[f"calls_{ckpt}"] = calls["n"]
    assert results["calls_False"] == 2, "two minibatches of 4, one forward each"
    assert results["calls_True"] == 4, "each forward recomputed in the backward pass"
    for k in results[False]:
        torch.testing.assert_close(results[True][k], results[False][k], atol=1e-6, rtol=1e-5, msg=k)


def test_bf16_autocast_trains_in_bf16_and_stays_close_to_fp32(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path
):
    """--bf16 runs the training forward under bf16 autocast on CPU (the LM head's output is bf16); the
    weights stay fp32 and the update moves them about as far as the fp32 update does."""
    dtypes = []

    def record_head_dtype(trainer):
        trainer.unwrapped_policy.lm.lm_head.register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))

    start = {
        k: v.detach().clone()
        for k, v in tiny_ppo_trainer(
            ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "init")
        ).unwrapped_policy.named_parameters()
    }
    updates = {}
    for bf16 in (False, True):
        cfg = ppo_config(
            tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / str(bf16), ppo_epochs=1, bf16=bf16
        )
        dtypes.clear()
        after = one_update(cfg, record_head_dtype)
        assert dtypes and set(dtypes) == {torch.bfloat16 if bf16 else torch.float32}
        assert all(p.dtype == torch.float32 for p in after.values())
        updates[bf16] = torch.cat([(after[k] - start[k]).flatten() for k in start])
    assert updates[True].abs().sum() > 0
    cosine = torch.nn.functional.cosine_similarity(updates[True], updates[False], dim=0)
    assert cosine > 0.9, f"bf16 and fp32 updates point different ways (cosine {cosine:.3f})"


# --- micro-batches, data-parallel ranks and the global batch --------------------------------------------
# Two data-parallel ranks are simulated in one process where the code reads only the rank
# (`accelerator.process_index`) or sums over the ranks (`accelerator.reduce`): the real methods run, the
# stand-in accelerator gives them the rank, or the sum over two threads that play the two ranks.


def test_two_ranks_draw_different_prompts_whose_union_is_one_process_prompts(tiny_model_dir, tmp_path):
    """18 distinct prompts, 6 per step: one process draws them 6 at a time; two ranks of 3 prompts each, the
    same run on 2 processes (`batch_sizes` with num_processes 2, the rank given to `next_queries` as
    `accelerator.process_index`), draw different prompts at every step, rank 0's then rank 1's being the one
    process's 6, and the 3 steps of the first pass over the data hold every prompt once. Fails if every
    rank gets the same prompts."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{i}: {SENTENCES[i % 10]}"} for i in range(18)])

    def trainer_for(rollout_batch_size: int, num_processes: int):
        cfg = ppo_config(
            tiny_model_dir,
            None,
            prompts,
            tmp_path,
            reward_fn="reward_fns:half",
            rollout_batch_size=rollout_batch_size,
            mini_batch_size=rollout_batch_size,
            seed=3,
        )
        trainer = tiny_ppo_trainer(cfg)
        trainer.context.sizes = batch_sizes(
            rollout_batch_size=rollout_batch_size,
            mini_batch_size=rollout_batch_size,
            gradient_accumulation_steps=1,
            ppo_epochs=cfg.ppo_epochs,
            steps=cfg.steps,
            num_processes=num_processes,
        )
        return trainer

    one, ranks = trainer_for(6, 1), trainer_for(3, 2)
    assert ranks.sizes.prompts_per_step == one.sizes.prompts_per_step == 6
    real_accelerator, seen = ranks.accelerator, []
    for step in range(4):  # step 3 starts the second pass, in another order
        drawn = []
        for rank in (0, 1):
            ranks.context.accelerator = SimpleNamespace(process_index=rank)
            drawn.append(ranks.collector.queries(step))
        ranks.context.accelerator = real_accelerator
        assert len(drawn[0]) == len(drawn[1]) == 3
        assert not set(map(tuple, drawn[0])) & set(map(tuple, drawn[1])), (
            f"step {step}: the ranks share a prompt"
        )
        assert drawn[0] + drawn[1] == one.collector.queries(step), step
        if step < 3:
            seen += drawn[0] + drawn[1]
    assert sorted(seen) == sorted(one.collector.prompts), "the first pass holds every prompt once"


def test_critic_free_token_mean_is_over_the_minibatch_not_per_micro_batch(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path
):
    """A grpo step with the KL in the loss, responses of 2 to 8 tokens (`use_fixed_responses`) and the policy
    moved off the reference (the policy loss and the KL loss both have gradients): one minibatch of 8 and 8
    accumulated micro-batches of 1 give the same raw gradient. Fails if each micro-batch's mean is averaged
    instead of weighted by its share of the minibatch's tokens."""
    grads = []
    for ga in (1, 8):
        cfg = ppo_config(
            tiny_model_dir,
            tiny_rm_dir,
            prompt_file,
            tmp_path / str(ga),
            advantage_estimator="grpo",
            samples_per_prompt=2,
            rollout_batch_size=4,
            mini_batch_size=8,
            gradient_accumulation_steps=ga,
            ppo_epochs=1,
            max_grad_norm=1e9,
            kl_controller="fixed",
            init_kl_coef=0.5,
        )
        trainer, raw = tiny_ppo_trainer(cfg), []
        use_fixed_responses(trainer)
        perturb(trainer.unwrapped_policy, seed=1)
        record_raw_grads(trainer, raw)
        metrics = trainer.ppo_step()
        assert len(raw) == 1 and metrics["loss/kl"] > 0
        grads.append(raw[0])
    assert grads[0].abs().max() > 1e-4
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6 * float(grads[0].abs().max()), rtol=1e-4)


def reinforce_pp_config(tiny_model_dir, tiny_rm_dir, prompt_file, out, **kw):
    """reinforce_pp, 4 prompts x 2 samples, one minibatch of 8 in 4 micro-batches, the KL in the reward."""
    return ppo_config(
        tiny_model_dir,
        tiny_rm_dir,
        prompt_file,
        out,
        advantage_estimator="reinforce_pp",
        samples_per_prompt=2,
        rollout_batch_size=4,
        mini_batch_size=8,
        gradient_accumulation_steps=4,
        ppo_epochs=1,
        kl_controller="fixed",
        init_kl_coef=0.5,
        **kw,
    )


def naive_reinforce_pp(rollout, beta: float) -> torch.Tensor:
    """REINFORCE++'s advantages written out: per-token rewards -beta * k1 and the score at the last
    token, gamma = 1 returns row by row, whitened (mean, unbiased std) over every response token of the
    batch. (B, R) float64, 0 at padding."""
    mask = rollout.response_mask
    returns = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        tokens = mask[b].nonzero().flatten().tolist()
        running = 0.0
        for t in reversed(tokens):
            reward = -beta * float(rollout.logprobs[b, t] - rollout.ref_logprobs[b, t])
            running += reward + (float(rollout.scores[b]) if t == tokens[-1] else 0.0)
            returns[b, t] = running
    values = returns[mask]
    out = torch.zeros_like(returns)
    out[mask] = (values - values.mean()) / values.std()
    return out


def test_reinforce_pp_whitens_over_the_minibatch_not_per_micro_batch(
    tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path, monkeypatch
):
    """The advantages the policy loss gets, micro-batch by micro-batch (4 of 2 rows, responses of different
    lengths), are the whole rollout's returns whitened together. Fails if each micro-batch is whitened alone."""
    trainer = tiny_ppo_trainer(reinforce_pp_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path))
    use_fixed_responses(trainer)
    rollouts, given, policy_loss = recording_rollouts(trainer), [], ppo_math.policy_loss

    def recording(**kw):
        given.append(kw["advantages"].detach())
        return policy_loss(**kw)

    monkeypatch.setattr(ppo_math, "policy_loss", recording)
    trainer.ppo_step()
    assert len(given) == 4, "4 micro-batches, the first epoch in rollout order"
    rollout = rollouts[0]
    assert len(set(rollout.response_mask.sum(-1).tolist())) > 1, "responses of different lengths"
    expected = naive_reinforce_pp(rollout, beta=0.5)
    torch.testing.assert_close(torch.cat(given).double(), expected, atol=1e-5, rtol=1e-5)


class TwoThreadSum:
    """`accelerator.reduce(x, "sum")` of two data-parallel ranks played by two threads: each call waits for
    the other rank's call and returns the sum of both tensors (as an all-reduce does)."""

    num_processes = 2

    def __init__(self, device):
        self.device, self.barrier, self.parts = device, threading.Barrier(2, timeout=60), []

    def reduce(self, x: torch.Tensor, reduction: str) -> torch.Tensor:
        assert reduction == "sum"
        self.parts.append(x)
        self.barrier.wait()
        total = self.parts[0] + self.parts[1]
        if self.barrier.wait() == 0:  # both have read the parts: one thread clears them for the next call
            self.parts.clear()
        self.barrier.wait()
        return total


def test_reinforce_pp_whitens_over_every_process(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path):
    """The rollout cut into two ranks of 2 prompts x 2 samples (whole groups), each rank's advantages made by
    the real `advantages` with the ranks' sums all-reduced (two threads): together they are the one process's
    advantages of the whole rollout, and differ from each half whitened alone. Fails if REINFORCE++ whitens
    per process."""
    trainer = tiny_ppo_trainer(reinforce_pp_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path))
    use_fixed_responses(trainer)
    rollout, _ = trainer.rollout(trainer.collector.in_groups(trainer.collector.queries(trainer.step)))
    rewards, _ = trainer.rewards(rollout, 0.5)
    whole, _ = trainer.advantages(rollout, rewards)  # one process
    torch.testing.assert_close(whole.double(), naive_reinforce_pp(rollout, beta=0.5), atol=1e-5, rtol=1e-5)

    halves = [torch.arange(0, 4), torch.arange(4, 8)]
    real_accelerator, out, errors = trainer.accelerator, [None, None], []
    trainer.context.accelerator = TwoThreadSum(trainer.device)

    def rank(r: int) -> None:
        try:
            out[r] = trainer.advantages(rollout.select(halves[r]), rewards[halves[r]])[0]
        except Exception as e:  # noqa: BLE001 - re-raised in the test's thread below
            errors.append(e)
            trainer.accelerator.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    trainer.context.accelerator = real_accelerator
    assert not errors, errors
    torch.testing.assert_close(torch.cat(out), whole, atol=1e-6, rtol=1e-5)
    alone = trainer.advantages(rollout.select(halves[0]), rewards[halves[0]])[0]
    assert not torch.allclose(alone, whole[halves[0]], atol=1e-3), "whitened alone, a half differs"
