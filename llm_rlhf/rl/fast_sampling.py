"""Sampling at the machine's limit, from the same distribution as transformers' `generate`.

    generate(lm, query, query_mask, sampling, ...)  what `rollout.sample` runs: `decode` inside `decoding_weights`
    decode              the KV-cached sampling loop of `generate` (transformers' own logits processors, the
                        same positions, masks and cache), with one uniform per row and token (`draw_tokens`)
                        instead of `torch.multinomial`'s exponential per vocabulary entry
    draw_tokens         inverse-CDF sampling from probs (B, V): exactly Categorical(probs)
    decoding_weights(lm)   inside: every linear layer of `lm` runs from a copy of its weight made for decoding
                           - a LoRA layer from its merged weight W + scaling * B A (one matmul instead of three),
                           - on CPU, in float32, from a copy prepacked for the matmul library,
                           - under autocast, from a copy in autocast's dtype (cast once, not at every call),
                           the model's parameters untouched (nothing is merged into them, nothing to unmerge)
    compiled_step(model)   the opt-in `sampling_compile`: decode steps with a static KV cache through
                           torch.compile (fixed shapes; CUDA graphs on a GPU), one compilation per batch size
                           and prompt bucket, kept with the model

A decode step multiplies a few rows (the batch) by every weight of the model, so on a CPU it is bound by
reading the weights, and `F.linear` (MKL's sgemm) re-packs each weight into the kernel's blocked layout at
every call; oneDNN's kernel on weights packed once per `sample` call ran a step 1.0-2.3x faster on AMD EPYC
and no faster on Intel Xeon (but at batch 8), so it is the default on AMD CPUs (`benchmarks/rollout.py`,
`benchmarks/README.md`). The largest gain is the draw: `torch.multinomial` draws one exponential per
vocabulary entry, `draw_tokens` one uniform per row.

The tokens come from the same distribution: a merged or prepacked matmul computes the same sums as the
unmerged `F.linear`, up to float rounding (another summation order), the same kind of difference as between
the KV-cached decode and the full forward that PPO's log-probs come from. The log-probs, the KL and the
ratio are computed after sampling by the unchanged forwards, so KL = 0 and ratio = 1 at the first step hold
exactly, and `tests/rl/test_sampling.py` checks the draws against a naive loop draw for draw.
"""

from __future__ import annotations

import inspect
import weakref
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from transformers import (
    DynamicCache,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    PreTrainedModel,
    StaticCache,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.pytorch_utils import Conv1D

from llm_rlhf.rl.cast_once import is_cast_once, is_whole

# Prepacked float32 linear on CPU: oneDNN's blocked weight layout (what torch.compile's CPU backend uses when
# it freezes weights). Missing from some torch builds: then the weights stay as they are.
CAN_PREPACK = hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(
    torch.ops.mkldnn, "_linear_pointwise"
)


def cpu_vendor() -> str:
    """The CPU's vendor id from /proc/cpuinfo ("AuthenticAMD", "GenuineIntel"); "" where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# Where prepacking is the default (measured with `benchmarks/rollout.py --paths all`): on AMD EPYC, F.linear's MKL
# sgemm (tuned for Intel CPUs) ran a decode step 1.0-2.3x slower than oneDNN's prepacked kernel; on Intel Xeon
# prepacking helped only SmolLM2 at batch 8 and cost 5-40% elsewhere; other CPUs were not measured.
PREPACK_BY_DEFAULT = CAN_PREPACK and cpu_vendor() == "AuthenticAMD"

# sampling_dtype -> the dtype of the decoding copies of the linear layers (None: the weights' own). bfloat16 is
# an opt-in: its logits differ from the policy's, so the tokens come from another distribution than the one
# PPO's log-probs describe; PPO logs the gap per token (objective/kl_sampler).
SAMPLING_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


# sampling_compile: prompts are left-padded to a multiple of this many columns, so that one compiled decode
# step (its static KV cache holds bucket + max_new_tokens positions) serves every batch of prompts up to that
# width. The padding is masked and the positions count real tokens only: the distribution does not change.
PROMPT_BUCKET = 64


def compiled_step(model: nn.Module):
    """`model.forward` through torch.compile for decode steps of fixed shapes (dynamic=False): on CUDA with
    mode "reduce-overhead" (the step replayed as a CUDA graph, which removes the per-kernel launch cost that
    bounds a decode step of a ~100M model on a GPU), elsewhere inductor's default. Made once per model and
    kept on it, so later `sample` calls of the same shapes reuse the compiled code (parameters updated in
    place by the optimiser are read at every replay); a deep copy of the model compiles its own (the step is
    bound to the model it was made for: a copy must not sample with the original's weights). Measured: decode
    steps 5.7x faster on an H100 in `benchmarks/static_cache.py` (4.9x in the sampler with LoRA,
    `benchmarks/rollout.py --paths fast,fast-compiled`), 1.5-1.8x slower on a 2-core AVX-512 CPU: an opt-in."""
    owner, step = vars(model).get("_llm_rlhf_compiled_step", (None, None))
    if owner is None or owner() is not model:  # none yet, or a copy's (deepcopy keeps the weak reference)
        device = next(model.parameters()).device
        mode = "reduce-overhead" if device.type == "cuda" else None
        step = torch.compile(model.forward, dynamic=False, mode=mode)  # bound to this model's forward
        model.__dict__["_llm_rlhf_compiled_step"] = (weakref.ref(model), step)
    return step


def is_lora_layer(module: nn.Module) -> bool:
    """A peft LoRA layer wrapping a linear layer (`peft.tuners.lora.Linear`)."""
    return hasattr(module, "lora_A") and hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")


def linear_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(W, b) with module(x) = x W^T + b, W: (out, in), for nn.Linear and GPT-2's Conv1D (x W' + b, W' = W^T);
    None for any other module."""
    if type(module) not in (nn.Linear, Conv1D) or not is_whole(module.weight):
        return None
    if type(module) is Conv1D:
        return module.weight.t(), module.bias  # Conv1D stores (in, out)
    return module.weight, module.bias


def merged_lora_weight(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(W + sum_a scaling_a * B_a A_a, b) for a LoRA layer whose forward is x W^T + b + sum_a scaling_a *
    (x A_a^T) B_a^T, the sum over its active adapters (peft's `get_delta_weight`, in W's (out, in) layout);
    the base weight W alone while its adapters are disabled. None where the forward is anything else: an
    adapter with a variant (DoRA), a bias on B, dropout that is on, adapters merged into the weights already,
    a base layer that is not a plain linear layer; such a layer keeps its own forward."""
    base = layer.base_layer
    if linear_weight(base) is None or layer.merged:
        return None
    if layer.disable_adapters:
        return linear_weight(base)
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    for a in active:
        dropout = layer.lora_dropout[a]
        if (
            a in getattr(layer, "lora_variant", {})
            or layer.use_dora.get(a, False)
            or layer.lora_B[a].bias is not None
            or (dropout.training and not isinstance(dropout, nn.Identity))
        ):
            return None
    weight = base.weight  # in the base layer's layout, as peft's delta: (in, out) for Conv1D (fan_in_fan_out)
    for a in active:
        weight = weight + layer.get_delta_weight(a).to(weight.dtype)
    return (weight.t() if type(base) is Conv1D else weight), base.bias  # (out, in)


def linear_forward(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    prepack: bool,
    dtype: torch.dtype | None = None,
    autocast_dtype: torch.dtype | None = None,
):
    """x -> x W^T + b, from W prepacked once for oneDNN (CPU float32), from a copy of W and b in `dtype`
    (x cast to it, the output cast back to x's dtype), under autocast from a copy of W and b in autocast's dtype
    made once (what autocast casts a float32 weight to at every call, so the same numbers: autocast casts no
    weight that does not require a gradient once per region, and a decode step is a region's worth of calls),
    or from W as it is."""
    if autocast_dtype is not None:
        low_weight, low_bias = weight.to(autocast_dtype), None if bias is None else bias.to(autocast_dtype)
        return lambda x, *args, **kwargs: nn.functional.linear(x, low_weight, low_bias)
    if dtype is not None and dtype != weight.dtype:
        low_weight, low_bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        return lambda x, *args, **kwargs: nn.functional.linear(x.to(dtype), low_weight, low_bias).to(x.dtype)
    if not prepack:
        return lambda x, *args, **kwargs: nn.functional.linear(x, weight, bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    return lambda x, *args, **kwargs: torch.ops.mkldnn._linear_pointwise(
        x.contiguous(), packed, bias, "none", [], ""
    )


def conv1d_forward(weight: torch.Tensor, bias: torch.Tensor, *, autocast_dtype: torch.dtype):
    """GPT-2's Conv1D forward, x W' + b by addmm with W' (in, out), from copies of W' and b in autocast's dtype
    made once: the layer's own kernel, so the same numbers as autocast casting its weight at every call."""
    weight, bias = weight.to(autocast_dtype), bias.to(autocast_dtype)

    def forward(x, *args, **kwargs):
        out = torch.addmm(bias, x.view(-1, x.size(-1)), weight)
        return out.view(x.size()[:-1] + (weight.shape[1],))

    return forward


@contextmanager
def decoding_weights(
    lm: nn.Module, *, prepack: bool | None = None, merge_lora: bool = True, dtype: torch.dtype | None = None
):
    """Inside the context every linear layer of `lm` (LoRA layers merged) computes x W^T + b from a copy of
    its weight made for decoding (see the module docstring); on exit the layers run their own forwards
    again. The parameters are never written: the policy after sampling is bit for bit the policy before.

    prepack: None = where it was measured to help (`PREPACK_BY_DEFAULT`: an AMD CPU) with float32 weights and
    autocast off. Under autocast (bf16 on a CPU) every linear layer runs from a copy of its (merged) weight in
    autocast's dtype, made once here instead of at every call of every decode step: the same numbers. merge_lora: LoRA layers run from
    W + scaling * B A (one matmul instead of three). dtype (e.g. torch.bfloat16; None = the weights' own):
    every linear layer runs from a copy of its (merged) weight in that dtype, its input cast to it and its
    output cast back (prepacking off): lower-precision sampling, which changes the distribution sampled from
    (the opt-in `sampling_dtype`). Layers that already carry a forward of their own
    (accelerate's hooks) or hold a shard of their weight are left alone. Meant for no-grad decoding: the
    copies are not part of the autograd graph of the parameters.
    """
    params = list(lm.parameters())
    device = params[0].device if params else torch.device("cpu")
    if dtype is not None and all(p.dtype == dtype for p in params):
        dtype = None  # the weights' own dtype: nothing to cast
    autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    if dtype is not None:
        prepack, autocast = False, None  # oneDNN's prepacked kernel is the float32 one; `dtype` decides
    if prepack is None:
        prepack = (
            PREPACK_BY_DEFAULT
            and device.type == "cpu"
            and all(p.dtype == torch.float32 for p in params)
            and not torch.is_autocast_enabled("cpu")
        )
    replaced = []  # (module, the forward it carried before: `frozen_weights_cast_once`'s, or None)
    skip = set()
    with torch.no_grad():
        for module in lm.modules():
            if ("forward" in vars(module) and not is_cast_once(module)) or id(module) in skip:
                continue
            before = vars(module).get("forward")
            if is_lora_layer(module):
                weight_bias = merged_lora_weight(module) if merge_lora else None
                # the adapters' own small linear layers stay as they are; the base layer too if merged (unused)
                inner = [module.lora_A, module.lora_B] + (
                    [module.base_layer] if weight_bias is not None else []
                )
                skip.update(id(m) for part in inner for m in part.modules())
            elif type(module) is Conv1D and autocast and not prepack and dtype is None:
                if is_whole(module.weight):  # GPT-2's layer as it computes itself (addmm), from copies
                    module.forward = conv1d_forward(module.weight, module.bias, autocast_dtype=autocast)
                    replaced.append((module, before))
                continue
            else:
                weight_bias = linear_weight(module) if prepack or dtype or autocast else None
            if weight_bias is None:
                continue
            module.forward = linear_forward(
                *weight_bias, prepack=prepack, dtype=dtype, autocast_dtype=autocast
            )
            replaced.append((module, before))
    try:
        yield
    finally:
        for module, before in replaced:
            del module.forward  # the class's forward again, or the one it carried
            if before is not None:
                module.forward = before


def draw_tokens(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of probs (B, V) (rows sum to 1 up to rounding, zeros allowed), by inverse CDF:

        c_i = (p_0 + ... + p_i) / (p_0 + ... + p_{V-1})    (float64; c_{V-1} = 1 exactly)
        u ~ U[0, 1),  token = the first i with u < c_i        =>  P(token = i) = c_i - c_{i-1} = p_i / sum(p)

    exactly the categorical distribution that `torch.multinomial(probs, 1)` samples (a token of probability
    0 is never drawn), from B uniforms instead of the B * V exponentials of multinomial's exponential race,
    which cost more than the matmuls of a decode step of a 4M-weight model and a quarter of SmolLM2's at
    batch 32 (`benchmarks/rollout.py`). The uniforms come from the default generator of probs' device.
    Returns (B,) long."""
    cdf = probs.double().cumsum(-1)  # (B, V)
    cdf = cdf / cdf[:, -1:]  # (B, V): x / x = 1 exactly in the last column, so some c_i > u for every u < 1
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device)  # (B, 1)
    return torch.searchsorted(cdf, u, right=True).squeeze(1)  # (B,): first i with c_i > u


def logits_processors(
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    min_new_tokens: int,
    prompt_length: int,
    eos_token_id: int,
    device=None,
) -> LogitsProcessorList:
    """transformers' own processors, in the order `generate` applies them (min_new_tokens, then temperature,
    top_k, top_p), each only where `generate` would add it, so `decode` reshapes the logits as `generate` did
    with `Sampling.generate_kwargs`. Greedy (temperature 0): min_new_tokens only, as `generate` without
    sampling."""
    out = LogitsProcessorList()
    if min_new_tokens > 0:
        out.append(
            MinNewTokensLengthLogitsProcessor(prompt_length, min_new_tokens, eos_token_id, device=device)
        )
    if temperature == 0:
        return out
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k != 0:
        out.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return out


def supports(lm) -> bool:
    """Whether `decode` can run `lm`: a transformers causal LM (or a peft model around one) whose forward takes
    position ids and a KV cache. Anything else samples through its own `generate`."""
    inner = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    if not isinstance(inner, PreTrainedModel) or inner.config.is_encoder_decoder:
        return False
    params = inspect.signature(inner.forward).parameters
    return "position_ids" in params and ("cache" in params or "past_key_values" in params)


def steps_on_every_process(lm) -> bool:
    """Whether sampling from `lm` must run the same number of forwards on every process: its parameters are
    DeepSpeed ZeRO-3 partitions (they carry `ds_id`) and there are several processes. A forward then gathers
    them (a collective), even inside `GatheredParameters` once the model is over ZeRO-3's live-parameter or
    reuse budgets: a process that stopped early would leave the others waiting forever. What
    transformers' `generate` calls `synced_gpus`. False on one process, so its draws are unchanged."""
    import torch.distributed as dist  # here: torch.distributed is missing from some builds

    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return several and any(hasattr(p, "ds_id") for p in lm.parameters())


@torch.no_grad()
def decode(
    lm,
    query: torch.Tensor,
    query_mask: torch.Tensor,
    sampling,
    *,
    eos_token_id: int,
    pad_token_id: int,
    stopping_criteria=(),
    token_logprobs: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """`generate`'s sampling loop on left-padded queries (B, P), step for step, as `sampling` (a
    `rollout.Sampling`) says: the prefill over the query with positions counting real tokens only, then one
    token per step with the KV cache, the attention mask grown by a column of ones and the position by one;
    logits of the last position in float32 -> transformers' processors (`logits_processors`) -> softmax ->
    draw (B,) tokens with this module's `draw_tokens`, looked up at each call so that a test or benchmark can
    put another draw in its place (greedy at temperature 0: the argmax of the processed logits, no random
    number); rows that ended get pad_token_id; a row ends at EOS or where a stopping criterion says so, and
    the loop ends when every row has ended or after sampling.max_new_tokens tokens.
    With `draw_tokens` = `torch.multinomial(probs, 1)[:, 0]` it returns what `generate` returns from the same random
    numbers (`tests/rl/test_sampling.py`). token_logprobs: a list that gets, per step t, the (B,) log-probability of
    each row's drawn token under the distribution it was drawn from, log of softmax(processed logits)[token]
    (0 for rows that had ended; nothing when greedy): the sampler's log q(y_t), which a lower-precision
    sampler makes differ from the policy's log-probs. sampling.sampling_compile: the prefill as before, then every decode
    step through `compiled_step` with a `StaticCache` of W + max_new_tokens positions and an attention mask of
    that fixed width (zeros ahead of the current token), the queries left-padded to W = P rounded up to
    `PROMPT_BUCKET` (masked: the same positions and distribution; the logits differ from the dynamic cache's
    by float rounding only, `benchmarks/static_cache.py`). Where `steps_on_every_process(lm)` (ZeRO-3 on
    several processes), the loop is synced: it ends when every row of EVERY
    process has ended (one all-reduce per step, `unfinished_anywhere`), a process whose rows all ended
    stepping on with padding, so that every process runs the same number of forwards where a forward is a
    collective (ZeRO-3's parameter gathers), as transformers' `generate` does with `synced_gpus`;
    the draws of rows that have not ended are those of the unsynced loop. Returns sequences (B, P + R),
    R <= max_new_tokens."""
    logits_processor = logits_processors(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        min_new_tokens=sampling.min_new_tokens,
        prompt_length=query.shape[1],
        eos_token_id=eos_token_id,
        device=query.device,
    )
    max_new_tokens = sampling.max_new_tokens
    compile_steps = sampling.sampling_compile
    synced = steps_on_every_process(lm)  # before any decoding copy: the parameters themselves carry ds_id
    draw = None if sampling.temperature == 0 else draw_tokens  # greedy: the argmax, no random number
    inner = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
    params = inspect.signature(inner.forward).parameters
    cache_key = "cache" if "cache" in params else "past_key_values"  # transformers >= 5.2x names it `cache`
    keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}  # the LM head at the last position
    B, P = query.shape
    pad = (-P % PROMPT_BUCKET) if compile_steps else 0  # left padding added for the compiled step's bucket
    query, sequences, mask, positions = decode_buffers(
        query, query_mask, pad=pad, max_new_tokens=max_new_tokens, pad_token_id=pad_token_id
    )
    W = P + pad
    unfinished = torch.ones(B, dtype=torch.bool, device=query.device)  # (B,)
    if compile_steps:  # fixed shapes: a static cache and the whole mask; the prefill eager (its width varies)
        cache = StaticCache(config=inner.config, max_cache_len=W + max_new_tokens)
        step = compiled_step(inner)
    else:  # the cache and the mask grow by a column per token, as in generate
        cache = DynamicCache(config=inner.config)
    kwargs = {cache_key: cache, "use_cache": True, **keep}
    inputs = query
    for t in range(max_new_tokens):
        forward = step if compile_steps and t > 0 else lm
        attention = mask if compile_steps else mask[:, : W + t]  # (B, W + max_new_tokens) or (B, W + t)
        out = forward(input_ids=inputs, attention_mask=attention, position_ids=positions, **kwargs)
        logits = out.logits[:, -1].to(dtype=torch.float32, copy=True)  # (B, V): the next token's logits
        scores = logits_processor(sequences[:, : P + t], logits)  # (B, V)
        token = next_token(scores, draw, unfinished, token_logprobs)  # (B,)
        token = torch.where(unfinished, token, pad_token_id)  # (B,): padding after a row's end
        sequences[:, P + t] = token
        unfinished &= token != eos_token_id
        for criterion in stopping_criteria:
            unfinished &= ~criterion(sequences[:, : P + t + 1], scores)
        if not (unfinished_anywhere(unfinished) if synced else unfinished.any()):
            return sequences[:, : P + t + 1]
        inputs = token[:, None]  # (B, 1)
        mask[:, W + t] = 1  # the new token's column
        positions = positions[:, -1:] + 1  # (B, 1): the new token's position
    return sequences


def decode_buffers(
    query: torch.Tensor, query_mask: torch.Tensor, *, pad: int, max_new_tokens: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`decode`'s buffers for queries (B, P) left-padded by `pad` more columns (the compiled step's bucket,
    W = P + pad): the query (B, W); the sequences (B, P + max_new_tokens), a view of one (B, W +
    max_new_tokens) buffer that the drawn tokens fill (what the processors, criteria and caller see); the
    attention mask (B, W + max_new_tokens), the query's then a column of ones per token drawn (zeros ahead of
    the current token); the prefill's positions (B, W), real tokens counted."""
    B, P = query.shape
    if pad:
        query = torch.cat([query.new_full((B, pad), pad_token_id), query], dim=1)  # (B, W), W = P + pad
        query_mask = torch.cat([query_mask.new_zeros(B, pad), query_mask], dim=1)  # (B, W)
    W = P + pad
    padded = torch.full((B, W + max_new_tokens), pad_token_id, dtype=query.dtype, device=query.device)
    padded[:, :W] = query  # (B, W + max_new_tokens)
    mask = query_mask.new_zeros(B, W + max_new_tokens, dtype=torch.long)  # (B, W + max_new_tokens)
    mask[:, :W] = query_mask
    positions = (mask[:, :W].cumsum(-1) - 1).masked_fill(mask[:, :W] == 0, 0)  # (B, W)
    return query, padded[:, pad:], mask, positions


def next_token(
    scores: torch.Tensor, draw, unfinished: torch.Tensor, token_logprobs: list[torch.Tensor] | None
) -> torch.Tensor:
    """The (B,) tokens of one decode step from the processed logits `scores` (B, V): the argmax when `draw` is
    None (greedy), else `draw`(softmax(scores)); with token_logprobs, appends each row's log q(y_t), the
    log of the probability it was drawn with (each > 0; 0 for rows that had ended)."""
    if draw is None:
        return scores.argmax(-1)  # (B,)
    probs = torch.softmax(scores, dim=-1)  # (B, V)
    token = draw(probs)  # (B,)
    if token_logprobs is not None:
        token_logprobs.append(torch.where(unfinished, probs.gather(-1, token[:, None])[:, 0].log(), 0.0))
    return token


def unfinished_anywhere(unfinished: torch.Tensor) -> bool:
    """Whether a row of any process has not ended: `unfinished` (B,) bool of this process, max over the
    processes (an all-reduce every process enters)."""
    import torch.distributed as dist  # here: torch.distributed is missing from some builds

    flag = unfinished.any().to(torch.int32)  # (): 1 while a row of this process has not ended
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag)


def generate(
    lm,
    query: torch.Tensor,
    query_mask: torch.Tensor,
    sampling,
    *,
    eos_token_id: int,
    pad_token_id: int,
    stopping_criteria=(),
    token_logprobs: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Sequences (B, P + R) drawn as `sampling` (a `rollout.Sampling`) says: from softmax(logits / temperature)
    (top-k/top-p if asked, EOS masked before min_new_tokens), or greedy at temperature 0: `decode` inside
    `decoding_weights`, its linear layers in `sampling.sampling_dtype` (`SAMPLING_DTYPES`); with
    `sampling.sampling_compile`, `decode`'s compiled steps on the model's own layers instead (new decoding
    copies at every call would make every call compile anew). What `rollout.sample` runs when
    `supports(lm)`; nothing of the checkpoint's generation_config is read. token_logprobs: as
    `decode`'s."""
    weights = (
        nullcontext()
        if sampling.sampling_compile
        else decoding_weights(lm, dtype=SAMPLING_DTYPES[sampling.sampling_dtype])
    )
    with weights:
        return decode(
            lm,
            query,
            query_mask,
            sampling,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            stopping_criteria=stopping_criteria,
            token_logprobs=token_logprobs,
        )
