"""Log-probabilities, entropies and masks of sampled tokens: what every forward over a rollout, PPO's, the
reference's, evaluation's and DPO's, computes from logits before any of PPO's math (`ppo_math`).

    logits         (B, T, V) of the positions that predict the sampled tokens
    labels         (B, T) the sampled token ids; temperature: the sampling temperature (the distribution the
                   tokens were drawn from, whose log-probs PPO's ratios compare)
    response_mask  (B, T) bool, True on response tokens that count: up to and including the first EOS (or
                   stop), not padding

Only torch is imported, as in `ppo_math`.
"""

from __future__ import annotations

import math

import torch


def logprobs_from_logits(
    *, logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each chosen token: log softmax(logits / temperature)[labels].

    The temperature must be the one used for sampling, otherwise the ratio pi_theta / pi_old and the
    KL to the reference are measured for a different distribution than the one that produced the
    tokens (Huang et al. 2023, "The N implementation details of RLHF with PPO": scale the logits by the
    sampling temperature).

    logits: (B, T, V) float; labels: (B, T) long, where position t of `logits` predicts `labels[:, t]`
    (the caller does the shift). Returns (B, T).
    """
    if temperature != 1.0:
        logits = logits / temperature  # (B, T, V); skipped at 1.0 to avoid a copy of the logits
    logp = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    return logp.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)  # (B, T)


def entropy_from_logits(*, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the categorical distribution softmax(z), z = logits / temperature.

        H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v

    Logits of -inf (`mask_eos_logits`) are tokens of probability 0, which add 0 to the sum (p_v z_v is
    0 * -inf = nan, so z_v is read as 0 there; that also keeps nan out of the gradient).

    logits: (B, T, V). Returns (B, T).
    """
    if temperature != 1.0:
        logits = logits / temperature  # (B, T, V)
    probs = torch.softmax(logits, dim=-1)  # (B, T, V)
    finite = torch.where(torch.isneginf(logits), 0, logits)  # (B, T, V): 0 * 0 where p_v = 0
    return torch.logsumexp(logits, dim=-1) - (probs * finite).sum(dim=-1)  # (B, T)


def logprobs_and_entropy_from_logits(
    *, logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logprobs_from_logits` and `entropy_from_logits` from one log-softmax, logp = log softmax(z),
    z = logits / temperature:

        logprobs_t = logp_t[labels_t]          H_t = -sum_v exp(logp_{t,v}) logp_{t,v}

    (p_v log p_v read as 0 where logp_v = -inf: a token of probability 0, `mask_eos_logits`). The log-probs are
    bit for bit `logprobs_from_logits`'s; the entropy equals `entropy_from_logits` up to float rounding, without
    its second pass over the (B, T, V) logits (softmax and logsumexp). entropy_grad False: the entropy is a
    metric, computed without an autograd graph, 4 rows at a time (small (4, T, V) temporaries).

    logits: (B, T, V) float; labels: (B, T) long (position t predicts labels[:, t]). Returns ((B, T), (B, T)).
    """
    if temperature != 1.0:
        logits = logits / temperature  # (B, T, V)
    logp = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    logprobs = logp.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)  # (B, T)

    def entropy(part: torch.Tensor) -> torch.Tensor:
        finite = torch.where(torch.isneginf(part), 0, part)  # (b, T, V): 0 * 0 where p_v = 0
        return -(part.exp() * finite).sum(dim=-1)  # (b, T)

    if entropy_grad:
        return logprobs, entropy(logp)
    with torch.no_grad():
        return logprobs, torch.cat([entropy(part) for part in logp.detach().split(4)])  # (B, T)


def mask_eos_logits(*, logits: torch.Tensor, eos_token_id: int, min_new_tokens: int) -> torch.Tensor:
    """The logits sampling uses under `min_new_tokens`: EOS cannot be drawn before response token
    `min_new_tokens` (transformers' MinNewTokensLengthLogitsProcessor, which `rollout.sample` applies):

        z'_{t,v} = -inf   if v == eos_token_id and t < min_new_tokens
        z'_{t,v} = z_{t,v}  otherwise

    The log-probs of the sampled tokens must come from z' in every log-prob computation (policy, old policy,
    reference, evaluation's KL), or the ratio and the KL describe another distribution than the one the
    tokens were drawn from; the same mask on the policy and the reference keeps KL = 0 and ratio = 1 at the
    first step. Only EOS is masked, as transformers does: a pad token distinct from EOS is an ordinary token.

    logits: (B, T, V), position t predicts response token t (the caller does the shift). Returns (B, T, V),
    `logits` itself when min_new_tokens is 0. Differentiable (the masked entries get no gradient).
    """
    if min_new_tokens <= 0:
        return logits
    T, V = logits.shape[-2:]
    early = torch.arange(T, device=logits.device) < min_new_tokens  # (T,) positions t < min_new_tokens
    is_eos = torch.arange(V, device=logits.device) == eos_token_id  # (V,)
    return logits.masked_fill(early[:, None] & is_eos[None, :], -math.inf)  # (B, T, V)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only real tokens, so left padding does not shift absolute positions.

    attention_mask: (B, L) 0/1 -> (B, L) long; e.g. [0 0 1 1 1] -> [0 0 0 1 2].
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, L)


def response_mask_from_tokens(
    *, response: torch.Tensor, eos_token_id: int, stops: torch.Tensor | None = None
) -> torch.Tensor:
    """True up to and including the first end token; everything after it is padding. An end token is an
    EOS, or a token marked in `stops` (the token completing a stop string, `rollout.stop_string_ends`).
    The end token counts: it is a sampled action, and the score lands on it (the last True, see
    `ppo_math.shaped_rewards`).

        position        0     1     2     3     4
        response        r     r    EOS   pad   pad      (pad may be EOS itself, as for GPT-2)
        response_mask   T     T     T     F     F

        response        r    "\n"  r    EOS   pad      stop_strings ["\n"]: stops = F T F F F
        response_mask   T     T     F     F     F

    A row without an end token (truncated at max_new_tokens) is all True. The loop it replaces:
    `[[not any(is_end[b, :t]) for t in range(R)] for b in range(B)]`, is_end = (response == eos) | stops.

    response: (B, R) token ids; stops: (B, R) bool or None (no stop strings) -> (B, R) bool.
    """
    is_end = response == eos_token_id  # (B, R)
    if stops is not None:
        is_end = is_end | stops
    is_end = is_end.int()
    ends_before = is_end.cumsum(-1) - is_end  # (B, R) end tokens strictly before t
    return ends_before == 0
