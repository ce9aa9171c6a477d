"""Sampling responses and the forwards over them, shared by PPO and evaluation.

    Sampling        how responses are drawn (max_new_tokens, temperature, top_k, top_p, stop_strings,
                    min_new_tokens): one value built from any stage's flat config (`Sampling.of(cfg)`)
    left_pad        token-id lists -> query, query_mask (B, P): every response starts at column P
    sample          the one sampler (PPO, evaluation, best-of-n, DPO's evaluation, SFT's samples):
                    query + `Sampling` -> `Samples`: responses from `generate`, cut after the first EOS or stop
                    string, drawn from exactly softmax(logits / temperature) (top-k/top-p if asked, EOS masked
                    before min_new_tokens; nothing from the checkpoint), or greedy at temperature 0
    stop_string_ends  where each response's first stop string ends (a token-level cut of the decoded text;
                    the same test, `completes_stop_string`, stops `generate` through `StopStringsCriteria`)
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
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from llm_rlhf.core.config import require
from llm_rlhf.core.errors import UserError
from llm_rlhf.rl import fast_sampling, token_math
from llm_rlhf.rl.token_math import position_ids_from_mask


@dataclass
class Samples:
    """Sampled responses for a batch of queries. Layout of a row (query left-padded, response right-padded):

        sequence       pad pad q q q | r r r EOS pad pad
        attention      0   0   1 1 1 | 1 1 1 1   0   0
        response_mask                | T T T T   F   F     (tokens after the first EOS are padding)

    A response may also end at the token completing a stop string (`stop_string_ends`): that token is its
    last real one, as an EOS would be, and `stopped` marks the row.

    query, query_mask: (B, P) long; response: (B, R) long; response_mask: (B, R) bool; stopped: (B,) bool,
    True where a stop string ended the response, False where an EOS did or nothing did (None: sampled
    without stop strings, as False). sampler_logprobs: (B, R) float, the sampler's own log q(y_t) of each
    response token, 0 at padding (None when greedy or sampled by `generate`): q is the policy's distribution
    up to float rounding in float32, another one with `sampling_dtype: bfloat16`. trunk: (B, P + R, H), the
    policy's hidden states after its frozen lower blocks (`llm_rlhf.models.trunk`), set by PPO's rollout to
    reuse them in the forwards that follow; None otherwise.
    """

    query: torch.Tensor
    query_mask: torch.Tensor
    response: torch.Tensor
    response_mask: torch.Tensor
    stopped: torch.Tensor | None = None
    sampler_logprobs: torch.Tensor | None = None
    env_mask: torch.Tensor | None = None
    env_rewards: torch.Tensor | None = None
    turns: torch.Tensor | None = None
    trunk: torch.Tensor | None = None

    @property
    def sequence(self) -> torch.Tensor:
        return torch.cat([self.query, self.response], dim=1)  # (B, P + R)

    @property
    def tokens_mask(self) -> torch.Tensor:
        """(B, R) bool: the response's real tokens, the policy's and (in an episode) the environment's."""
        return self.response_mask if self.env_mask is None else self.response_mask | self.env_mask

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.query_mask.long(), self.tokens_mask.long()], dim=1)  # (B, P + R) long

    def ended_with_eos(self, eos_token_id: int) -> torch.Tensor:
        """(B,) True where the response's last policy token is EOS (a response's first EOS is its last
        unmasked token; an episode's last turn ended with one); False if truncated."""
        mask = self.response_mask
        R = mask.shape[1]
        last = R - 1 - mask.flip(1).int().argmax(1)  # (B,) the last True column (R - 1 when none)
        return (self.response.gather(1, last[:, None])[:, 0] == eos_token_id) & mask.any(1)

    def ended(self, eos_token_id: int) -> torch.Tensor:
        """(B,) True where the response ended, with EOS or a stop string; False if truncated at
        max_new_tokens. What the EOS trick, the eos_rate metric and evaluation's `eos` count."""
        ended = self.ended_with_eos(eos_token_id)
        return ended if self.stopped is None else ended | self.stopped

    def to(self, device):
        """Every tensor field on `device`, as the same type (itself when all are there already)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if all(x is None or x.device == torch.device(device) for x in fields.values()):
            return self
        return type(self)(**{k: x if x is None else x.to(device) for k, x in fields.items()})

    def select(self, index):
        """The rows `index` (a slice or a (b,) index tensor) of every field, as the same type."""
        return type(self)(
            **{
                f.name: x if (x := getattr(self, f.name)) is None else x[index]
                for f in dataclasses.fields(self)
            }
        )

    def trimmed(self):
        """The same rows without the columns that are padding in every row, as the same type: the query
        keeps its columns from the first one holding a real token in some row (the longest real query),
        the response its columns up to the last one holding a real token (the longest real response).

            query (P = 5)    | response (R = 6)              query (P' = 4) | response (R' = 3)
            pad pad pad q q  | r r   EOS pad pad pad   ->    pad pad q q    | r r   EOS
            pad q   q   q q  | r EOS pad pad pad pad         q   q   q q    | r EOS pad

        Every real token keeps its token id, mask and position (positions count real tokens only,
        `token_math.position_ids_from_mask`), and no real position attends to a dropped column (padding), so a
        forward over the trimmed rows gives the same outputs at every real position up to float rounding
        (matmuls of another shape; `tests/ppo/test_trim.py`). Shorter prompts and responses of the batch stay
        padded. Fields: query and query_mask are cut on the left, every other field with a column axis
        (response, response_mask and, for a `Rollout`, the (B, R) tensors) on the right; scores (B,) stay.
        Outputs of the forward: (B, R') -> `pad_columns(x, R)`. So a batch whose responses end after 5
        tokens does not pay for max_new_tokens = 48 in the reference, RM and every PPO epoch.
        """
        has_query = self.query_mask.bool().any(0)  # (P,) a real query token in some row
        has_response = self.tokens_mask.bool().any(0)  # (R,) a real response token in some row
        query_start = int(has_query.int().argmax())  # the first such column (0 if none)
        response_end = len(has_response) - int(has_response.flip(0).int().argmax())  # one past the last
        return self.columns(query_start, response_end)

    def columns(self, query_start: int | None, response_end: int | None):
        """Query columns [query_start:] and response columns [:response_end] of every field (see `trimmed`)."""
        out = {}
        P = self.query.shape[1]
        for f in dataclasses.fields(self):
            x = getattr(self, f.name)
            if f.name in ("query", "query_mask"):
                x = x[:, query_start:]  # (B, P')
            elif f.name == "trunk" and x is not None:
                x = x[:, query_start : P + (self.response.shape[1] if response_end is None else response_end)]
            elif x is not None and x.dim() > 1:
                x = x[:, :response_end]  # (B, R') aligned with the response tokens
            out[f.name] = x
        return type(self)(**out)


def pad_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    """(B, R') -> (B, width): zeros appended on the right, for the outputs of a forward over
    `Samples.trimmed()` rows (the zeros sit at padding, which response_mask masks out). Differentiable."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))  # (B, width)


@dataclass(kw_only=True)  # keyword-only: its fields follow Samples' `stopped`, which has a default
class Rollout(Samples):
    """One PPO rollout batch: the samples and, aligned with the response tokens, the old policy's
    logprobs, values and entropy, the reference's ref_logprobs (and with a teacher its teacher_logprobs):
    (B, R) each; the RM's scores: (B,). values is None without a value function (PPO's critic-free advantage
    estimators)."""

    logprobs: torch.Tensor
    values: torch.Tensor | None
    entropy: torch.Tensor
    ref_logprobs: torch.Tensor
    scores: torch.Tensor
    teacher_logprobs: torch.Tensor | None = None  # on-policy distillation: log pi_teacher(y_t|s_t), (B, R)
    teacher_top_logprobs: torch.Tensor | None = None  # distill_loss forward_kl / jsd: its top k, (B, R, k)
    teacher_top_ids: torch.Tensor | None = None  # their token ids, (B, R, k)

    @classmethod
    def of(cls, samples: Samples, **tensors: torch.Tensor) -> Rollout:
        """`samples` with the tensors above, given by name."""
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


@dataclass(frozen=True)
class Sampling:
    """How responses are drawn: the one value every sampler takes (PPO's rollouts and held-out evaluation,
    `llm-rlhf eval`, best-of-n and DPO's points in `compare`, SFT's samples), built from any stage's flat
    config by `Sampling.of(cfg)`, so recipes stay flat and no key travels down the calls on its own.

    max_new_tokens  the longest response, in tokens
    temperature     softmax(logits / temperature); 0 = greedy (argmax, no random draw: SFT's
                    `temperature: 0`; a greedy baseline response)
    top_k, top_p    truncation of that distribution (0 and 1.0 = off; PPO requires off)
    stop_strings    a response ends at the token completing the first of these in its text (kept)
    min_new_tokens  EOS (and a stop string) cannot end a response before this many tokens
    sampling_dtype  the dtype of the decoder's linear layers while sampling: float32 (the policy's own
                    distribution, up to float rounding) or bfloat16 (an opt-in: another distribution)
    sampling_compile  decode steps with a static KV cache through torch.compile (CUDA graphs on a GPU): the
                    same distribution, an opt-in for GPUs (`fast_sampling.compiled_step`)
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_strings: tuple[str, ...] = ()
    min_new_tokens: int = 0
    sampling_dtype: str = "float32"
    sampling_compile: bool = False

    @classmethod
    def of(cls, cfg: Any) -> Sampling:
        """The settings of a flat config: its fields of these names (a stage without stop strings or
        min_new_tokens, like SFT, gets the defaults: off)."""
        values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls) if hasattr(cfg, f.name)}
        if "stop_strings" in values:
            values["stop_strings"] = tuple(values["stop_strings"])
        return cls(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def ends(self) -> dict[str, Any]:
        """The settings that decide where a response ends, as config keys: the score reads a response up to
        its end, so they are part of how a sample is scored (`scoring.scored_as`)."""
        return {"stop_strings": list(self.stop_strings), "min_new_tokens": self.min_new_tokens}

    def generate_kwargs(self) -> dict:
        """`generate` kwargs for sampling from softmax(logits / temperature), truncated only by top_k (0 = off)
        and top_p (1 = off): the explicit 0 matters, None would mean transformers' default top_k=50. Greedy:
        do_sample off and nothing else."""
        if self.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


def check_generation_controls(cfg) -> None:
    """stop_strings and min_new_tokens of a PPO or evaluation config (ConfigError naming the key)."""
    require(
        isinstance(cfg.stop_strings, list) and all(isinstance(x, str) and x for x in cfg.stop_strings),
        "stop_strings",
        "must be a list of non-empty strings",
    )
    require(cfg.min_new_tokens >= 0, "min_new_tokens", "must be >= 0 (0 = off)")
    require(
        cfg.sampling_dtype in fast_sampling.SAMPLING_DTYPES,
        "sampling_dtype",
        f"must be one of {', '.join(fast_sampling.SAMPLING_DTYPES)}",
    )
    require(
        not (cfg.sampling_compile and cfg.sampling_dtype != "float32"),
        "sampling_compile",
        "compiles the model's own float32 layers: use it with sampling_dtype float32",
    )
    require(
        cfg.min_new_tokens <= cfg.max_new_tokens,
        "min_new_tokens",
        f"must be <= max_new_tokens ({cfg.max_new_tokens})",
    )


@contextmanager
def generation_config_hidden(lm):
    """Hide the checkpoint's generation_config.json while `generate` runs.

    transformers fills every generation setting left unset from the model's generation_config (a hub
    model's may set repetition_penalty, no_repeat_ngram_size, top_k, min_p, ...) and then from its global
    defaults (top_k=50). Any of them would reshape the distribution the tokens are drawn from, while PPO's
    log-probs and KL are computed from the plain softmax(logits / temperature). So only the special-token
    ids stay, and `Sampling.generate_kwargs` sets everything that shapes the distribution."""
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


def completes_stop_string(before: str, after: str, stop_strings) -> bool:
    """Whether the token that turned the decoded text `before` into `after` completes a stop string: `after`
    holds an occurrence that `before` does not, one ending past their common prefix (the common prefix is
    `before` itself, unless a byte-level tokenizer decodes an unfinished character of `before` otherwise).

        before "The fi"   after "The film"   stop "film"  -> True    stop "The" -> False (already there)
    """
    common = len(os.path.commonprefix([before, after]))
    return any(stop in after[max(0, common - len(stop) + 1) :] for stop in stop_strings)


def stop_string_ends(
    tokenizer, response: torch.Tensor, response_mask: torch.Tensor, stop_strings, *, min_new_tokens: int = 0
) -> torch.Tensor:
    """Where each response's first stop string ends, token by token: True at the first position
    t >= min_new_tokens - 1 whose token completes a stop string in the decoded response
    (`completes_stop_string` of the texts of response[:t] and response[:t+1]; special tokens decoded as
    text, so a stop string may be one), among the tokens response_mask marks (`sample`: those before the
    first EOS); at most one True per row.

        stop_strings ["\n"]                       " great"  "!\n"    " And"  EOS     ->  F  T  F  F
        stop_strings ["stop"]                     " st"     "opped"  " now"          ->  F  T  F
        stop_strings ["\n\n"]                     "\n"      "\n\nThe"                 ->  F  T
        stop_strings ["o"], min_new_tokens 4      "s"  "t"  "o"  "p"  " no"  "w"     ->  F  F  F  F  T  F

    The token completing the stop string is kept even when it runs past it ("opped", "\n\nThe"): a token
    cannot be split, and dropping it would end the response one token early, where the text held no stop
    string yet. Only the response is read, not the prompt before it. A stop string completed before
    min_new_tokens is ignored, as at an EOS there (vLLM's min_tokens does the same): the response then ends
    at the next one, so it has at least min_new_tokens tokens unless it ends at max_new_tokens. Cutting after
    sampling leaves the distribution of the kept tokens unchanged; `StopStringsCriteria` merely stops
    `generate` once every row has ended, with the same test.

    response: (B, R) token ids; response_mask: (B, R) bool. Returns (B, R) bool.
    """
    stops = torch.zeros_like(response_mask)  # (B, R)
    if not stop_strings:
        return stops
    first = max(min_new_tokens, 1)  # the shortest response a stop string may end
    for b in range(response.shape[0]):
        ids = response[b][response_mask[b]].tolist()  # the tokens that may end with a stop string
        prefixes = [ids[:n] for n in range(first - 1, len(ids) + 1)]  # lengths first - 1 .. len(ids)
        texts = tokenizer.batch_decode(prefixes, skip_special_tokens=False)
        for n, before, after in zip(range(first, len(ids) + 1), texts, texts[1:]):
            if completes_stop_string(before, after, stop_strings):
                stops[b, n - 1] = True  # token n - 1 turned response[:n-1] into response[:n]
                break
    return stops


class StopStringsCriteria(StoppingCriteria):
    """Ends a row of `generate` when its newest token completes a stop string in its response (the tokens
    after the prompt columns), with the test of `stop_string_ends`, so the row ends where the cut puts its
    end and generation stops once every row has ended. A stopping criterion does not touch the logits:
    rows that end get padding, and the draws of the other rows are unchanged. (transformers' own
    `stop_strings` also reads the prompt, so a stop string straddling the prompt's end would end a row whose
    response holds none, and it knows nothing of min_new_tokens.)"""

    def __init__(self, tokenizer, stop_strings, *, prompt_length: int, min_new_tokens: int):
        self.tokenizer, self.stop_strings = tokenizer, list(stop_strings)
        self.prompt_length, self.min_new_tokens = prompt_length, min_new_tokens

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        response = input_ids[:, self.prompt_length :]  # (B, n): the response so far, n >= 1
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # (B,)
        if response.shape[1] < max(self.min_new_tokens, 1):
            return done
        before = self.tokenizer.batch_decode(response[:, :-1].tolist(), skip_special_tokens=False)
        after = self.tokenizer.batch_decode(response.tolist(), skip_special_tokens=False)
        for b in range(len(after)):
            done[b] = completes_stop_string(before[b], after[b], self.stop_strings)
        return done


@torch.no_grad()
def sample(
    lm,
    tokenizer,
    query: torch.Tensor,
    query_mask: torch.Tensor,
    sampling: Sampling,
    *,
    pad_to_max_new_tokens=False,
) -> Samples:
    """y ~ pi(.|x) with the KV cache, as `sampling` says: a transformers LM through `fast_sampling.generate`
    (generate's loop with one uniform per token and LoRA merged for decoding: the same distribution, another
    random stream than `generate`'s), anything else through its own `generate`; the positions count real
    tokens only, from the attention mask. It
    stops at EOS, which may be the first token unless min_new_tokens > 0: then EOS cannot be drawn at response
    positions t < min_new_tokens (transformers' MinNewTokensLengthLogitsProcessor: the distribution is that of
    `token_math.mask_eos_logits`, which every log-prob computation must apply too). A response also ends at
    the token completing its first stop string (`stop_string_ends`; none before min_new_tokens), cut after
    sampling: the kept tokens are draws of the same distribution, the tokens after the end are padding.
    pad_to_max_new_tokens: R = max_new_tokens even when every row ended early (the same shape on every
    process). Draws from the current global RNG (none when greedy). Under ZeRO-3 every process runs the same
    number of decode steps (`fast_sampling.steps_on_every_process`)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    criteria = StoppingCriteriaList()
    stop_strings, min_new_tokens = sampling.stop_strings, sampling.min_new_tokens
    if stop_strings:
        criteria.append(
            StopStringsCriteria(
                tokenizer, stop_strings, prompt_length=query.shape[1], min_new_tokens=min_new_tokens
            )
        )
    token_logprobs: list[torch.Tensor] = []  # (B,) per step: the sampler's log q(y_t)
    if fast_sampling.supports(lm):  # generate's loop, the same distribution, faster
        sequences = fast_sampling.generate(
            lm,
            query,
            query_mask,
            sampling,
            eos_token_id=eos,
            pad_token_id=pad,
            stopping_criteria=criteria,
            token_logprobs=token_logprobs,
        )
    elif sampling.sampling_dtype != "float32":
        raise UserError(
            f"sampling_dtype {sampling.sampling_dtype}: lower-precision sampling needs the fast sampler, which "
            f"runs transformers causal LMs; {type(lm).__name__} samples through its own generate (use float32)"
        )
    elif sampling.sampling_compile:
        raise UserError(
            f"sampling_compile: compiled decode steps need the fast sampler, which runs transformers causal "
            f"LMs; {type(lm).__name__} samples through its own generate (set sampling_compile false)"
        )
    else:
        with generation_config_hidden(lm):
            sequences = lm.generate(
                input_ids=query,
                attention_mask=query_mask,
                **sampling.generate_kwargs(),
                max_new_tokens=sampling.max_new_tokens,
                **({"min_new_tokens": min_new_tokens} if min_new_tokens > 0 else {}),
                stopping_criteria=criteria,
                eos_token_id=eos,
                pad_token_id=pad,
                use_cache=True,
                synced_gpus=fast_sampling.steps_on_every_process(lm),
            )
    response = sequences[:, query.shape[1] :]  # (B, R)
    width = sampling.max_new_tokens
    if pad_to_max_new_tokens and response.shape[1] < width:  # generate stopped: every row ended
        fill = response.new_full((response.shape[0], width - response.shape[1]), pad)
        response = torch.cat([response, fill], dim=1)  # (B, max_new_tokens)
    eos_mask = token_math.response_mask_from_tokens(response=response, eos_token_id=eos)  # (B, R) up to EOS
    before_eos = eos_mask & (response != eos)  # (B, R): an EOS ends its response itself, whatever its text
    stops = stop_string_ends(tokenizer, response, before_eos, stop_strings, min_new_tokens=min_new_tokens)
    response_mask = token_math.response_mask_from_tokens(response=response, eos_token_id=eos, stops=stops)
    response = torch.where(response_mask, response, pad)  # (B, R) padding after the first EOS or stop
    sampler_logprobs = None
    if token_logprobs:
        sampler_logprobs = pad_columns(torch.stack(token_logprobs, dim=1), response.shape[1])  # (B, R)
        sampler_logprobs = torch.where(response_mask, sampler_logprobs, 0.0)
    return Samples(
        query=query,
        query_mask=query_mask,
        response=response,
        response_mask=response_mask,
        stopped=(stops & response_mask).any(-1),  # (B,)
        sampler_logprobs=sampler_logprobs,
    )


def masked_response_logits(model, samples: Samples, sampling: Sampling, *, eos_token_id: int | None = None):
    """One forward of `loading.PolicyWithValue` or `loading.Reference` over query + response: the logits that
    predict the response tokens, (B, R, V) float32, EOS masked before response token min_new_tokens
    (`token_math.mask_eos_logits`), and the values V(s_t) (B, R), None for a plain LM (reference, teacher).
    The LM head runs only at the R positions whose logits are used (`logits_to_keep`), not at the query."""
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
    # runs log_softmax in the input's dtype, so without this KL != 0 at the first step.
    logits = logits.float()
    logits = token_math.mask_eos_logits(
        logits=logits, eos_token_id=eos_token_id, min_new_tokens=sampling.min_new_tokens
    )
    if values is not None:
        values = values[:, P - 1 : -1]  # (B, R): V(s_t), the state before response token t
    return logits, values


def response_logprobs_and_values(
    model,
    samples: Samples,
    sampling: Sampling,
    *,
    eos_token_id: int | None = None,
    entropy: str = "grad",
    at_ids: torch.Tensor | None = None,
):
    """One forward of `loading.PolicyWithValue` or `loading.Reference` over query + response
    (`masked_response_logits`); outputs aligned with the response tokens. The log-probs and the entropy are
    those of the distribution `sampling` drew the tokens from: softmax(logits / temperature), with EOS masked
    before response token min_new_tokens when min_new_tokens > 0 (`token_math.mask_eos_logits`).

    entropy: "grad" (differentiable), "stats" (a metric only: no autograd graph over the (B, R, V)
    softmax) or "none" (not computed, None). at_ids (B, R, k) long: also the log-probs of those tokens at each
    position (on-policy distillation's teacher top-k, `topk_divergence`), differentiable.
    Returns logprobs (B, R), values (B, R), entropy (B, R), and with at_ids their log-probs (B, R, k); values
    is None for a plain LM (reference).
    """
    temperature = sampling.temperature
    logits, values = masked_response_logits(model, samples, sampling, eos_token_id=eos_token_id)
    if entropy == "none":
        logprobs = token_math.logprobs_from_logits(
            logits=logits, labels=samples.response, temperature=temperature
        )
        entropy = None
    else:  # "grad": differentiable; "stats": a metric, no autograd graph over the (B, R, V) softmax
        logprobs, entropy = token_math.logprobs_and_entropy_from_logits(
            logits=logits, labels=samples.response, temperature=temperature, entropy_grad=entropy == "grad"
        )
    if at_ids is None:
        return logprobs, values, entropy
    at = torch.log_softmax(logits / temperature, dim=-1).gather(-1, at_ids)  # (B, R, k)
    return logprobs, values, entropy, at


@torch.no_grad()
def teacher_logprobs_and_top_k(
    model, samples: Samples, sampling: Sampling, *, eos_token_id: int | None = None, top_k: int = 0
):
    """On-policy distillation's teacher, one forward (`masked_response_logits`): log pi_teacher(y_t|s_t) of the
    sampled tokens, (B, R), computed as the reference's are (`response_logprobs_and_values`, entropy "none"), and
    with top_k > 0 the log-probs (B, R, k) and ids (B, R, k) of its k most likely tokens at each position (the
    same temperature; largest first). Returns (logprobs, top-k log-probs or None, top-k ids or None)."""
    logits, _ = masked_response_logits(model, samples, sampling, eos_token_id=eos_token_id)
    logprobs = token_math.logprobs_from_logits(
        logits=logits, labels=samples.response, temperature=sampling.temperature
    )
    if top_k == 0:
        return logprobs, None, None
    top, ids = torch.log_softmax(logits / sampling.temperature, dim=-1).topk(top_k, dim=-1)  # (B, R, k) each
    return logprobs, top, ids


def response_logits(lm, samples: Samples) -> torch.Tensor:
    """One plain causal-LM forward over query + response, positions from the attention mask (as in PPO),
    the LM head at the positions that predict the response's tokens only (`logits_to_keep`, as PPO's
    forwards). Returns (B, R, V) float: row t predicts response token t."""
    mask = samples.attention_mask  # (B, P + R)
    P, R = samples.query.shape[1], samples.response.shape[1]
    keep = torch.arange(P - 1, P + R - 1, device=mask.device)  # (R,) positions P-1 .. P+R-2
    logits = lm(
        input_ids=samples.sequence,
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        use_cache=False,
        logits_to_keep=keep,
    ).logits  # (B, R, V)
    return logits.float()
