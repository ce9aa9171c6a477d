"""DPO stage: TRL's loss and rewards against a naive computation, tokenization as the RM sees it, tiny-model
runs (full and LoRA: every trainable parameter moves, the reference does not, the margin grows), the saved
folder reloads to the same log-probs, resume, and the input checks."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT

from llm_rlhf.core.config import parse_config
from llm_rlhf.core.errors import ConfigError
from llm_rlhf.core.utils import read_json
from llm_rlhf.interfaces import cli, pipeline
from llm_rlhf.models.reward_model import encode_pair
from llm_rlhf.rl.rollout import encode_prompt
from llm_rlhf.stages import dpo, reward

RECIPE = ROOT / "recipes" / "reviews" / "dpo.yaml"


def tiny_config(model_dir, pref_files, output_dir, **overrides) -> dpo.Config:
    train, val = pref_files
    values = dict(
        model_name_or_path=str(model_dir),
        train_file=str(train),
        eval_file=str(val),
        output_dir=str(output_dir),
        max_length=32,
        learning_rate=3e-3,
        max_steps=8,
        per_device_train_batch_size=8,
        warmup_ratio=0.0,
        logging_steps=1,
        eval_steps=0,
        save_steps=100,
        lora_r=4,
        lora_alpha=8,
    )
    values.update(overrides)
    return dpo.Config(**values)


def trainer_for(cfg: dpo.Config):
    inputs = dpo.load_inputs(cfg)
    return inputs, dpo.build_trainer(
        cfg, inputs.model, inputs.ref_model, inputs.tokenizer, inputs.train, None
    )


def margins(policy, reference, tokenizer, pairs) -> torch.Tensor:
    """DPO's log-ratio margin per pair: (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))."""
    prompts, chosen, rejected = list(pairs["prompt"]), list(pairs["chosen"]), list(pairs["rejected"])

    def logratio(responses):
        return dpo.response_logprobs(policy, tokenizer, prompts, responses) - dpo.response_logprobs(
            reference, tokenizer, prompts, responses
        )

    return logratio(chosen) - logratio(rejected)  # (N,)


# --------------------------------------------------------------------------------------------
# What TRL trains on, and what it computes
# --------------------------------------------------------------------------------------------


def test_trl_tokenizes_pairs_as_the_rm_does(tmp_path, tiny_model_dir, pref_files):
    """TRL's prompt_ids + chosen_ids (its EOS appended as text) are `encode_pair`, the RM's tokens, and the
    prompt part is `encode_prompt`, PPO's query."""
    _, trainer = trainer_for(tiny_config(tiny_model_dir, pref_files, tmp_path / "dpo"))
    tokenizer = trainer.processing_class
    rows = trainer.train_dataset
    for i in range(5):
        prompt, chosen, rejected = rows[i]["prompt"], rows[i]["chosen"], rows[i]["rejected"]
        chosen = chosen.removesuffix(tokenizer.eos_token)  # TRL appended the EOS text
        rejected = rejected.removesuffix(tokenizer.eos_token)
        assert rows[i]["prompt_ids"] == encode_prompt(tokenizer, prompt)
        assert rows[i]["prompt_ids"] + rows[i]["chosen_ids"] == encode_pair(tokenizer, prompt, chosen)
        assert rows[i]["prompt_ids"] + rows[i]["rejected_ids"] == encode_pair(tokenizer, prompt, rejected)
        assert rows[i]["chosen_ids"][-1] == tokenizer.eos_token_id
        assert rows[i]["length"] == max(len(encode_pair(tokenizer, prompt, r)) for r in (chosen, rejected))


def test_pairs_longer_than_max_length_are_left_out_not_cut(tiny_model_dir, pref_files):
    from llm_rlhf.core.data import load_preference_dataset
    from llm_rlhf.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    pairs = load_preference_dataset(str(pref_files[1]), tokenizer, max_length=32)
    lengths = [
        max(len(encode_pair(tokenizer, p, c)), len(encode_pair(tokenizer, p, r)))
        for p, c, r in zip(pairs["prompt"], pairs["chosen"], pairs["rejected"])
    ]
    limit = sorted(lengths)[2]  # the three shortest pairs (ties included) fit
    kept, dropped = dpo.fitting_pairs(pairs, tokenizer, limit)
    assert kept["length"] == [n for n in lengths if n <= limit] and dropped == sum(n > limit for n in lengths)
    assert 0 < dropped < len(pairs)


def test_response_mask_layout():
    mask = dpo.response_token_mask([3, 1], torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]))
    assert mask.int().tolist() == [[0, 0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]]


def test_sequence_logprobs_match_a_loop():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 5, generator=g)
    input_ids = torch.randint(0, 5, (2, 6), generator=g)
    mask = dpo.response_token_mask([2, 4], torch.tensor([[1] * 6, [1] * 5 + [0]]))
    expected = [
        sum(torch.log_softmax(logits[b, t - 1], -1)[input_ids[b, t]].item() for t in range(6) if mask[b, t])
        for b in range(2)
    ]  # token t is predicted at position t - 1
    got = dpo.sequence_logprobs(logits=logits, input_ids=input_ids, response_mask=mask)
    assert got.tolist() == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_trl_loss_and_rewards_equal_a_naive_computation(tmp_path, tiny_model_dir, pref_files, loss_type):
    """On a collated (right-padded) batch, TRL's loss and logged rewards are what the DPO formulas give on
    log-probs summed over each response + EOS, computed pair by pair by `response_logprobs`."""
    beta = 0.5
    cfg = tiny_config(tiny_model_dir, pref_files, tmp_path / "dpo", beta=beta, loss_type=loss_type)
    inputs, trainer = trainer_for(cfg)
    with torch.no_grad():  # move the policy away from the reference, so the log-ratios are not all 0
        g = torch.Generator().manual_seed(0)
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.device))  # drawn on the CPU: any device
    features = [trainer.train_dataset[i] for i in (0, 1, 2, 5)]
    batch = trainer.data_collator(features)  # (2B, T): chosen rows, then rejected rows
    assert batch["attention_mask"].min() == 0  # the batch is padded
    batch = {k: v.to(trainer.model.device) if torch.is_tensor(v) else v for k, v in batch.items()}
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, dict(batch))
    logged = {key: values[-1] for key, values in trainer._metrics["eval"].items()}

    tokenizer = inputs.tokenizer
    prompts = [f["prompt"] for f in features]
    chosen = [f["chosen"].removesuffix(tokenizer.eos_token) for f in features]
    rejected = [f["rejected"].removesuffix(tokenizer.eos_token) for f in features]

    def logratio(responses):
        policy = dpo.response_logprobs(trainer.model, tokenizer, prompts, responses)
        return policy - dpo.response_logprobs(inputs.ref_model, tokenizer, prompts, responses)

    chosen_logratio, rejected_logratio = logratio(chosen), logratio(rejected)  # (B,) each
    margin = chosen_logratio - rejected_logratio
    assert margin.abs().min() > 1e-3
    if loss_type == "sigmoid":
        expected = -F.logsigmoid(beta * margin).mean()
    else:  # IPO: log-ratios per response token (EOS included)
        n_chosen = torch.tensor([len(f["chosen_ids"]) for f in features])
        n_rejected = torch.tensor([len(f["rejected_ids"]) for f in features])
        expected = (
            (chosen_logratio / n_chosen - rejected_logratio / n_rejected - 1 / (2 * beta)) ** 2
        ).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-5)
    assert logged["rewards/chosen"] == pytest.approx((beta * chosen_logratio).mean().item(), abs=1e-4)
    assert logged["rewards/rejected"] == pytest.approx((beta * rejected_logratio).mean().item(), abs=1e-4)
    assert logged["rewards/margins"] == pytest.approx((beta * margin).mean().item(), abs=1e-4)
    assert logged["rewards/accuracies"] == pytest.approx((margin > 0).float().mean().item())


# --------------------------------------------------------------------------------------------
# Training: every parameter moves, the reference does not, the margin grows; the saved folder
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("use_lora", [False, True])
def test_training_moves_every_parameter_grows_the_margin_and_saves(
    tmp_path, tiny_model_dir, pref_files, use_lora
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(tiny_model_dir, pref_files, tmp_path / "dpo", use_lora=use_lora, merge_lora=False)
    inputs, trainer = trainer_for(cfg)
    policy = trainer.model
    reference = (
        inputs.ref_model if not use_lora else AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    )
    assert (inputs.ref_model is None) == use_lora  # LoRA: TRL disables the adapter for the reference
    before = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad}
    ref_before = {n: p.detach().clone() for n, p in (inputs.ref_model or reference).named_parameters()}
    assert before and (not use_lora or all("lora_" in n for n in before))
    start = margins(policy, reference, inputs.tokenizer, inputs.train)
    assert start.abs().max().item() == 0.0, "policy == reference before the first step"

    trainer.train()
    after = dict(policy.named_parameters())
    assert [n for n, p in before.items() if torch.equal(p, after[n].detach())] == []
    assert [n for n, p in frozen.items() if not torch.equal(p, after[n].detach())] == []  # LoRA: the base
    ref_after = dict((inputs.ref_model or reference).named_parameters())
    assert all(torch.equal(p, ref_after[n]) for n, p in ref_before.items()), "the reference never moves"
    end = margins(policy, reference, inputs.tokenizer, inputs.train)
    assert end.mean() > 0.5 and (end > 0).float().mean() >= 0.8, end  # chosen gained on rejected

    folder = tmp_path / "saved"
    expected = dpo.response_logprobs(
        policy, inputs.tokenizer, list(inputs.eval["prompt"]), list(inputs.eval["chosen"])
    )
    dpo.save_policy(policy, inputs.tokenizer, folder, merge_lora=False)
    if use_lora:  # plain peft on the base model reads the adapter folder
        assert (folder / "adapter" / "adapter_config.json").is_file() and not (
            folder / "model.safetensors"
        ).exists()
        reloaded = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir), folder / "adapter"
        )
    else:  # plain transformers reads the folder
        reloaded = AutoModelForCausalLM.from_pretrained(folder)
    got = dpo.response_logprobs(
        reloaded, inputs.tokenizer, list(inputs.eval["prompt"]), list(inputs.eval["chosen"])
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(
        got,
        dpo.response_logprobs(
            reference, inputs.tokenizer, list(inputs.eval["prompt"]), list(inputs.eval["chosen"])
        ),
    ), "the saved policy is the trained one, not the reference"


@pytest.mark.slow
def test_trainer_keys_reach_trl_and_act(tmp_path, tiny_model_dir, pref_files):
    """The keys DPO shares with SFT and RM (`trainer_stage`) and its own, each set away from its default,
    reach TRL's DPOConfig and peft's LoraConfig and act in training: weight decay in the optimiser, the
    length-grouped sampler, one checkpoint kept, the adapter on c_attn only, dropout left on."""
    out = tmp_path / "dpo"
    cfg = tiny_config(
        tiny_model_dir,
        pref_files,
        out,
        use_lora=True,
        lora_dropout=0.1,
        lora_target_modules=["c_attn"],
        weight_decay=0.1,
        group_by_length=True,
        save_total_limit=1,
        save_steps=1,
        max_steps=3,
        lr_scheduler_type="constant",
        max_grad_norm=0.5,
        gradient_accumulation_steps=2,
        disable_dropout=False,
        per_device_eval_batch_size=3,
        per_device_train_batch_size=4,
    )
    _, trainer = trainer_for(cfg)
    args = trainer.args
    assert (args.weight_decay, args.train_sampling_strategy, args.save_total_limit) == (
        0.1,
        "group_by_length",
        1,
    )
    assert (args.lr_scheduler_type, args.max_grad_norm, args.gradient_accumulation_steps) == (
        "constant",
        0.5,
        2,
    )
    assert (args.disable_dropout, args.per_device_eval_batch_size) == (False, 3)
    adapter = trainer.model.peft_config["default"]
    assert adapter.lora_dropout == 0.1 and set(adapter.target_modules) == {"c_attn"}
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all("c_attn" in n and "lora_" in n for n in trained)
    trainer.train()
    assert max(group["weight_decay"] for group in trainer.optimizer.param_groups) == 0.1
    assert [group["lr"] for group in trainer.optimizer.param_groups][0] == cfg.learning_rate  # constant
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == [
        "checkpoint-3"
    ]  # limit 1


@pytest.mark.slow
def test_dpo_stage_end_to_end(tmp_path, tiny_model_dir, pref_files):
    """`llm-rlhf dpo`: metrics.json (last) with TRL's eval metrics, config.yaml that parses back, log.jsonl,
    checkpoints, a plain HF folder, no temporary folder left; with LoRA + merge: adapter/ and the merged model."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "dpo"
    cfg = tiny_config(tiny_model_dir, pref_files, out, save_steps=4)
    # the config's keys, not what __post_init__ derives from them
    keys = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    text = {k: ",".join(v) if isinstance(v, list) else "null" if v is None else v for k, v in keys.items()}
    argv = ["dpo"] + [f"--{k}={v}" for k, v in text.items()]
    assert cli.main(argv) == 0
    metrics = read_json(out / "metrics.json")
    for key in (
        "eval_loss",
        "eval_rewards/chosen",
        "eval_rewards/rejected",
        "eval_rewards/accuracies",
        "eval_rewards/margins",
        "eval_logps/chosen",
        "eval_logps/rejected",
        "train_loss",
    ):
        assert math.isfinite(metrics[key]), key
    assert metrics["global_step"] == 8 and metrics["train_pairs"] == 40 and metrics["eval_pairs"] == 5
    assert metrics["eval_rewards/margins"] > 0 and metrics["eval_rewards/accuracies"] >= 0.8
    assert metrics["eval_loss"] < math.log(2), "below the loss at the start (margin 0: log 2)"
    assert parse_config(dpo.Config, ["--config", str(out / "config.yaml")]) == cfg
    losses = [r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 8
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == [
        "checkpoint-4",
        "checkpoint-8",
    ]
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.generation_config.eos_token_id == model.config.eos_token_id
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "no temporary folders left behind"

    lora = tmp_path / "lora"
    dpo.run(tiny_config(tiny_model_dir, pref_files, lora, use_lora=True, max_steps=2))
    assert (lora / "adapter" / "adapter_model.safetensors").is_file() and (
        lora / "model.safetensors"
    ).is_file()
    assert read_json(lora / "metrics.json")["trainable_parameters"] < metrics["trainable_parameters"]


@pytest.mark.slow
def test_resume_reaches_the_same_weights(tmp_path, tiny_model_dir, pref_files):
    from safetensors.torch import load_file

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    settings = dict(max_steps=6, save_steps=3)  # 5 steps per epoch: the resumed part crosses an epoch
    dpo.run(tiny_config(tiny_model_dir, pref_files, straight, **settings))
    dpo.run(tiny_config(tiny_model_dir, pref_files, resumed, **settings))
    # an interrupted run: it got as far as checkpoint-3, and the final outputs were never written
    shutil.rmtree(resumed / "checkpoints" / "checkpoint-6")
    for name in ("model.safetensors", "metrics.json", "log.jsonl"):
        (resumed / name).unlink()

    with pytest.raises(Exception, match="already holds checkpoints"):
        dpo.run(tiny_config(tiny_model_dir, pref_files, resumed, **settings))
    dpo.run(tiny_config(tiny_model_dir, pref_files, resumed, resume=True, **settings))
    steps = [
        r["step"] for r in map(json.loads, (resumed / "log.jsonl").read_text().splitlines()) if "loss" in r
    ]
    assert steps == [4, 5, 6], "the resumed run continued after checkpoint-3"
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    for name in a:  # equal only if model, optimizer, scheduler, RNG and data position resume
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5, msg=name)
    assert read_json(resumed / "metrics.json")["global_step"] == 6


# --------------------------------------------------------------------------------------------
# Input checks: everything is validated before anything is written
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ('{"prompt": "The film", "chosen": " is good."}', "row 2, field 'rejected': missing (or null)"),
        (
            '{"prompt": "The film", "chosen": " is good.", "rejected": 3}',
            "row 2, field 'rejected': expected a string",
        ),
        ('{"prompt": "The film", "chosen": " is good.",', "row 2: not valid JSON"),
    ],
)
def test_bad_rows_stop_in_one_line_before_writing(tmp_path, tiny_model_dir, pref_files, capsys, row, message):
    good = pref_files[1].read_text().splitlines()[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(f"{good}\n{row}\n{good}\n")
    out = tmp_path / "dpo"
    argv = [
        "dpo",
        "--model_name_or_path",
        str(tiny_model_dir),
        "--train_file",
        str(bad),
        "--eval_file",
        str(pref_files[1]),
        "--output_dir",
        str(out),
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}, {message}") and err.count("\n") == 1, err
    assert not out.exists()


def test_other_bad_inputs_fail_before_writing(tmp_path, tiny_model_dir, pref_files, capsys):
    out = tmp_path / "dpo"
    base = [
        "dpo",
        "--model_name_or_path",
        str(tiny_model_dir),
        "--train_file",
        str(pref_files[0]),
        "--eval_file",
        str(pref_files[1]),
        "--output_dir",
        str(out),
    ]
    cases = {
        "--resume true": f"error: --resume: no checkpoint in '{out / 'checkpoints'}' to continue from",
        "--model_name_or_path runs/nowhere/sft": "error: model_name_or_path 'runs/nowhere/sft': no such folder (train it with `llm-rlhf sft`)",
        "--max_length 8": "error: train_file: no pair fits in max_length=8 tokens; raise max_length",
        "--eval_file missing.jsonl": "error: missing.jsonl: no such file",
    }
    for flags, message in cases.items():
        assert cli.main(base + flags.split()) == 2, flags
        assert capsys.readouterr().err.startswith(message), flags
    assert not out.exists()


def test_config_rules():
    with pytest.raises(ConfigError, match="beta"):
        dpo.Config(beta=0.0)
    with pytest.raises(ConfigError, match="loss_type"):
        dpo.Config(loss_type="kto")
    with pytest.raises(ConfigError, match="unknown key 'betta'; did you mean 'beta'"):
        parse_config(dpo.Config, ["--betta", "0.2"])
    assert dpo.Config().model_name_or_path == "runs/reviews/sft"
    assert (dpo.Config().train_file, dpo.Config().eval_file) == (
        reward.Config().train_file,
        reward.Config().eval_file,
    ), "the RM stage's pairs"


def test_pipeline_chains_dpo_to_the_sft_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the pipeline's default recipe paths are relative to the repo root
    cfg = pipeline.Config(output_dir=str(tmp_path), stages=["sft", "dpo"], dpo={"beta": 0.2})
    stage = pipeline.stage_config(cfg, "dpo")
    assert (stage.model_name_or_path, stage.output_dir, stage.beta) == (
        str(tmp_path / "sft"),
        str(tmp_path / "dpo"),
        0.2,
    )
    assert pipeline.Config().stages == ["sft", "rm", "ppo", "eval"], "not a default stage"
    # the RM stage's pairs, as the run resolved them: a pipeline override of the RM's data reaches DPO
    # (the dpo stage and compare's DPO runs), and DPO's own overrides still win
    other = {"train_file": "data/reviews/prefs_val.jsonl", "eval_file": "data/reviews/prefs_test.jsonl"}
    cfg = pipeline.Config(output_dir=str(tmp_path), stages=["sft", "dpo"], rm=other)
    stage = pipeline.stage_config(cfg, "dpo")
    assert (stage.train_file, stage.eval_file) == (other["train_file"], other["eval_file"])
    rm_stage = pipeline.stage_config(cfg, "rm")
    assert pipeline.stage_config(cfg, "compare").dpo == {
        k: getattr(rm_stage, k) for k in pipeline.DPO_FROM_RM
    }
    assert pipeline.stage_config(cfg, "compare").dpo["train_file"] == other["train_file"]
    own = dataclasses.replace(
        cfg, dpo={"train_file": "mine.jsonl"}, compare={"dpo": {"eval_file": "x.jsonl"}}
    )
    assert pipeline.stage_config(own, "dpo").train_file == "mine.jsonl"
    assert pipeline.stage_config(own, "compare").dpo["eval_file"] == "x.jsonl"
    assert pipeline.stage_config(own, "compare").dpo["train_file"] == other["train_file"]
    with pytest.raises(ConfigError, match="unknown stage"):
        pipeline.Config(stages=["sft", "kto"])


@pytest.mark.slow
def test_recipe_parses_and_runs_a_few_steps(tmp_path, tiny_model_dir, pref_files):
    cfg = parse_config(dpo.Config, ["--config", str(RECIPE)])
    assert cfg.model_name_or_path == "runs/reviews/sft" and cfg.output_dir == "runs/reviews/dpo"
    train, val = pref_files
    cfg = parse_config(
        dpo.Config,
        [
            "--config",
            str(RECIPE),
            "--model_name_or_path",
            str(tiny_model_dir),
            "--train_file",
            str(train),
            "--eval_file",
            str(val),
            "--output_dir",
            str(tmp_path / "dpo"),
            "--max_steps",
            "2",
            "--max_length",
            "32",
        ],
    )
    assert dpo.run(cfg)["global_step"] == 2


def test_bf16_trains_on_a_cpu(tmp_path, tiny_model_dir, pref_files):
    """bf16 autocast runs on a machine without a GPU (transformers refuses bf16 there unless the run is marked
    as a CPU run): the Trainer autocasts in bfloat16 and the stage finishes."""
    if torch.cuda.is_available():
        pytest.skip("a CPU-only case: with CUDA the Trainer's device is the GPU")
    cfg = tiny_config(tiny_model_dir, pref_files, tmp_path / "dpo", bf16=True, max_steps=2)
    _, trainer = trainer_for(cfg)
    assert trainer.args.bf16 and trainer.args.use_cpu and trainer.args.device.type == "cpu"
    metrics = dpo.run(cfg)
    assert metrics["global_step"] == 2
