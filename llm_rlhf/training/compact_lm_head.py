"""SFT's log-probabilities on a CPU: the LM head at the label positions only, under the stage's autocast.

TRL 1.16's `SFTTrainer` always computes its loss through `model(..., fused_lm_head=True)`
(`trl.trainer.utils.add_fused_lm_head`), whose chunked kernel on a device without Triton projects every
position (prompt and padding included) and accumulates its backward in float32: on a 2-core CPU that was
about two thirds of a SmolLM2-135M SFT step. `use_compact_lm_head` replaces that fused forward, on the same
model object, by the plain computation at the positions that carry a label:

    h        (N, H)  the backbone's last hidden states at the N positions whose next-token label is not -100
    logits   (N, V)  = lm_head(h), in the autocast dtype when autocast is on (bf16 on AMX / AVX512-BF16)
    log_probs (N,)   = log softmax(logits.float())[labels]      entropy (N,), is_top1 (N,): metrics only

scattered back to (B, T-1) with zeros elsewhere, the fields TRL's `compute_loss` reads (loss, log_probs,
entropy, is_top1, label_mask). Equal to TRL's kernel within float rounding (pinned by a test). The (N, V)
logits exist for the labelled positions only; a batch with more than `MAX_COMPACT_ELEMENTS` of them, or a
model whose logits are scaled or soft-capped, goes through TRL's own path.
"""

from __future__ import annotations

import types

import torch
from trl.trainer.utils import FusedCausalLMOutput

from llm_rlhf.rl.token_math import logprobs_and_entropy_from_logits

MAX_COMPACT_ELEMENTS = 2**28  # labelled positions x vocabulary: 1 GiB of float32 logits


def compact_label_logprobs(
    hidden: torch.Tensor, labels: torch.Tensor, lm_head: torch.nn.Module
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities of the next-token labels, the LM head applied where a label counts.

    hidden: (B, T, H) the backbone's output; labels: (B, T) with -100 where no loss is taken (position t of
    `hidden` predicts labels[:, t + 1]). Returns (log_probs, entropy, is_top1, mask), each (B, T-1): zero
    (False) where mask is False; the entropy and is_top1 carry no gradient.
    """
    hidden, labels = hidden[:, :-1], labels[:, 1:]  # (B, T-1, H), (B, T-1): position t predicts token t+1
    mask = labels != -100  # (B, T-1)
    logits = lm_head(hidden[mask])  # (N, V)
    targets = labels[mask]  # (N,)
    picked, entropy = logprobs_and_entropy_from_logits(
        logits=logits.float()[None], labels=targets[None], entropy_grad=False
    )  # (1, N) each
    with torch.no_grad():
        is_top1 = logits.argmax(dim=-1) == targets  # (N,)

    def scatter(values: torch.Tensor) -> torch.Tensor:  # (N,) -> (B, T-1), zero off the mask
        return values.new_zeros(mask.shape).masked_scatter(mask, values)

    return scatter(picked[0]), scatter(entropy[0]), scatter(is_top1), mask


def _plain_logits(config) -> bool:
    """True when the model's logits are lm_head(h) as is: no soft-capping or scaling in its config."""
    text = config.get_text_config()
    scaled = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier")
    return all(getattr(text, key, None) is None for key in scaled + ("logits_scaling",))


def use_compact_lm_head(model) -> bool:
    """Route `model(..., fused_lm_head=True)` (TRL's SFT loss) through `compact_label_logprobs`.

    model: the HF causal LM that TRL patched (for a peft model, its base model). Every other call goes to
    TRL's forward unchanged (generation, the eval loop's logits). Returns False, changing nothing, when the
    model's logits are scaled or soft-capped."""
    if not _plain_logits(model.config):
        return False
    trl_forward = model.forward

    def forward(self, *args, fused_lm_head=False, labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head or "shift_labels" in kwargs:
            return trl_forward(
                *args,
                fused_lm_head=fused_lm_head,
                labels=labels,
                num_items_in_batch=num_items_in_batch,
                **kwargs,
            )
        vocab = self.get_output_embeddings().weight.shape[0]
        if int((labels[:, 1:] != -100).sum()) * vocab > MAX_COMPACT_ELEMENTS:
            return trl_forward(
                *args, fused_lm_head=True, labels=labels, num_items_in_batch=num_items_in_batch, **kwargs
            )
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state  # (B, T, H)
        log_probs, entropy, is_top1, mask = compact_label_logprobs(
            hidden, labels.to(hidden.device), self.get_output_embeddings()
        )
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(
            loss=-log_probs.sum() / count,
            log_probs=log_probs,
            entropy=entropy,
            is_top1=is_top1,
            label_mask=mask,
        )

    model.forward = types.MethodType(forward, model)
    return True
