"""SFT stage: completion-only masking with pad == eos, tiny-model runs (full, LoRA + merge, resume)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import ROOT, approx_numbers, write_jsonl

from llm_rlhf.core.config import parse_config
from llm_rlhf.core.data import load_sft_dataset
from llm_rlhf.core.utils import read_json
from llm_rlhf.interfaces import cli
from llm_rlhf.models.loading import load_causal_lm, load_tokenizer
from llm_rlhf.rl.rollout import Sampling
from llm_rlhf.stages import sft

RECIPE = ROOT / "recipes" / "reviews" / "sft.yaml"


def tiny_config(model_dir: Path, files: tuple[Path, Path], out: Path, *extra: str) -> sft.Config:
    """The reviews recipe, pointed at the tiny model and data, for a few steps."""
    argv = [
        "--config",
        str(RECIPE),
        "--model_name_or_path",
        str(model_dir),
        "--train_file",
        str(files[0]),
        "--eval_file",
        str(files[1]),
        "--output_dir",
        str(out),
        "--max_length",
        "32",
        "--max_steps",
        "8",
        "--per_device_train_batch_size",
        "8",
        "--learning_rate",
        "3e-3",
        "--warmup_ratio",
        "0",
        "--logging_steps",
        "1",
        "--eval_steps",
        "0",
        "--save_steps",
        "4",
        "--num_samples",
        "4",
        "--max_new_tokens",
        "6",
    ]
    return parse_config(sft.Config, argv + list(extra))


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_completion_only_labels_keep_the_eos_when_pad_is_eos(tmp_path, tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    assert tokenizer.pad_token_id == tokenizer.eos_token_id  # the GPT-2 case this test is about
    rows = [
        {"prompt": "The film is", "completion": " a delight from start to finish."},
        {"prompt": "A tedious, boring", "completion": " waste."},
    ]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    dataset = load_sft_dataset(path, tokenizer, max_length=32)
    cfg = parse_config(sft.Config, ["--output_dir", str(tmp_path / "out"), "--max_length", "32"])
    trainer = sft.build_trainer(cfg, load_causal_lm(str(tiny_model_dir)), tokenizer, dataset, dataset)

    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])  # the collator Trainer uses
    input_ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]  # (B, T) each
    eos = tokenizer.eos_token_id
    for i, row in enumerate(rows):
        n_prompt = len(tokenizer(row["prompt"])["input_ids"])
        n_real = int(mask[i].sum())
        expected = tokenizer(row["prompt"] + row["completion"])["input_ids"] + [eos]
        assert input_ids[i, :n_real].tolist() == expected
        assert (labels[i, :n_prompt] == -100).all(), "prompt tokens are not labels"
        assert labels[i, n_prompt:n_real].tolist() == expected[n_prompt:], "every completion token is a label"
        assert labels[i, n_real - 1] == eos, "the real EOS is a label even though pad == eos"
        assert (labels[i, n_real:] == -100).all() and (input_ids[i, n_real:] == eos).all(), (
            "padding is not a label"
        )
    assert mask[1].sum() < mask[0].sum(), "the batch has padding"


def test_sample_responses_eos_rate_and_left_padding():
    """A stub model whose 'generation' is fixed: one response stops at EOS, the other runs out of tokens."""

    class Tok:
        eos_token_id, pad_token_id, bos_token_id = 0, 0, 0

        def __call__(self, text):
            return {"input_ids": [len(w) for w in text.split()]}

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    class Stub(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def generate(self, input_ids, attention_mask, **kwargs):
            self.seen = (input_ids.tolist(), attention_mask.tolist())
            new = torch.tensor([[5, 0, 0], [5, 6, 7]])  # (B, max_new_tokens); row 0: EOS then padding
            return torch.cat([input_ids, new], dim=1)

    model = Stub()
    out = sft.sample_responses(model, Tok(), ["aa bbb", "c"], Sampling(max_new_tokens=3))
    assert model.seen == ([[2, 3], [0, 1]], [[1, 1], [0, 1]])  # left padding
    assert [(s["ended_with_eos"], s["num_tokens"], s["response"]) for s in out] == [
        (True, 1, "5"),
        (False, 3, "5 6 7"),
    ]


def test_sft_tiny_run_learns_and_writes_an_hf_folder(tmp_path, tiny_model_dir, sft_files):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    cfg = tiny_config(tiny_model_dir, sft_files, out)
    metrics = sft.run(cfg)

    assert read_json(out / "metrics.json") == approx_numbers(metrics)
    for key in ("eval_loss", "eval_perplexity", "eos_rate", "train_loss", "train_runtime_s"):
        assert key in metrics
    assert metrics["eval_perplexity"] == pytest.approx(
        torch.tensor(metrics["eval_loss"]).exp().item(), rel=1e-5
    )
    assert parse_config(sft.Config, ["--config", str(out / "config.yaml")]) == cfg

    losses = [r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == 8 and losses[-1] < losses[0], losses

    before, after = weights(tiny_model_dir), weights(out)
    assert before.keys() == after.keys()
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert unchanged == [], f"parameters that did not change: {unchanged}"

    model = AutoModelForCausalLM.from_pretrained(out)  # a plain HF folder
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id is not None
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and {"prompt", "response", "ended_with_eos"} <= samples[0].keys()
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == [
        "checkpoint-4",
        "checkpoint-8",
    ]
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "no temporary folders left behind"


@pytest.mark.slow
def test_lora_merge_generates_like_the_adapter(tmp_path, tiny_model_dir, sft_files):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora = ["--use_lora", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0", "--num_samples", "0"]
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    sft.run(tiny_config(tiny_model_dir, sft_files, adapter_dir, *lora, "--merge_lora", "false"))
    sft.run(tiny_config(tiny_model_dir, sft_files, merged_dir, *lora, "--merge_lora", "true"))

    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in adapter_dir.iterdir()
    }
    assert not (merged_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()  # plain transformers, no peft
    adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter_dir
    ).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()

    tokenizer = load_tokenizer(str(tiny_model_dir))
    prompt = tokenizer(["The film is", "A tedious, boring"], return_tensors="pt", padding=True)
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": tokenizer.eos_token_id}
    with torch.no_grad():
        torch.testing.assert_close(merged(**prompt).logits, adapter(**prompt).logits, atol=1e-5, rtol=1e-4)
        assert not torch.allclose(merged(**prompt).logits, base(**prompt).logits, atol=1e-3), (
            "the adapter learned"
        )
        assert torch.equal(merged.generate(**prompt, **settings), adapter.generate(**prompt, **settings))


def test_an_unmerged_adapter_is_refused_by_the_next_stages_in_one_line(
    tmp_path, tiny_model_dir, pref_files, prompt_file, capsys
):
    """merge_lora false saves an adapter folder without full weights. RM and PPO pointed at it stop with
    one line naming the folder and the fix, before anything is written (the RM used to fail deep inside
    training); evaluation's models load through the same load_causal_lm."""
    from peft import get_peft_model

    from llm_rlhf.core.errors import UserError

    adapter = tmp_path / "sft"
    model = load_causal_lm(str(tiny_model_dir))
    peft_model = get_peft_model(model, sft.lora_config(sft.Config(lora_r=4), model))
    sft._save_final_model(peft_model, load_tokenizer(str(tiny_model_dir)), adapter, merge=False)
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "model.safetensors").exists()
    message = (
        f"'{adapter}' holds a LoRA adapter only (adapter_config.json, no model weights); the next stage needs "
        "the merged model: run the SFT stage with --merge_lora true"
    )
    with pytest.raises(UserError) as e:
        load_causal_lm(str(adapter))
    assert str(e.value) == message
    commands = {
        "rm": ["--train_file", pref_files[0], "--eval_file", pref_files[1], "--test_file", "null"],
        "ppo": [
            "--reward_model_path",
            tmp_path / "rm",
            "--prompt_file",
            prompt_file,
            "--eval_prompt_file",
            "null",
        ],
    }
    for stage, argv in commands.items():
        out = tmp_path / f"{stage}_out"
        code = cli.main(
            [stage, "--model_name_or_path", str(adapter), "--output_dir", str(out), *map(str, argv)]
        )
        assert code == 2, stage
        assert f"error: {message}" in capsys.readouterr().err.splitlines(), stage
        assert not out.exists(), stage


@pytest.mark.slow
def test_resume_reaches_the_same_weights(tmp_path, tiny_model_dir, sft_files):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    sft.run(tiny_config(tiny_model_dir, sft_files, straight, "--num_samples", "0"))
    sft.run(tiny_config(tiny_model_dir, sft_files, resumed, "--num_samples", "0"))
    # an interrupted run: it got as far as checkpoint-4, and the final outputs were never written
    shutil.rmtree(resumed / "checkpoints" / "checkpoint-8")
    for name in ("model.safetensors", "metrics.json", "log.jsonl"):
        (resumed / name).unlink()

    with pytest.raises(Exception, match="already holds checkpoints"):
        sft.run(tiny_config(tiny_model_dir, sft_files, resumed, "--num_samples", "0"))
    sft.run(tiny_config(tiny_model_dir, sft_files, resumed, "--num_samples", "0", "--resume", "true"))

    logged_steps = [
        r["step"] for r in map(json.loads, (resumed / "log.jsonl").read_text().splitlines()) if "loss" in r
    ]
    assert logged_steps == [5, 6, 7, 8], "the resumed run continued after checkpoint-4"
    a, b = (
        weights(straight),
        weights(resumed),
    )  # equal only if model, optimizer, scheduler, RNG and data position resume
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5, msg=name)
    assert read_json(resumed / "metrics.json")["global_step"] == 8


def test_resume_without_a_checkpoint_is_a_user_error(tmp_path, tiny_model_dir, sft_files, capsys):
    out = tmp_path / "run"
    argv = [
        "sft",
        "--model_name_or_path",
        str(tiny_model_dir),
        "--train_file",
        str(sft_files[0]),
        "--eval_file",
        str(sft_files[1]),
        "--output_dir",
        str(out),
        "--resume",
        "true",
    ]
    assert cli.main(argv) == 2
    assert (
        capsys.readouterr().err
        == f"error: --resume: no checkpoint in '{out / 'checkpoints'}' to continue from\n"
    )
    assert not out.exists()


def test_lora_layers_trains_the_last_blocks_only(tmp_path, tiny_model_dir, sft_files):
    """lora_layers 1 on the 2-block GPT-2: the merged model differs from the base in block 1's linear layers
    only, each of them changed (all-linear is spelled out for peft, which takes no layer list with it)."""
    lora = ["--use_lora", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0", "--num_samples", "0"]
    out = tmp_path / "run"
    sft.run(tiny_config(tiny_model_dir, sft_files, out, *lora, "--lora_layers", "1"))
    before, after = weights(tiny_model_dir), weights(out)
    changed = sorted(name for name in before if not torch.equal(before[name], after[name]))
    linear = sorted(
        f"transformer.h.1.{m}.weight" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )
    assert changed == linear


def test_max_eval_samples_evaluates_on_the_first_rows(tmp_path, tiny_model_dir, sft_files):
    """max_eval_samples 3: the eval loss is that of eval_file's first 3 rows, as a file of those rows alone gives."""
    first3 = tmp_path / "first3.jsonl"
    first3.write_text("".join(sft_files[1].read_text().splitlines(keepends=True)[:3]))
    common = ["--max_steps", "2", "--num_samples", "0", "--save_steps", "100"]
    cut = sft.run(tiny_config(tiny_model_dir, sft_files, tmp_path / "a", *common, "--max_eval_samples", "3"))
    alone = sft.run(tiny_config(tiny_model_dir, (sft_files[0], first3), tmp_path / "b", *common))
    assert cut["eval_examples"] == alone["eval_examples"] == 3
    assert cut["eval_loss"] == pytest.approx(alone["eval_loss"], rel=1e-6)
