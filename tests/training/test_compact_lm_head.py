"""SFT's loss with the LM head at the completion positions only equals TRL 1.16's fused kernel: the loss, every
trainable parameter's gradient and the logged entropy and token accuracy, on GPT-2 and Llama, full and LoRA."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import ROOT
from peft import PeftModel
from trl import SFTTrainer

from llm_rlhf.core.config import parse_config
from llm_rlhf.models.loading import load_causal_lm
from llm_rlhf.stages import sft
from llm_rlhf.training import compact_lm_head

RECIPE = ROOT / "recipes" / "reviews" / "sft.yaml"


def trainers(model_dir, files, out, *extra: str):
    """Ours (`sft.build_trainer`) and TRL's own SFTTrainer on two copies of the same model and data."""
    argv = ["--config", str(RECIPE), "--model_name_or_path", str(model_dir), "--train_file", str(files[0])]
    argv += ["--eval_file", str(files[1]), "--output_dir", str(out), "--max_length", "32"]
    argv += ["--per_device_train_batch_size", "8", "--report_to", "none", *extra]
    cfg = parse_config(sft.Config, argv)
    built = []
    for make in (sft.build_trainer, None):
        tokenizer, model, train, val = sft.load_inputs(cfg)
        if make is None:  # TRL as it ships, nothing replaced
            trainer = SFTTrainer(
                model=model,
                args=sft.training_args(cfg),
                train_dataset=train,
                eval_dataset=val,
                processing_class=tokenizer,
                peft_config=sft.lora_config(cfg, model) if cfg.use_lora else None,
            )
        else:
            trainer = make(cfg, model, tokenizer, train, val)
        built.append(trainer)
    return built


def loss_and_grads(trainer, batch, autocast: bool):
    trainer.model.train()
    trainer.model.zero_grad()
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    torch.manual_seed(0)  # the same dropout masks in both trainers' backbones
    with context:
        loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k != "num_tokens"}
    return loss.detach(), grads, metrics


@pytest.mark.parametrize(
    "kind, extra, autocast, rtol",
    [
        ("gpt2", (), False, 1e-5),
        ("llama", ("--use_lora", "--lora_r", "4", "--lora_alpha", "8"), False, 1e-5),
        ("llama", ("--use_lora", "--lora_r", "4", "--lora_alpha", "8"), True, 2e-2),
    ],
    ids=["gpt2-full-float32", "llama-lora-float32", "llama-lora-bf16-autocast"],
)
def test_the_loss_its_gradients_and_metrics_equal_trls_fused_kernel(
    tmp_path, request, sft_files, kind, extra, autocast, rtol
):
    model_dir = request.getfixturevalue("tiny_model_dir" if kind == "gpt2" else "tiny_llama_dir")
    ours, theirs = trainers(model_dir, sft_files, tmp_path / "out", *extra)
    base = ours.model.get_base_model() if isinstance(ours.model, PeftModel) else ours.model
    assert base.forward.__func__.__qualname__.startswith("use_compact_lm_head")
    batch = next(iter(ours.get_train_dataloader()))
    labels = batch["labels"][:, 1:]
    assert 0 < int((labels != -100).sum()) < labels.numel()  # prompt and padding positions are skipped

    loss, grads, metrics = loss_and_grads(ours, batch, autocast)
    ref_loss, ref_grads, ref_metrics = loss_and_grads(theirs, batch, autocast)
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0)
    assert grads.keys() == ref_grads.keys() and grads
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max()
        assert (grad - ref_grads[name]).abs().max() <= rtol * 10 * scale, name
    assert metrics.keys() == ref_metrics.keys() == {"entropy", "mean_token_accuracy"}
    assert metrics["mean_token_accuracy"] == pytest.approx(ref_metrics["mean_token_accuracy"], abs=0.05)
    assert metrics["entropy"] == pytest.approx(ref_metrics["entropy"], rel=rtol)


def test_other_calls_and_oversized_batches_take_trls_forward(
    tmp_path, tiny_model_dir, sft_files, monkeypatch
):
    """Without fused_lm_head (generation, logits) the model's own forward answers; over MAX_COMPACT_ELEMENTS
    labelled logits TRL's chunked kernel does, bit for bit as TRL's trainer computes it."""
    ours, theirs = trainers(tiny_model_dir, sft_files, tmp_path / "out")
    batch = next(iter(ours.get_train_dataloader()))
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    torch.testing.assert_close(ours.model(**inputs).logits, theirs.model(**inputs).logits, rtol=0, atol=0)
    monkeypatch.setattr(compact_lm_head, "MAX_COMPACT_ELEMENTS", 0)
    loss, grads, _ = loss_and_grads(ours, batch, autocast=False)
    ref_loss, ref_grads, _ = loss_and_grads(theirs, batch, autocast=False)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def test_scaled_or_soft_capped_logits_keep_trls_kernel(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir))
    model.config.final_logit_softcapping = 30.0
    forward = model.forward
    assert compact_lm_head.use_compact_lm_head(model) is False
    assert model.forward == forward
    model.config.final_logit_softcapping = None
    assert compact_lm_head.use_compact_lm_head(model) is True


def test_compact_label_logprobs_is_the_dense_log_softmax_at_the_labels():
    """The worked shape: (B, T, H) hidden states, labels with -100; the log-probs, entropy and top-1 at the
    labelled positions of the dense (B, T-1, V) computation, zeros elsewhere."""
    torch.manual_seed(0)
    head = torch.nn.Linear(5, 11, bias=False)
    hidden = torch.randn(2, 4, 5)
    labels = torch.tensor([[-100, 3, 7, -100], [-100, -100, 0, 10]])
    log_probs, entropy, top1, mask = compact_lm_head.compact_label_logprobs(hidden, labels, head)
    dense = torch.log_softmax(head(hidden[:, :-1]), dim=-1)  # (2, 3, 11)
    target = labels[:, 1:].clamp(min=0)
    want = dense.gather(-1, target[..., None])[..., 0] * mask
    assert mask.tolist() == [[True, True, False], [False, True, True]]
    torch.testing.assert_close(log_probs, want)
    torch.testing.assert_close(entropy, -(dense.exp() * dense).sum(-1) * mask)
    assert top1.tolist() == ((dense.argmax(-1) == target) & mask).tolist()
