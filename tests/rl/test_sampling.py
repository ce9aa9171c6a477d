"""The sampled tokens come from exactly softmax(logits / temperature), the distribution whose log-probs
PPO uses: a checkpoint's generation_config.json (repetition_penalty, top_k, min_new_tokens, ...) and
transformers' own defaults (top_k=50) must not reshape it. Checked draw for draw against a naive loop
that samples from the plain softmax with the same random numbers, on every path `rollout.sample` takes:
`generate` (torch.multinomial), and the fast path (`fast_sampling`: its own decode loop,
inverse-CDF draws, LoRA merged and weights prepacked for decoding; or, with sampling_compile, its decode steps
compiled with a static KV cache)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from helpers import multinomial_draw, naive_inverse_cdf_draw, naive_sample, with_lora
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from llm_rlhf.rl import fast_sampling
from llm_rlhf.rl.rollout import Sampling, StopStringsCriteria, generation_config_hidden, left_pad, sample
from llm_rlhf.stages.sft import sample_responses

HOSTILE = dict(
    repetition_penalty=3.0,
    no_repeat_ngram_size=1,
    top_k=3,
    top_p=0.3,
    min_p=0.2,
    typical_p=0.5,
    min_new_tokens=4,
    temperature=0.05,
    do_sample=False,
)


def load(folder, lora: bool):
    lm = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = tokenizer.eos_token
    return (with_lora(lm) if lora else lm), tokenizer


@pytest.mark.parametrize("path", ["generate", "fast", "fast-prepacked", "fast-compiled"])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama-lora"])
def test_sample_draws_from_the_plain_softmax(kind, path, tiny_model_dir, tiny_llama_dir, monkeypatch):
    """path: `generate`; the fast path with the weights as they are (the default on Intel CPUs); the fast path
    with prepacked weights (the default on AMD CPUs), whatever CPU runs the test; the fast path with its decode
    steps compiled (sampling_compile)."""
    folder = tiny_model_dir if kind == "gpt2" else tiny_llama_dir
    lm, tokenizer = load(folder, lora=kind.endswith("lora"))
    inner = lm.get_base_model() if kind.endswith("lora") else lm
    inner.generation_config = GenerationConfig(**HOSTILE, eos_token_id=tokenizer.eos_token_id)
    saved = inner.generation_config.to_dict()
    params = {name: p.clone() for name, p in lm.state_dict().items()}
    if path == "generate":
        monkeypatch.setattr(fast_sampling, "supports", lambda lm: False)
    monkeypatch.setattr(
        fast_sampling, "PREPACK_BY_DEFAULT", path == "fast-prepacked" and fast_sampling.CAN_PREPACK
    )
    ids = tokenizer("The film is").input_ids
    query, query_mask = left_pad([ids] * 64, tokenizer.pad_token_id)  # (64, P): no padding, same prompt

    torch.manual_seed(123)
    sampling = Sampling(
        max_new_tokens=8, temperature=0.9, top_k=0, top_p=1.0, sampling_compile=path == "fast-compiled"
    )
    got = sample(lm, tokenizer, query, query_mask, sampling)
    torch.manual_seed(123)
    with torch.no_grad():
        expected = naive_sample(
            lm,
            query,
            steps=8,
            temperature=0.9,
            eos=tokenizer.eos_token_id,
            pad=tokenizer.pad_token_id,
            draw=multinomial_draw if path == "generate" else naive_inverse_cdf_draw,
        )
    assert torch.equal(got.response[:, : expected.shape[1]], expected)
    # the test has teeth: the hostile settings would have given other tokens, and top_k=50 too
    assert len(set(got.response[:, 0].tolist())) > 3  # top_k=3 / greedy would allow at most 3
    assert inner.generation_config.to_dict() == saved  # put back after sampling
    assert all(torch.equal(p, params[name]) for name, p in lm.state_dict().items())  # weights untouched
    assert not any("forward" in vars(m) for m in lm.modules())  # every layer runs its own forward again

    if kind != "gpt2" or path != "fast":
        return
    # the SFT stage's end-of-training samples use the same settings (through the same sampler)
    torch.manual_seed(123)
    rows = sample_responses(lm, tokenizer, ["The film is"] * 64, sampling, batch_size=64)
    eos = tokenizer.eos_token_id
    for row, tokens in zip(rows, expected.tolist()):
        n = tokens.index(eos) if eos in tokens else len(tokens)
        assert row["num_tokens"] == n and row["response"] == tokenizer.decode(
            tokens[:n], skip_special_tokens=True
        )


SETTINGS = {
    "plain": dict(temperature=0.9, top_k=0, top_p=1.0, min_new_tokens=0),
    "min_new_tokens": dict(temperature=1.0, top_k=0, top_p=1.0, min_new_tokens=3),
    "top_k_top_p": dict(temperature=0.7, top_k=5, top_p=0.8, min_new_tokens=2),
    "greedy": dict(temperature=0, top_k=0, top_p=1.0, min_new_tokens=2),  # ReMax's baseline response
}


@pytest.mark.parametrize("stops", [(), ("e", "a", "o", "i", "t", "n", "s", " ")], ids=["no-stop", "stops"])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_decode_is_generate_step_for_step(kind, setting, stops, tiny_model_dir, tiny_llama_dir, monkeypatch):
    """`fast_sampling.decode` with generate's draw (torch.multinomial) returns exactly what `generate` returns
    from the same random numbers: the same positions, masks, cache, logits processing (min_new_tokens,
    temperature, top-k, top-p), padding after a row's end, stopping criteria, and early end of the loop."""
    lm, tokenizer = load(tiny_model_dir if kind == "gpt2" else tiny_llama_dir, lora=False)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids = [tokenizer(p).input_ids for p in ["The film is", "A", "It was a great and", "Bad"] * 8]
    query, query_mask = left_pad(ids, pad)  # (32, P): left padding of several widths
    s = SETTINGS[setting]

    def criteria():
        kw = dict(prompt_length=query.shape[1], min_new_tokens=s["min_new_tokens"])
        return [StopStringsCriteria(tokenizer, stops, **kw)] if stops else []

    torch.manual_seed(5)
    with generation_config_hidden(lm):
        expected = lm.generate(
            input_ids=query,
            attention_mask=query_mask,
            max_new_tokens=16,
            eos_token_id=eos,
            pad_token_id=pad,
            **Sampling(
                16, temperature=s["temperature"], top_k=s["top_k"], top_p=s["top_p"]
            ).generate_kwargs(),
            **({"min_new_tokens": s["min_new_tokens"]} if s["min_new_tokens"] else {}),
            stopping_criteria=criteria(),
            use_cache=True,
        )
    torch.manual_seed(5)
    monkeypatch.setattr(fast_sampling, "draw_tokens", multinomial_draw)
    got = fast_sampling.decode(
        lm,
        query,
        query_mask,
        Sampling(16, **s),
        eos_token_id=eos,
        pad_token_id=pad,
        stopping_criteria=criteria(),
    )
    assert torch.equal(got, expected)
    if stops and setting == "plain":
        assert got.shape[1] < query.shape[1] + 16  # every row ended early: the loop's early end is covered


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_compiled_decode_is_generate_step_for_step(kind, tiny_model_dir, tiny_llama_dir, monkeypatch):
    """compile_steps: the prompts left-padded to the bucket, a static KV cache and the compiled step give what
    `generate` gives from the same random numbers, with left padding of several widths, EOS masked before
    min_new_tokens (the processor counts the real prompt width) and stop strings (read past the prompt), and
    the prompt's padding is gone from what is returned."""
    lm, tokenizer = load(tiny_model_dir if kind == "gpt2" else tiny_llama_dir, lora=False)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids = [tokenizer(p).input_ids for p in ["The film is", "A", "It was a great and", "Bad"] * 8]
    query, query_mask = left_pad(ids, pad)  # (32, P), P < PROMPT_BUCKET
    stops = ("e", "a", "o", "i", "t", "n", "s", " ")
    s = SETTINGS["min_new_tokens"]

    def criteria():
        return [StopStringsCriteria(tokenizer, stops, prompt_length=query.shape[1], min_new_tokens=3)]

    torch.manual_seed(5)
    with generation_config_hidden(lm):
        expected = lm.generate(
            input_ids=query,
            attention_mask=query_mask,
            max_new_tokens=16,
            eos_token_id=eos,
            pad_token_id=pad,
            **Sampling(16, temperature=1.0).generate_kwargs(),
            min_new_tokens=3,
            stopping_criteria=criteria(),
            use_cache=True,
        )
    torch.manual_seed(5)
    monkeypatch.setattr(fast_sampling, "draw_tokens", multinomial_draw)
    got = fast_sampling.decode(
        lm,
        query,
        query_mask,
        Sampling(16, **s, sampling_compile=True),
        eos_token_id=eos,
        pad_token_id=pad,
        stopping_criteria=criteria(),
    )
    assert query.shape[1] % fast_sampling.PROMPT_BUCKET != 0  # the bucket's padding was added and removed
    assert torch.equal(got, expected)


def test_compiled_sampling_compiles_once_per_batch_shape(tiny_llama_dir):
    """sampling_compile: the compiled step is made once and kept with the model, and calls with other prompt
    widths in the same bucket and other seeds reuse its one graph (no compilation per call or per width)."""
    from torch._dynamo.utils import counters

    lm, tokenizer = load(tiny_llama_dir, lora=True)
    inner = lm.get_base_model()
    graphs, responses = [], []  # graphs compiled so far in this process, after each call
    calls = [["The film is", "A"], ["It was a great and fine film", "Bad"], ["A b"] * 2]
    for seed, prompts in enumerate(calls):
        query, query_mask = left_pad([tokenizer(p).input_ids for p in prompts], tokenizer.pad_token_id)
        torch.manual_seed(seed)
        sampling = Sampling(6, sampling_compile=True)
        responses.append(sample(lm, tokenizer, query, query_mask, sampling).response)
        graphs.append(counters["stats"]["unique_graphs"])
        assert query.shape[1] < fast_sampling.PROMPT_BUCKET
    # the first call compiles (or reuses what an earlier test compiled for this model shape); none after it
    assert graphs[0] > 0 and graphs[1] == graphs[0] and graphs[2] == graphs[0]
    assert fast_sampling.compiled_step(inner) is fast_sampling.compiled_step(inner)
    assert not torch.equal(responses[0], responses[1])  # the calls did sample


def test_a_copy_of_a_model_samples_with_its_own_weights_after_compiling(tiny_model_dir):
    """The compiled step is bound to the model it was made for; a deep copy made afterwards (PPO's reference
    is one) compiles its own, so with other weights it samples its own distribution, not the original's."""
    import copy

    lm, tokenizer = load(tiny_model_dir, lora=False)
    query, query_mask = left_pad([tokenizer("The film is").input_ids] * 8, tokenizer.pad_token_id)
    sample(lm, tokenizer, query, query_mask, Sampling(4, sampling_compile=True))  # the original compiles
    twin = copy.deepcopy(lm)
    with torch.no_grad():
        twin.lm_head.weight.mul_(-1.0)  # (tied with the embedding) another distribution
    assert fast_sampling.compiled_step(twin) is not fast_sampling.compiled_step(lm)
    draws = {}
    for compiled in (True, False):
        torch.manual_seed(3)
        draws[compiled] = sample(twin, tokenizer, query, query_mask, Sampling(6, sampling_compile=compiled))
    assert torch.equal(draws[True].response, draws[False].response)
    torch.manual_seed(3)
    original = sample(lm, tokenizer, query, query_mask, Sampling(6, sampling_compile=True))
    assert not torch.equal(original.response, draws[True].response)


def test_draw_tokens_samples_the_categorical_distribution():
    """Inverse-CDF draws: the frequencies of 400,000 draws match the probabilities (within 5 standard
    errors), tokens of probability 0 never come, and draw_tokens agrees with the naive walk draw for draw."""
    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.125, 0.0625, 0.0625, 0.0])  # zeros first, inside and last
    n = 400_000
    torch.manual_seed(0)
    tokens = fast_sampling.draw_tokens(probs.expand(n, -1))  # (n,)
    freq = torch.bincount(tokens, minlength=len(probs)).double() / n
    stderr = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert torch.all((freq - probs.double()).abs() <= 5 * stderr + 1e-12), freq
    assert torch.all(freq[probs == 0] == 0)
    logits = torch.randn(16, 50) * 3  # (16, 50): peaked and flat rows
    logits[:, ::7] = -torch.inf  # masked tokens, as top-k / min_new_tokens make them
    p = torch.softmax(logits, dim=-1)
    torch.manual_seed(1)
    fast = fast_sampling.draw_tokens(p)
    torch.manual_seed(1)
    assert torch.equal(fast, naive_inverse_cdf_draw(p))


@pytest.mark.parametrize("prepack", [True, False], ids=["prepacked", "unpacked"])
@pytest.mark.parametrize("kind", ["gpt2", "llama", "gpt2-lora", "llama-lora", "llama-lora-off"])
def test_decoding_weights_compute_the_same_layers_and_restore_them_bit_for_bit(
    kind, prepack, tiny_model_dir, tiny_llama_dir
):
    """Inside `decoding_weights` the model computes the same logits up to float rounding (LoRA merged, weights
    prepacked on CPU if asked); after it, bit for bit the same parameters and the same outputs as before, and
    LoRA layers unmerged (peft's merge/unmerge round trip is not exact in floats; nothing is merged here).
    kind "-off": inside the adapter's `disable_adapter()`, as the reference runs."""
    if prepack and not fast_sampling.CAN_PREPACK:
        pytest.skip("this torch build has no oneDNN prepacked linear")
    lm, _ = load(tiny_model_dir if kind.startswith("gpt2") else tiny_llama_dir, lora="lora" in kind)
    x = torch.randint(0, 300, (4, 9))
    before = {name: p.clone() for name, p in lm.state_dict().items()}
    adapter_off = lm.disable_adapter if kind.endswith("off") else nullcontext
    with torch.no_grad():
        policy = lm(x).logits
        with adapter_off():
            reference = lm(x).logits
            with fast_sampling.decoding_weights(lm, prepack=prepack):
                inside = lm(x).logits
                replaced = [m for m in lm.modules() if "forward" in vars(m)]
            assert torch.equal(lm(x).logits, reference)
        assert torch.equal(lm(x).logits, policy)
    if kind.endswith("off"):
        assert not torch.allclose(policy, reference, atol=1e-3)  # the adapter matters: the test has teeth
    torch.testing.assert_close(inside, reference, atol=1e-5, rtol=1e-5)
    lora_layers = (2 if kind.startswith("gpt2") else 4) if "lora" in kind else 0  # c_attn / q_proj, v_proj
    every_linear = 2 * 4 + 1 if kind.startswith("gpt2") else 2 * 7 + 1  # the LM head too
    assert len(replaced) == (every_linear if prepack else lora_layers)
    assert all(torch.equal(p, before[name]) for name, p in lm.state_dict().items())
    assert not any("forward" in vars(m) for m in lm.modules())
    assert not any(getattr(m, "merged", False) for m in lm.modules())


@pytest.mark.parametrize("kind", ["gpt2-lora", "llama-lora", "llama"])
def test_decoding_weights_under_autocast_compute_what_autocast_computes_bit_for_bit(
    kind, tiny_model_dir, tiny_llama_dir
):
    """Under bf16 autocast (`bf16: auto` on an AMX or AVX512-BF16 CPU) every linear layer, the LM head too, runs
    from a bfloat16 copy of its (merged) weight made once when the context is entered instead of autocast's
    cast at every call: the logits are exactly those of the same layers (LoRA merged) whose float32 weights
    autocast casts at every call, and the parameters are untouched."""
    lm, _ = load(tiny_model_dir if kind.startswith("gpt2") else tiny_llama_dir, lora="lora" in kind)
    x = torch.randint(0, 300, (4, 9))
    before = {name: p.clone() for name, p in lm.state_dict().items()}

    def per_call(weight, bias, **kwargs):  # the layer from its float32 weight: autocast casts it at each call
        return lambda x, *args, **kw: torch.nn.functional.linear(x, weight, bias)

    def conv1d_per_call(weight, bias, **kwargs):
        return lambda x, *args, **kw: torch.addmm(bias, x.view(-1, x.size(-1)), weight).view(
            x.size()[:-1] + (weight.shape[1],)
        )

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fast_sampling, "linear_forward", per_call)
            patch.setattr(fast_sampling, "conv1d_forward", conv1d_per_call)
            with fast_sampling.decoding_weights(lm):
                cast_per_call = lm(x).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with fast_sampling.decoding_weights(lm):
                copied_once = lm(x).logits
                replaced = [m for m in lm.modules() if "forward" in vars(m)]
                low = [
                    w
                    for m in replaced
                    for w in m.forward.__closure__ or ()
                    if torch.is_tensor(w.cell_contents)
                ]
    assert torch.equal(copied_once, cast_per_call)
    every_linear = 2 * 4 + 1 if kind.startswith("gpt2") else 2 * 7 + 1  # the LM head too
    assert len(replaced) == every_linear
    assert low and all(w.cell_contents.dtype == torch.bfloat16 for w in low)
    assert all(torch.equal(p, before[name]) for name, p in lm.state_dict().items())
    assert not any("forward" in vars(m) for m in lm.modules())


# --- lower-precision sampling, the opt-in --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpt2-lora", "llama-lora"])
def test_bfloat16_decoding_weights_compute_every_linear_in_bfloat16_and_restore_them(
    kind, tiny_model_dir, tiny_llama_dir
):
    """dtype=bfloat16: every linear layer (LoRA layers merged, the LM head too) runs from a bfloat16 copy of
    its weight, so the logits move by bfloat16 rounding (more than float32's, less than the adapter's effect);
    on exit the parameters and outputs are bit for bit the ones before."""
    lm, _ = load(tiny_model_dir if kind.startswith("gpt2") else tiny_llama_dir, lora=True)
    x = torch.randint(0, 300, (4, 9))
    before = {name: p.clone() for name, p in lm.state_dict().items()}
    with torch.no_grad():
        policy = lm(x).logits
        with fast_sampling.decoding_weights(lm, dtype=torch.bfloat16):
            inside = lm(x).logits
            replaced = [m for m in lm.modules() if "forward" in vars(m)]
        assert torch.equal(lm(x).logits, policy)
        with lm.disable_adapter():
            reference = lm(x).logits
    every_linear = 2 * 4 + 1 if kind.startswith("gpt2") else 2 * 7 + 1  # the LM head too
    assert len(replaced) == every_linear and inside.dtype == torch.float32
    gap = (inside - policy).abs().max()
    assert 1e-4 < gap < 0.1 * (policy - reference).abs().max()  # bfloat16's rounding, not the adapter's size
    assert all(torch.equal(p, before[name]) for name, p in lm.state_dict().items())
    assert not any("forward" in vars(m) for m in lm.modules())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampler_logprobs_are_the_log_probs_the_tokens_were_drawn_with(dtype, tiny_llama_dir):
    """`Samples.sampler_logprobs`: log q(y_t) of every drawn token (0 at padding). In float32 q is the policy's
    distribution (the PPO forward's log-probs agree to float rounding); in bfloat16 the draws are those of the
    bfloat16 model's softmax (a naive loop inside the same bfloat16 weights, draw for draw), and its log-probs
    differ from the float32 policy's by more than rounding."""
    from llm_rlhf.models.loading import Reference
    from llm_rlhf.rl.rollout import response_logprobs_and_values

    lm, tokenizer = load(tiny_llama_dir, lora=True)
    ids = [tokenizer(p).input_ids for p in ["The film is", "A", "It was a great and", "Bad"] * 8]
    query, query_mask = left_pad(ids, tokenizer.pad_token_id)  # (32, P)
    sampling = Sampling(max_new_tokens=8, temperature=0.9, min_new_tokens=2, sampling_dtype=dtype)
    torch.manual_seed(11)
    got = sample(lm, tokenizer, query, query_mask, sampling)
    assert got.sampler_logprobs.shape == got.response.shape
    assert torch.all(got.sampler_logprobs[~got.response_mask] == 0)
    assert torch.all(got.sampler_logprobs[got.response_mask] < 0)
    with torch.no_grad():
        logprobs, _, _ = response_logprobs_and_values(
            Reference(lm), got, sampling, eos_token_id=tokenizer.eos_token_id, entropy="none"
        )
    gap = (got.sampler_logprobs - logprobs)[got.response_mask].abs().max()
    if dtype == "float32":
        assert gap < 1e-4
        return
    assert gap > 1e-3
    one = [tokenizer("The film is").input_ids] * 64  # unpadded: the naive loop's input
    q, qm = left_pad(one, tokenizer.pad_token_id)
    torch.manual_seed(5)
    fast = sample(lm, tokenizer, q, qm, Sampling(max_new_tokens=8, temperature=0.9, sampling_dtype=dtype))
    torch.manual_seed(5)
    with fast_sampling.decoding_weights(lm, dtype=torch.bfloat16):
        expected = naive_sample(
            lm, q, steps=8, temperature=0.9, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id
        )
    assert torch.equal(fast.response[:, : expected.shape[1]], expected)


def test_bfloat16_sampling_needs_the_fast_sampler(tiny_model_dir, monkeypatch):
    from llm_rlhf.core.errors import ConfigError, UserError
    from llm_rlhf.ppo import trainer as ppo_trainer
    from llm_rlhf.stages import evaluate

    lm, tokenizer = load(tiny_model_dir, lora=False)
    monkeypatch.setattr(fast_sampling, "supports", lambda lm: False)
    query, query_mask = left_pad([tokenizer("The film is").input_ids], tokenizer.pad_token_id)
    with pytest.raises(UserError, match="^sampling_dtype bfloat16: lower-precision sampling needs the fast"):
        sample(lm, tokenizer, query, query_mask, Sampling(max_new_tokens=4, sampling_dtype="bfloat16"))
    with pytest.raises(UserError, match="^sampling_compile: compiled decode steps need the fast sampler"):
        sample(lm, tokenizer, query, query_mask, Sampling(max_new_tokens=4, sampling_compile=True))
    for config in (ppo_trainer.Config, evaluate.Config):
        with pytest.raises(ConfigError, match="sampling_dtype': must be one of float32, bfloat16"):
            config(sampling_dtype="float16")
        with pytest.raises(ConfigError, match="sampling_compile': compiles the model's own float32 layers"):
            config(sampling_compile=True, sampling_dtype="bfloat16")


def test_evaluation_samples_both_models_in_the_sampling_dtype(
    tiny_model_dir, prompt_file, tmp_path, monkeypatch
):
    """llm-rlhf eval's sampling_dtype reaches the sampler: every sampling call of the policy and the baseline
    runs inside decoding_weights with that dtype (float32: the weights' own, None)."""
    from helpers import eval_config

    from llm_rlhf.stages import evaluate

    seen, real = [], fast_sampling.decoding_weights

    def recording(lm, **kw):
        seen.append(kw.get("dtype"))
        return real(lm, **kw)

    monkeypatch.setattr(fast_sampling, "decoding_weights", recording)
    for dtype, expected in [("bfloat16", torch.bfloat16), ("float32", None)]:
        seen.clear()
        out = tmp_path / dtype
        evaluate.run(eval_config(tiny_model_dir, tiny_model_dir, prompt_file, out, sampling_dtype=dtype))
        assert (out / "metrics.json").is_file()
        assert len(seen) >= 2 * 3 and set(seen) == {expected}  # 12 prompts in batches of 5, two models


def test_evaluation_samples_both_models_with_compiled_steps(
    tiny_model_dir, prompt_file, tmp_path, monkeypatch
):
    """llm-rlhf eval's sampling_compile reaches the sampler: every sampling call of the policy and the baseline
    runs compiled steps, and the evaluation completes."""
    from helpers import eval_config

    from llm_rlhf.stages import evaluate

    compiled_for, real = [], fast_sampling.compiled_step

    def recording(model):
        compiled_for.append(id(model))
        return real(model)

    monkeypatch.setattr(fast_sampling, "compiled_step", recording)
    out = tmp_path / "eval"
    evaluate.run(eval_config(tiny_model_dir, tiny_model_dir, prompt_file, out, sampling_compile=True))
    assert (out / "metrics.json").is_file()
    assert len(compiled_for) >= 2 * 3  # 12 prompts in batches of 5, two models
