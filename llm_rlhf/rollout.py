"""Sampling responses and the forwards over them, shared by PPO and evaluation.

    left_pad        token-id lists -> query, query_mask (B, P): every response starts at column P
    sample          query -> `Samples`: responses from `generate`, cut after the first EOS, drawn from
                    exactly softmax(logits / temperature) (top-k/top-p if asked; nothing from the checkpoint)
    Rollout         `Samples` plus everything PPO computes on them (complete when built)
    Samples.trimmed / pad_columns  no compute on padding: forwards run on the real tokens' columns only,
                    their outputs go back on the full (B, R) grid with zeros at the padding
    response_logprobs_and_values   the policy / reference forward over query + response (PPO)
    response_logits                a plain causal-LM forward over query + response (evaluation's KL)

The caller owns the random stream (PPO samples from the global RNG, evaluation from a fork seeded per
batch) and the contexts around `generate` (autocast, gathered shards).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from llm_rlhf import ppo_math
from llm_rlhf.models import position_ids_from_mask


@dataclass
class Samples:
    """Sampled responses for a batch of queries. Layout of a row (query left-padded, response right-padded):

        sequence       pad pad q q q | r r r EOS pad pad
        attention      0   0   1 1 1 | 1 1 1 1   0   0
        response_mask                | T T T T   F   F     (tokens after the first EOS are padding)

    query, query_mask: (B, P) long; response: (B, R) long; response_mask: (B, R) bool.
    """

    query: torch.Tensor
    query_mask: torch.Tensor
    response: torch.Tensor
    response_mask: torch.Tensor

    @property
    def sequence(self) -> torch.Tensor:
        return torch.cat([self.query, self.response], dim=1)  # (B, P + R)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.query_mask.long(), self.response_mask.long()], dim=1)  # (B, P + R) long

    def ended_with_eos(self, eos_token_id: int) -> torch.Tensor:
        """(B,) True where the response contains EOS (its last unmasked token); False if truncated."""
        return ((self.response == eos_token_id) & self.response_mask).any(-1)

    def select(self, index):
        """The rows `index` (a slice or a (b,) index tensor) of every field, as the same type."""
        return type(self)(**{f.name: getattr(self, f.name)[index] for f in dataclasses.fields(self)})

    def trimmed(self):
        """The same rows without the columns that are padding in every row, as the same type: the query
        keeps its columns from the first one holding a real token in some row (the longest real query),
        the response its columns up to the last one holding a real token (the longest real response).

            query (P = 5)    | response (R = 6)              query (P' = 4) | response (R' = 3)
            pad pad pad q q  | r r   EOS pad pad pad   ->    pad pad q q    | r r   EOS
            pad q   q   q q  | r EOS pad pad pad pad         q   q   q q    | r EOS pad

        Every real token keeps its token id, mask and position (positions count real tokens only,
        `models.position_ids_from_mask`), and no real position attends to a dropped column (padding), so a
        forward over the trimmed rows gives the same outputs at every real position up to float rounding
        (matmuls of another shape; `tests/test_trim.py`). Shorter prompts and responses of the batch stay
        padded. Fields: query and query_mask are cut on the left, every other field with a column axis
        (response, response_mask and, for a `Rollout`, the (B, R) tensors) on the right; scores (B,) stay.
        Outputs of the forward: (B, R') -> `pad_columns(x, R)`. Issue 14: responses that end after 5
        tokens no longer pay for max_new_tokens = 48 in the reference, RM and every PPO epoch.
        """
        has_query = self.query_mask.bool().any(0)  # (P,) a real query token in some row
        has_response = self.response_mask.bool().any(0)  # (R,) a real response token in some row
        query_start = int(has_query.int().argmax())  # the first such column (0 if none)
        response_end = len(has_response) - int(has_response.flip(0).int().argmax())  # one past the last
        return self.columns(query_start, response_end)

    def columns(self, query_start: int | None, response_end: int | None):
        """Query columns [query_start:] and response columns [:response_end] of every field (see `trimmed`)."""
        out = {}
        for f in dataclasses.fields(self):
            x = getattr(self, f.name)
            if f.name in ("query", "query_mask"):
                x = x[:, query_start:]  # (B, P')
            elif x.dim() > 1:
                x = x[:, :response_end]  # (B, R') aligned with the response tokens
            out[f.name] = x
        return type(self)(**out)


def pad_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    """(B, R') -> (B, width): zeros appended on the right, for the outputs of a forward over
    `Samples.trimmed()` rows (the zeros sit at padding, which response_mask masks out). Differentiable."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))  # (B, width)


@dataclass
class Rollout(Samples):
    """One PPO rollout batch: the samples and, aligned with the response tokens, the old policy's
    logprobs, values and entropy, the reference's ref_logprobs: (B, R) each; the RM's scores: (B,)."""

    logprobs: torch.Tensor
    values: torch.Tensor
    entropy: torch.Tensor
    ref_logprobs: torch.Tensor
    scores: torch.Tensor

    @classmethod
    def of(cls, samples: Samples, **tensors: torch.Tensor) -> Rollout:
        """`samples` with the five tensors above, given by name."""
        return cls(**{f.name: getattr(samples, f.name) for f in dataclasses.fields(Samples)}, **tensors)


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """A prompt's token ids as every stage sees it: `tokenizer(prompt)` with its special tokens, so BOS
    where the tokenizer adds one (Llama-style), none for GPT-2 and SmolLM2 - the way TRL's SFT and the
    RM tokenize prompt + response, so the policy is sampled from the context it was trained on."""
    return tokenizer(prompt)["input_ids"]


def left_pad(queries: list[list[int]], pad_token_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists -> query (B, P) long, query_mask (B, P) long, P = the longest query."""
    P = max(len(q) for q in queries)
    query = torch.full((len(queries), P), pad_token_id, dtype=torch.long)  # (B, P)
    query_mask = torch.zeros((len(queries), P), dtype=torch.long)  # (B, P)
    for i, q in enumerate(queries):  # left padding: the response starts at column P in every row
        query[i, P - len(q) :] = torch.tensor(q)
        query_mask[i, P - len(q) :] = 1
    return query.to(device), query_mask.to(device)


@contextmanager
def generation_config_hidden(lm):
    """Hide the checkpoint's generation_config.json while `generate` runs.

    transformers fills every generation setting left unset from the model's generation_config (a hub
    model's may set repetition_penalty, no_repeat_ngram_size, top_k, min_p, ...) and then from its global
    defaults (top_k=50). Any of them would reshape the distribution the tokens are drawn from, while PPO's
    log-probs and KL are computed from the plain softmax(logits / temperature). So only the special-token
    ids stay, and `sampling_settings` sets everything that shapes the distribution."""
    inner = lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # peft wraps the HF model
    saved = getattr(inner, "generation_config", None)
    if saved is None:  # not a transformers model: nothing to hide
        yield
        return
    inner.generation_config = GenerationConfig(
        bos_token_id=saved.bos_token_id, eos_token_id=saved.eos_token_id, pad_token_id=saved.pad_token_id
    )
    try:
        yield
    finally:
        inner.generation_config = saved


def sampling_settings(*, temperature: float, top_k: int, top_p: float) -> dict:
    """`generate` kwargs for sampling from softmax(logits / temperature), truncated only by top_k (0 = off)
    and top_p (1 = off): the explicit 0 matters, None would mean transformers' default top_k=50."""
    return {"do_sample": True, "temperature": temperature, "top_k": top_k, "top_p": top_p}


@torch.no_grad()
def sample(
    lm,
    tokenizer,
    query: torch.Tensor,
    query_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    pad_to_max_new_tokens: bool = False,
) -> Samples:
    """y ~ pi(.|x) with the KV cache (HF derives the positions from the attention mask); stops at EOS,
    which may be the first token (no min_new_tokens: masking EOS would sample from another distribution
    than the one PPO's log-probs describe). pad_to_max_new_tokens: R = max_new_tokens even when every row
    ended early (the same shape on every process). Draws from the current global RNG."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    with generation_config_hidden(lm):
        sequences = lm.generate(
            input_ids=query,
            attention_mask=query_mask,
            **sampling_settings(temperature=temperature, top_k=top_k, top_p=top_p),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            use_cache=True,
        )
    response = sequences[:, query.shape[1] :]  # (B, R)
    if pad_to_max_new_tokens and response.shape[1] < max_new_tokens:  # generate stopped: every row ended
        fill = response.new_full((response.shape[0], max_new_tokens - response.shape[1]), pad)
        response = torch.cat([response, fill], dim=1)  # (B, max_new_tokens)
    response_mask = ppo_math.response_mask_from_tokens(response=response, eos_token_id=eos)  # (B, R)
    response = torch.where(response_mask, response, pad)  # (B, R) padding after the first EOS
    return Samples(query=query, query_mask=query_mask, response=response, response_mask=response_mask)


def response_logprobs_and_values(model, samples: Samples, temperature: float, *, entropy: str = "grad"):
    """One forward of `models.PolicyWithValue` or `models.Reference` over query + response; outputs
    aligned with the response tokens.

    The LM head runs only at the R positions whose logits are used (`logits_to_keep`), not at the query.
    entropy: "grad" (differentiable), "stats" (a metric only: no autograd graph over the (B, R, V)
    softmax) or "none" (not computed, None).
    Returns logprobs (B, R), values (B, R), entropy (B, R); values is None for a plain LM (reference).
    """
    P, R = samples.query.shape[1], samples.response.shape[1]
    # Positions P-1 .. P+R-2. A tensor, not `R + 1`: indexing gives a contiguous (B, R, H) copy, so the
    # LM head is one matmul (a strided slice sends frozen weights, LoRA's and the reference's, to bmm: 2x).
    keep = torch.arange(P - 1, P + R - 1, device=samples.query.device)  # (R,)
    out = model(samples.sequence, samples.attention_mask, logits_to_keep=keep)
    logits, values = (
        out if isinstance(out, tuple) else (out, None)
    )  # policy: (logits, values); reference: logits
    # logits: (B, R, V): row t predicts response token t. In float32: under accelerate's mixed precision
    # `prepare` returns the policy's logits in float32 and the reference's stay bf16, and CPU autocast
    # runs log_softmax in the input's dtype, so without this KL != 0 at the first step (issue 13).
    logits = logits.float()
    logprobs = ppo_math.logprobs_from_logits(logits=logits, labels=samples.response, temperature=temperature)
    if entropy == "grad":
        entropy = ppo_math.entropy_from_logits(logits=logits, temperature=temperature)
    elif entropy == "stats":  # a metric: no graph, and chunks of 4 rows keep its (B, R, V) temporaries small
        with torch.no_grad():
            entropy = torch.cat(
                [ppo_math.entropy_from_logits(logits=z, temperature=temperature) for z in logits.split(4)]
            )  # (B, R)
    else:
        entropy = None
    if values is not None:
        values = values[:, P - 1 : -1]  # (B, R): V(s_t), the state before response token t
    return logprobs, values, entropy


def response_logits(lm, samples: Samples) -> torch.Tensor:
    """One plain causal-LM forward over query + response, positions from the attention mask (as in PPO),
    the logits of every position, then the response's. Returns (B, R, V) float."""
    mask = samples.attention_mask  # (B, P + R)
    logits = lm(
        input_ids=samples.sequence,
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        use_cache=False,
    ).logits  # (B, P + R, V)
    P = samples.query.shape[1]
    return logits[:, P - 1 : -1].float()  # (B, R, V): position t predicts response token t
