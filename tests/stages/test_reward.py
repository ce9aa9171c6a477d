"""Reward model: the loss, where the score is read, padding invariance, training, LoRA save/reload,
normalisation, the baseline, and the stage's input checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import ROOT, write_jsonl

from llm_rlhf.core.config import parse_config
from llm_rlhf.core.data import ranking_to_pairs
from llm_rlhf.core.errors import ConfigError, DataError, UserError
from llm_rlhf.models.baseline import fit_bow_baseline, pairwise_accuracy
from llm_rlhf.models.reward_model import (
    RewardModel,
    add_pad_token,
    encode_pair,
    last_token_index,
    load_reward_model,
    load_sequence_classifier,
    save_reward_model,
    score_pairs,
)
from llm_rlhf.rl import reward_math
from llm_rlhf.rl.token_math import position_ids_from_mask
from llm_rlhf.stages.reward import Config, build_trainer, load_inputs, reference_texts, run

RECIPE = ROOT / "recipes" / "reviews" / "rm.yaml"


def fresh_rm(model_dir, seed: int = 0) -> RewardModel:
    """An untrained RM on a tiny causal LM: a random score head, scaled up so scores differ visibly."""
    from llm_rlhf.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    torch.manual_seed(seed)
    model = load_sequence_classifier(
        str(model_dir), dtype="float32", trust_remote_code=False, need_head=False
    )
    add_pad_token(model, tokenizer)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    return RewardModel(model, tokenizer).eval()


def tiny_config(model_dir, pref_files, output_dir, **overrides) -> Config:
    train, val = pref_files
    values = dict(
        model_name_or_path=str(model_dir),
        train_file=str(train),
        eval_file=str(val),
        test_file=str(val),
        output_dir=str(output_dir),
        max_length=32,
        learning_rate=3e-3,
        max_steps=30,
        per_device_train_batch_size=8,
        warmup_ratio=0.0,
        logging_steps=5,
        eval_steps=0,
        save_steps=100,
        score_batch_size=4,
    )
    values.update(overrides)
    return Config(**values)


# --------------------------------------------------------------------------------------------
# The loss and the pairs
# --------------------------------------------------------------------------------------------


def test_bradley_terry_loss_hand_computed():
    chosen, rejected = torch.tensor([2.0, 0.5]), torch.tensor([1.0, 1.5])  # differences +1, -1
    # -log sigmoid(1) = log(1 + e^-1) = 0.313262;  -log sigmoid(-1) = log(1 + e) = 1.313262
    loss = reward_math.bradley_terry_loss(chosen_scores=chosen, rejected_scores=rejected)
    assert loss.item() == pytest.approx((0.313262 + 1.313262) / 2, abs=1e-5)
    # margin 0.5: differences 0.5 and -1.5 -> log(1 + e^-0.5) = 0.474077, log(1 + e^1.5) = 1.701413
    loss = reward_math.bradley_terry_loss(
        chosen_scores=chosen, rejected_scores=rejected, margin=torch.tensor([0.5, 0.5])
    )
    assert loss.item() == pytest.approx((0.474077 + 1.701413) / 2, abs=1e-5)


def test_ranking_expands_into_all_pairs(tmp_path, tiny_model_dir):
    assert ranking_to_pairs(["B", "A", "D", "C"]) == [
        ("B", "A"),
        ("B", "D"),
        ("B", "C"),
        ("A", "D"),
        ("A", "C"),
        ("D", "C"),
    ]
    from llm_rlhf.core.data import load_preference_dataset
    from llm_rlhf.models.loading import load_tokenizer

    path = write_jsonl(
        tmp_path / "ranked.jsonl", [{"prompt": "The film", "ranked": [" B", " A", " D", " C"]}]
    )
    pairs = load_preference_dataset(str(path), load_tokenizer(str(tiny_model_dir)), max_length=32)
    assert list(zip(pairs["chosen"], pairs["rejected"])) == ranking_to_pairs([" B", " A", " D", " C"])


# --------------------------------------------------------------------------------------------
# Where the score is read
# --------------------------------------------------------------------------------------------


def test_last_token_index_and_positions_match_loops():
    g = torch.Generator().manual_seed(0)
    masks = []
    for _ in range(20):  # right, left and both-sided padding
        T = 9
        start = int(torch.randint(0, 4, (1,), generator=g))
        end = int(torch.randint(start + 1, T + 1, (1,), generator=g))
        masks.append([1 if start <= t < end else 0 for t in range(T)])
    mask = torch.tensor(masks)
    expected_last = [max(t for t in range(mask.shape[1]) if mask[b, t]) for b in range(mask.shape[0])]
    assert last_token_index(mask).tolist() == expected_last
    positions = position_ids_from_mask(mask)
    for b in range(mask.shape[0]):
        real = [t for t in range(mask.shape[1]) if mask[b, t]]
        assert positions[b, real].tolist() == list(range(len(real)))  # 0, 1, 2... on the real tokens
    with pytest.raises(ValueError):
        last_token_index(torch.tensor([[0, 0, 0]]))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_score_does_not_depend_on_padding_or_batch(kind, tiny_model_dir, tiny_llama_dir):
    rm = fresh_rm(tiny_model_dir if kind == "gpt2" else tiny_llama_dir)
    tok = rm.tokenizer
    target = encode_pair(tok, "The film", " is a delight from start to finish.")
    others = [
        encode_pair(tok, "A tedious,", " boring waste of time. " * 3),
        encode_pair(tok, "It's", " fine"),
    ]

    def batch(seqs, side, extra=0, pad_id=tok.pad_token_id):
        width = max(len(s) for s in seqs) + extra
        ids, mask = [], []
        for s in seqs:
            pad = width - len(s)
            ids.append(s + [pad_id] * pad if side == "right" else [pad_id] * pad + s)
            mask.append([1] * len(s) + [0] * pad if side == "right" else [0] * pad + [1] * len(s))
        return torch.tensor(ids), torch.tensor(mask)

    with torch.no_grad():
        alone = rm(*batch([target], "right"))[0]
        variants = {
            "right, with longer": rm(*batch([target] + others, "right"))[0],
            "left, with longer": rm(*batch(others + [target], "left"))[-1],
            "right, extra padding": rm(*batch([target], "right", extra=7))[0],
            "left, extra padding": rm(*batch([target], "left", extra=7))[0],
            "padded with EOS ids": rm(*batch(others + [target], "left", pad_id=tok.eos_token_id))[-1],
        }
    for name, value in variants.items():
        assert value.item() == pytest.approx(alone.item(), abs=1e-5), name
    assert abs(alone.item()) > 1e-3  # a real score, not a degenerate zero


def test_pad_equal_to_eos_would_make_hf_pooling_skip_the_eos(tiny_model_dir):
    """Why the RM gets its own pad token: with pad == EOS, transformers' pooling ("rightmost token !=
    pad") reads the token before the EOS we append; with the dedicated pad it reads the EOS, like ours."""
    rm = fresh_rm(tiny_model_dir)
    tok, model = rm.tokenizer, rm.model
    ids = torch.tensor([encode_pair(tok, "The film", " is a delight")])  # ends with EOS
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ours = rm(ids, mask)
        model.config.pad_token_id = tok.eos_token_id  # the usual GPT-2 set-up
        hf_eos_pad = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        model.config.pad_token_id = tok.pad_token_id  # the RM's own pad token
        hf_own_pad = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        before_eos = rm(ids[:, :-1], mask[:, :-1])
    assert tok.pad_token == "<|pad|>" and tok.pad_token_id != tok.eos_token_id
    assert hf_own_pad.item() == pytest.approx(ours.item(), abs=1e-5)
    assert hf_eos_pad.item() == pytest.approx(before_eos.item(), abs=1e-5)
    assert abs(hf_eos_pad.item() - ours.item()) > 1e-4


def test_training_scores_and_loss_equal_the_reward_model(tmp_path, tiny_model_dir, pref_files):
    """What RewardTrainer computes on a collated (right-padded) batch is what `RewardModel.forward`
    gives each sequence alone, and its loss is `bradley_terry_loss` (with the margin when given)."""
    cfg = tiny_config(tiny_model_dir, pref_files, tmp_path / "rm", margin=0.5)
    rows = [json.loads(line) for line in Path(pref_files[0]).read_text().splitlines()]
    write_jsonl(Path(pref_files[0]), [{**r, "margin": 1.0 + i % 3} for i, r in enumerate(rows)])
    from llm_rlhf.stages.reward import _tokenize

    inputs = load_inputs(cfg)
    train, _ = _tokenize(inputs.train, inputs.tokenizer, cfg.max_length, inputs.margins)
    trainer = build_trainer(cfg, inputs.model, inputs.tokenizer, train, None)
    features = [trainer.train_dataset[i] for i in range(4)]
    batch = trainer.data_collator(features)  # input_ids: (2B, T), chosen rows first, then rejected
    assert batch["attention_mask"].min() == 0  # the batch is padded
    model = trainer.model.eval()
    device = model.device  # the Trainer's (a GPU's when there is one): its batches are moved there
    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.no_grad():
        loss, outputs = trainer.compute_loss(model, dict(batch), return_outputs=True)
        rm = RewardModel(model, inputs.tokenizer)
        alone = torch.cat(
            [
                rm(
                    torch.tensor([ids], device=device),
                    torch.ones(1, len(ids), dtype=torch.long, device=device),
                )
                for ids in [f["chosen_ids"] for f in features] + [f["rejected_ids"] for f in features]
            ]
        )
    torch.testing.assert_close(outputs.logits.squeeze(-1), alone, atol=1e-5, rtol=1e-5)
    chosen, rejected = alone.chunk(2)
    expected = reward_math.bradley_terry_loss(
        chosen_scores=chosen, rejected_scores=rejected, margin=batch["margin"]
    )
    assert batch["margin"].tolist() == [0.5 * (1.0 + i % 3) for i in range(4)]
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)


def test_score_tokens_of_policy_rollouts_equal_score_pairs(tiny_model_dir):
    """PPO hands over query | response | pad in the SFT tokenizer's ids (pad == EOS, left-padded
    queries): the RM scores them as it scores the texts, a truncated one too (EOS appended, as the RM was trained to read text)."""
    from llm_rlhf.models.loading import load_tokenizer

    rm = fresh_rm(tiny_model_dir)
    policy_tok = load_tokenizer(str(tiny_model_dir))
    eos = policy_tok.eos_token_id
    queries = [policy_tok("The film")["input_ids"], policy_tok("A gorgeous, moving")["input_ids"]]
    responses = [policy_tok(" is a dull mess.")["input_ids"] + [eos], policy_tok(" and funny")["input_ids"]]
    Q, R = max(map(len, queries)), max(map(len, responses))
    ids, mask = [], []
    for q, r in zip(queries, responses):
        ids.append([eos] * (Q - len(q)) + q + r + [eos] * (R - len(r)))
        mask.append([0] * (Q - len(q)) + [1] * (len(q) + len(r)) + [0] * (R - len(r)))
    with torch.no_grad():
        got = rm.score_tokens(torch.tensor(ids), torch.tensor(mask), policy_tok)
        # EOS appended to both: a finished response, and one cut at max_new_tokens
        expected = score_pairs(rm, ["The film", "A gorgeous, moving"], [" is a dull mess.", " and funny"])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_critic_values_at_the_last_token_are_the_scores(tiny_model_dir):
    rm = fresh_rm(tiny_model_dir)
    rm.mean, rm.std = 0.3, 2.0
    ids = torch.tensor(
        [encode_pair(rm.tokenizer, "The film", " is a delight") + [rm.tokenizer.pad_token_id] * 2]
    )
    mask = torch.tensor([[1] * (ids.shape[1] - 2) + [0, 0]])
    critic = rm.as_critic()
    values = critic(ids, mask)  # (1, T)
    assert values.shape == ids.shape and values.requires_grad
    assert values[0, ids.shape[1] - 3].item() == pytest.approx(rm.score(ids, mask).item(), abs=1e-5)


# --------------------------------------------------------------------------------------------
# Training, saving, normalisation
# --------------------------------------------------------------------------------------------


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.slow
@pytest.mark.parametrize("use_lora", [False, True])
def test_training_changes_every_trainable_parameter(tmp_path, tiny_model_dir, pref_files, use_lora):
    """Every trainable parameter moves, with one exception under the plain Bradley-Terry loss: the final
    layer-norm bias beta only adds the constant w . beta to every score, which r_w - r_l cancels, so its
    gradient is zero up to float rounding, checked before every optimiser step (Adam would turn a
    rounding-level gradient into a step of its own, so whether the bias moves depends on summation order).
    Reward centring sees that shift, so with it the bias moves too (the next test)."""
    from transformers import TrainerCallback

    cfg = tiny_config(tiny_model_dir, pref_files, tmp_path / "rm", use_lora=use_lora, max_steps=12)
    inputs = load_inputs(cfg)
    from llm_rlhf.stages.reward import _tokenize

    train, _ = _tokenize(inputs.train, inputs.tokenizer, cfg.max_length)
    trainer = build_trainer(cfg, inputs.model, inputs.tokenizer, train, None)
    ratios = []  # per optimiser step: max |grad of the bias| / max |grad| of every other trainable parameter

    class BiasGradient(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
            others = max(float(g.abs().max()) for n, g in grads.items() if n != "transformer.ln_f.bias")
            if "transformer.ln_f.bias" in grads:
                ratios.append(float(grads["transformer.ln_f.bias"].abs().max()) / others)

    trainer.add_callback(BiasGradient())
    before = _snapshot(trainer.model)
    assert before and (not use_lora or any("score" in n for n in before))
    trainer.train()
    after = dict(trainer.model.named_parameters())
    unchanged = [n for n, p in before.items() if torch.equal(p, after[n].detach())]
    assert set(unchanged) <= ({"transformer.ln_f.bias"} if not use_lora else set())
    if not use_lora:
        assert len(ratios) == 12 and max(ratios) < 1e-5, ratios  # zero but for rounding


@pytest.mark.slow
def test_reward_centring_moves_the_final_norm_bias_too(tmp_path, tiny_model_dir, pref_files):
    cfg = tiny_config(
        tiny_model_dir, pref_files, tmp_path / "rm", max_steps=4, center_rewards_coefficient=0.1
    )
    inputs = load_inputs(cfg)
    from llm_rlhf.stages.reward import _tokenize

    train, _ = _tokenize(inputs.train, inputs.tokenizer, cfg.max_length)
    trainer = build_trainer(cfg, inputs.model, inputs.tokenizer, train, None)
    before = _snapshot(trainer.model)
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert [n for n, p in before.items() if torch.equal(p, after[n].detach())] == []


@pytest.mark.slow
def test_rm_stage_end_to_end(tmp_path, tiny_model_dir, pref_files):
    """Held-out accuracy rises above chance; the folder is a standard HF folder loadable by plain
    transformers; normalisation gives mean 0 and std 1 on its stated reference set; metrics.json."""
    from transformers import AutoModelForSequenceClassification

    cfg = tiny_config(tiny_model_dir, pref_files, tmp_path / "rm")
    metrics = run(cfg)
    out = Path(cfg.output_dir)
    on_disk = json.loads((out / "metrics.json").read_text())
    for key in (
        "eval_accuracy",
        "eval_margin",
        "baseline_accuracy",
        "score_mean",
        "score_std",
        "test_accuracy",
    ):
        assert key in on_disk and math.isfinite(on_disk[key])
    assert metrics["eval_accuracy"] >= 0.8 and metrics["eval_margin"] > 0  # chance is 0.5
    assert (
        (out / "config.yaml").is_file()
        and (out / "log.jsonl").is_file()
        and (out / "model.safetensors").is_file()
    )

    rm = load_reward_model(out)
    norm = json.loads((out / "reward_normalization.json").read_text())
    assert rm.mean == norm["mean"] == metrics["score_mean"] and rm.std == norm["std"] == metrics["score_std"]
    from llm_rlhf.core.data import load_preference_dataset

    train = load_preference_dataset(cfg.train_file, rm.tokenizer, max_length=cfg.max_length)
    prompts, responses = reference_texts(train, max_samples=cfg.normalization_samples, seed=cfg.seed)
    assert norm["n"] == len(prompts) and "training pairs" in norm["reference_set"]
    scores = score_pairs(rm, prompts, responses, batch_size=3)
    assert scores.mean().item() == pytest.approx(0.0, abs=1e-4)
    # the held-out pair loss: -mean log sigmoid(r_w - r_l) over the eval pairs, in raw scores
    pairs = load_preference_dataset(cfg.eval_file, rm.tokenizer, max_length=cfg.max_length)
    n = len(pairs)
    raw = score_pairs(
        rm, list(pairs["prompt"]) * 2, list(pairs["chosen"]) + list(pairs["rejected"]), normalize=False
    ).double()
    expected = -torch.nn.functional.logsigmoid(raw[:n] - raw[n:]).mean().item()
    assert metrics["eval_pair_loss"] == pytest.approx(expected, rel=1e-5)
    assert scores.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)

    plain = AutoModelForSequenceClassification.from_pretrained(out).eval()  # plain transformers: raw scores
    batch = rm.tokenizer(
        [p + r + rm.tokenizer.eos_token for p, r in zip(prompts, responses)],
        padding=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        torch.testing.assert_close(
            plain(**batch).logits.squeeze(-1),
            rm(batch["input_ids"], batch["attention_mask"]),
            atol=1e-5,
            rtol=1e-5,
        )


@pytest.mark.slow
def test_lora_rm_save_reload_gives_identical_scores(tmp_path, tiny_llama_dir, pref_files):
    """The trained score head travels with the adapter (modules_to_save): no re-initialised head."""
    from peft import AutoPeftModelForSequenceClassification

    cfg = tiny_config(tiny_llama_dir, pref_files, tmp_path / "rm", use_lora=True, max_steps=10)
    inputs = load_inputs(cfg)
    from llm_rlhf.stages.reward import _tokenize

    train, _ = _tokenize(inputs.train, inputs.tokenizer, cfg.max_length)
    trainer = build_trainer(cfg, inputs.model, inputs.tokenizer, train, None)
    trainer.train()
    trained = RewardModel(trainer.model, inputs.tokenizer, {"mean": 0.1, "std": 2.0}).eval()
    folder = tmp_path / "saved"
    save_reward_model(trained, folder, merge_lora=False)
    assert (folder / "adapter_config.json").is_file() and not (folder / "model.safetensors").exists()

    prompts, responses = (
        list(inputs.eval["prompt"]) * 2,
        list(inputs.eval["chosen"]) + list(inputs.eval["rejected"]),
    )
    expected = score_pairs(trained, prompts, responses)
    reloaded = load_reward_model(folder)
    torch.testing.assert_close(score_pairs(reloaded, prompts, responses), expected, atol=1e-5, rtol=1e-5)
    assert (reloaded.mean, reloaded.std) == (0.1, 2.0)

    plain = AutoPeftModelForSequenceClassification.from_pretrained(folder, num_labels=1).eval()  # plain peft
    tok = reloaded.tokenizer
    plain.config.pad_token_id = tok.pad_token_id
    batch = tok(
        [p + r + tok.eos_token for p, r in zip(prompts, responses)], padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        raw = plain(**batch).logits.squeeze(-1)
    torch.testing.assert_close((raw - 0.1) / 2.0, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_recipe_parses_and_runs_a_few_steps(tmp_path, tiny_model_dir, pref_files):
    cfg = parse_config(Config, ["--config", str(RECIPE)])
    assert cfg.model_name_or_path == "runs/reviews/sft" and cfg.test_file == "data/reviews/prefs_test.jsonl"
    train, val = pref_files
    cfg = parse_config(
        Config,
        [
            "--config",
            str(RECIPE),
            "--model_name_or_path",
            str(tiny_model_dir),
            "--train_file",
            str(train),
            "--eval_file",
            str(val),
            "--test_file",
            str(val),
            "--output_dir",
            str(tmp_path / "rm"),
            "--max_steps",
            "2",
            "--max_length",
            "32",
            "--normalization_samples",
            "4",
        ],
    )
    metrics = run(cfg)
    assert metrics["global_step"] == 2 and metrics["normalization_samples"] == 4


@pytest.mark.slow
def test_resume_continues_from_the_last_checkpoint(tmp_path, tiny_model_dir, pref_files):
    cfg = tiny_config(
        tiny_model_dir, pref_files, tmp_path / "rm", max_steps=4, save_steps=2, normalization_samples=4
    )
    run(cfg)
    with pytest.raises(UserError, match="already holds checkpoints"):
        run(cfg)
    resumed = run(
        tiny_config(
            tiny_model_dir,
            pref_files,
            tmp_path / "rm",
            max_steps=6,
            save_steps=2,
            normalization_samples=4,
            resume=True,
        )
    )
    assert resumed["global_step"] == 6
    steps = [json.loads(line)["step"] for line in (tmp_path / "rm" / "log.jsonl").read_text().splitlines()]
    assert 6 in steps


# --------------------------------------------------------------------------------------------
# The baseline
# --------------------------------------------------------------------------------------------


def test_pairwise_accuracy_counts_ties_as_half():
    assert pairwise_accuracy([1.0, 0.0, 2.0, 5.0], [0.0, 1.0, 2.0, 1.0]) == pytest.approx(
        (1 + 0 + 0.5 + 1) / 4
    )


def test_bag_of_words_baseline_learns_sentiment_words():
    good = [
        "a great film",
        "a wonderful story",
        "superb acting",
        "great fun",
        "a wonderful cast",
        "superb script",
    ]
    bad = ["a dull film", "a boring story", "wooden acting", "dull fun", "a boring cast", "wooden script"]
    baseline = fit_bow_baseline(good * 3, bad * 3)
    assert baseline.accuracy(good, bad) == 1.0
    assert baseline.accuracy(["great and superb"], ["dull and boring"]) == 1.0


# --------------------------------------------------------------------------------------------
# Input checks: everything is validated before anything is written
# --------------------------------------------------------------------------------------------


def test_bad_inputs_fail_before_writing(tmp_path, tiny_model_dir, pref_files):
    out = tmp_path / "rm"
    with pytest.raises(UserError, match="no such folder"):
        run(tiny_config(tmp_path / "missing" / "sft", pref_files, out))
    with pytest.raises(ConfigError, match="margin"):  # pref_files has no margin column
        run(tiny_config(tiny_model_dir, pref_files, out, margin=1.0))
    with pytest.raises(UserError, match="no checkpoint"):
        run(tiny_config(tiny_model_dir, pref_files, out, resume=True))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "The film", "chosen": " good", "rejected": 3}])
    with pytest.raises(DataError, match=r"bad.jsonl, row 1, field 'rejected'"):
        run(tiny_config(tiny_model_dir, (bad, pref_files[1]), out))
    with_margin = write_jsonl(
        tmp_path / "m.jsonl", [{"prompt": "A", "chosen": " b", "rejected": " c", "margin": "x"}]
    )
    with pytest.raises(DataError, match="field 'margin'"):
        run(tiny_config(tiny_model_dir, (with_margin, pref_files[1]), out, margin=1.0))
    assert not out.exists()


def test_config_rules():
    with pytest.raises(ConfigError, match="margin"):
        Config(margin=-1.0)
    with pytest.raises(ConfigError, match="merge_lora"):
        Config(merge_lora=True)
    with pytest.raises(ConfigError, match="unknown key 'lora_rank'"):
        parse_config(Config, ["--lora_rank", "4"])


def test_loading_a_causal_lm_folder_as_reward_model_is_refused(tiny_model_dir):
    with pytest.raises(UserError, match="no trained score head"):
        load_reward_model(tiny_model_dir)


def test_bf16_trains_on_a_cpu(tmp_path, tiny_model_dir, pref_files):
    """bf16 autocast runs on a machine without a GPU (transformers refuses bf16 there unless the run is marked
    as a CPU run): the Trainer autocasts in bfloat16 and the stage finishes."""
    if torch.cuda.is_available():
        pytest.skip("a CPU-only case: with CUDA the Trainer's device is the GPU")
    cfg = tiny_config(tiny_model_dir, pref_files, tmp_path / "rm", bf16=True, max_steps=2)
    from llm_rlhf.stages.reward import _tokenize

    inputs = load_inputs(cfg)
    train, _ = _tokenize(inputs.train, inputs.tokenizer, cfg.max_length)
    trainer = build_trainer(cfg, inputs.model, inputs.tokenizer, train, None)
    assert trainer.args.bf16 and trainer.args.use_cpu and trainer.args.device.type == "cpu"
    metrics = run(cfg)
    assert metrics["global_step"] == 2 and math.isfinite(metrics["eval_accuracy"])


def test_lora_layers_puts_the_adapters_in_the_last_blocks(tmp_path, tiny_llama_dir, pref_files):
    """lora_layers 1 on the 2-block Llama: the Trainer's trainable parameters are block 1's adapters on every
    linear layer and the score head, and the stage trains and evaluates with them (max_eval_samples 5: the
    validation figures are those of eval_file's first 5 pairs; the test file is scored in full)."""
    cfg = tiny_config(
        tiny_llama_dir,
        pref_files,
        tmp_path / "rm",
        use_lora=True,
        lora_r=2,
        lora_layers=1,
        max_steps=2,
        max_eval_samples=5,
    )
    from llm_rlhf.stages.reward import _tokenize

    inputs = load_inputs(cfg)
    train, _ = _tokenize(inputs.train, inputs.tokenizer, cfg.max_length)
    trainer = build_trainer(cfg, inputs.model, inputs.tokenizer, train, None)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    adapters = [n for n in trainable if "lora_" in n]
    assert len(adapters) == 2 * 7 and all(".layers.1." in n for n in adapters), adapters
    assert [n for n in trainable if "lora_" not in n] and all(
        "score" in n for n in trainable if "lora_" not in n
    )
    metrics = run(cfg)
    assert metrics["global_step"] == 2 and math.isfinite(metrics["test_accuracy"])
    assert metrics["eval_pairs"] == 5 and metrics["test_pairs"] == len(pref_files[1].read_text().splitlines())
