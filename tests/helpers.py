"""What the tests share, imported one way: `from helpers import ...` (pytest puts tests/ on the path, as for
`conftest.py`; no test module imports another).

    paths             ROOT (the repository), FIXTURES (tests/fixtures), SCRIPTS (tests/scripts), REWARD_FNS
                      (tests/reward_fns.py as a path)
    tiny models       SENTENCES, train_tokenizer / build_tokenizer (a byte-level BPE trained in-process),
                      build_model (a tiny GPT-2 or Llama saved as an HF folder), bos_model_dir (a Llama whose
                      tokenizer adds BOS), eos_prone_model, perturbed_member (a reward model with a head of
                      its own), naive_sample (the sampling loop `rollout.sample` must equal)
    chat prompts      TAGGED_CHAT_TEMPLATE, COLON_CHAT_TEMPLATE, CHATS / RENDERED, STOP_STRINGS, smollm2_chat,
                      tiny_chat_model, with_chat_template, naive_end (where a stop string ends a response)
    scoring           eos_rows (stopped, truncated and finished responses as `Samples`), scores_alone
    files             write_jsonl, read_jsonl, logged (a run's metrics.jsonl), preference_rows, flags (a dict
                      as command-line flags), load_script (a script of data/ or benchmarks/ as a module),
                      names_compared_outside (a scan of the package for branches on a table's names)
    comparing         approx_numbers (a record's numbers approximately, everything else exactly),
                      sum_tolerance (the rounding of a sum of n terms in a dtype), F64 / TIGHT /
                      FOUR_DECIMALS / t64 (float64 figures and their tolerances)
    PPO               ppo_config (the one PPO config builder of the tests), tiny_ppo_trainer (a real trainer on one
                      CPU process), recording_rollouts, record_raw_grads, one_update, use_fixed_responses,
                      perturb (a policy moved off its reference), ppo_cli_args
    evaluation        eval_config
    pipeline          tiny_overrides (a recipe's stages on a tiny model), pipeline_argv, run_pipeline, ppo_steps
    processes         tests/processes.py: launch (`accelerate launch`), ppo_command, interrupt_ppo_at,
                      killed_and_resumed
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"  # small data files checked in
SCRIPTS = ROOT / "tests" / "scripts"  # what the multi-process tests run under `accelerate launch`
REWARD_FNS = str(ROOT / "tests" / "reward_fns.py")  # a reward_fn in its file form: REWARD_FNS + ":length"
# where the commands put their models on this machine (accelerate's choice): a test that compares an in-process
# run with a command's puts its models here, as sampling draws from the device's own generator
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SENTIMENT_JUDGE = str(
    ROOT / "data" / "reviews" / "gold_judge.json"
)  # gold.json needs the 538 MB SmolLM2 folder
SENTENCES = [
    "The film is a delight from start to finish.",
    "The film is a dull and lifeless mess.",
    "A gorgeous, moving and funny story.",
    "A tedious, boring waste of time.",
    "The acting is superb and the script is sharp.",
    "The acting is wooden and the script is lazy.",
    "It's a wonderful movie that everyone should see.",
    "It's a terrible movie that nobody should see.",
    "Great performances make this a joy to watch.",
    "Bad writing makes this a chore to sit through.",
]


# --- comparing -----------------------------------------------------------------------------------------

F64 = torch.float64
TIGHT = {"rtol": 0, "atol": 1e-12}  # assert_close's tolerances where float64 math must agree to rounding
FOUR_DECIMALS = {"rtol": 0, "atol": 5e-5}  # a figure printed to 4 decimals


def t64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def approx_numbers(record):
    """`record` with each float (at any depth of dicts and lists) wrapped in `pytest.approx` and everything else
    kept: `written == approx_numbers(metrics)` compares the numbers approximately and the lists and strings
    exactly. pytest 9.2's `approx` refuses a dict holding lists (`alarm_rules`), so a whole record cannot
    be passed to it."""

    if isinstance(record, dict):
        return {k: approx_numbers(v) for k, v in record.items()}
    if isinstance(record, list):
        return [approx_numbers(v) for v in record]
    if isinstance(record, float):
        return pytest.approx(record, nan_ok=True)
    return record


def sum_tolerance(reference: torch.Tensor, terms: int, dtype: torch.dtype = torch.float32) -> dict:
    """assert_close's tolerances for two ways of summing the same `terms` terms in `dtype` (micro-batches
    against one batch, a rescaled mean against a sum): each partial sum rounds by at most eps * |partial|,
    so the two results differ by at most ~ terms * eps * max|term| <= terms * eps * max|reference|.
    One CPU's rounding is not the bound: the order of the additions differs between kernels and machines."""
    eps = torch.finfo(dtype).eps
    return {"atol": terms * eps * float(reference.abs().max()), "rtol": terms * eps}


# --- files ---------------------------------------------------------------------------------------------


def doc_section(page: str, heading: str | None = None) -> str:
    """The text of a documentation page (`page` relative to docs/, or "README.md"): the section under
    `heading` (a line as written, "## Reward functions") up to the next heading of its level, or the whole
    page without it. The tests that run a page's code blocks read them through this, as a reader copies them."""
    text = (ROOT / page if page == "README.md" else ROOT / "docs" / page).read_text(encoding="utf-8")
    if heading is None:
        return text
    level = heading.split(" ")[0]
    section = text[text.index(heading + "\n") :]
    return section.split(f"\n{level} ")[0]


def code_blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of `language` in a page's text, in order, each without its fences."""
    return [part.split("```")[0] for part in text.split(f"```{language}\n")[1:]]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def preference_rows() -> list[dict]:
    """prompt/chosen/rejected pairs from SENTENCES: the positive sentence of each pair is chosen, the prompt
    its first two words."""
    rows = []
    for good, bad in zip(SENTENCES[0::2], SENTENCES[1::2]):
        gw, bw = good.split(" "), bad.split(" ")
        rows.append(
            {"prompt": " ".join(gw[:2]), "chosen": " " + " ".join(gw[2:]), "rejected": " " + " ".join(bw[2:])}
        )
    return rows


def flags(values: dict) -> list[str]:
    """{"steps": 2, ...} -> ["--steps", "2", ...]: config keys as a user types them."""
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL file (one JSON object a line)."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def logged(out: Path) -> list[dict]:
    """The metrics a run wrote to `out`/metrics.jsonl, one dict per step."""
    return read_jsonl(out / "metrics.jsonl")


def load_script(path: Path, name: str | None = None, *, monkeypatch=None, register: bool = False):
    """The Python file `path` (a script of data/ or benchmarks/) imported as the module `name` (its stem by
    default). A script whose dataclasses look their module up must be in `sys.modules` while it runs:
    `monkeypatch` puts it there for the test, `register` for the session."""
    name = name or Path(path).stem
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, name, module)
    elif register:
        sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module


def names_compared_outside(table: str, names) -> list[str]:
    """Every comparison in llm_rlhf/ outside the file named `table` that names one of `names` (`x == "gae"`,
    `x in ("grpo", ...)`), as "file.py:line": what a table's row is should be read from its row, not branched
    on by name."""
    import ast

    found, paths = [], sorted((ROOT / "llm_rlhf").rglob("*.py"))
    assert len(paths) > 30 and any(p.name == "ppo.py" for p in paths)  # the scan reads the whole package
    for path in paths:
        if path.name == table:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    constants = [side] if isinstance(side, ast.Constant) else getattr(side, "elts", [])
                    if any(isinstance(n, ast.Constant) and n.value in names for n in constants):
                        found.append(f"{path.name}:{node.lineno}")
    return found


# --- tiny models -----------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int = 400):
    """A byte-level BPE trained on `texts`, GPT-2 style: `<|endoftext|>` is bos/eos, no pad token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )


def build_tokenizer(folder: Path):
    """The tiny models' tokenizer (`train_tokenizer` on SENTENCES), saved in `folder`."""
    tokenizer = train_tokenizer(SENTENCES * 5)
    tokenizer.save_pretrained(folder)
    return tokenizer


def build_model(folder: Path, kind: str = "gpt2", seed: int = 0, n_positions: int = 64) -> Path:
    """A tiny randomly initialised causal LM plus the tokenizer, saved as an HF folder (safetensors)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(folder)
    torch.manual_seed(seed)
    eos = tokenizer.eos_token_id
    if kind == "gpt2":
        config = GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=n_positions,
            n_embd=32,
            n_layer=2,
            n_head=2,
            bos_token_id=eos,
            eos_token_id=eos,
        )
        model = GPT2LMHeadModel(config)
    elif kind == "llama":
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=n_positions,
            bos_token_id=eos,
            eos_token_id=eos,
            tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(config)
    else:
        raise ValueError(kind)
    model.generation_config.pad_token_id = eos
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def bos_model_dir(folder: Path) -> Path:
    """A tiny Llama whose tokenizer prepends <s> to every text, as Llama's does."""
    from tokenizers import processors
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(folder)
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos = tokenizer.convert_tokens_to_ids("<s>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        bos_token_id=bos,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def multinomial_draw(probs: torch.Tensor) -> torch.Tensor:
    """generate's draw from probs (B, V): torch.multinomial (an exponential race over the vocabulary). (B,)"""
    return torch.multinomial(probs, num_samples=1).squeeze(1)


def naive_inverse_cdf_draw(probs: torch.Tensor) -> torch.Tensor:
    """The fast path's draw (`fast_sampling.draw_tokens`) the long way: one uniform u per row (the same random
    numbers), then walk the vocabulary adding up probabilities until the running sum, as a share of the
    total, passes u. probs (B, V) -> (B,)."""
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64)[:, 0].tolist()
    tokens = []
    for row, u_b in zip(probs.double().tolist(), u):
        total, running = sum(row), 0.0
        for i, p in enumerate(row):
            running += p
            if u_b < running / total:
                tokens.append(i)
                break
    return torch.tensor(tokens)


def naive_sample(
    lm,
    query: torch.Tensor,
    *,
    steps: int,
    temperature: float,
    eos: int,
    pad: int,
    min_new_tokens=0,
    draw=naive_inverse_cdf_draw,
):
    """Token by token, no cache: x_t ~ draw(softmax(z'_t / T)), z'_t the next-token logits with
    z'_t[EOS] = -inf while t < min_new_tokens; finished rows get pad (as HF). The reference `rollout.sample`
    must match draw for draw with the same random numbers: `naive_inverse_cdf_draw` for its fast path (what
    it runs on every transformers LM), `multinomial_draw` for `generate`. query: (B, P) unpadded ->
    (B, steps or fewer)."""
    seq, done, out = query.clone(), torch.zeros(query.shape[0], dtype=torch.bool), []
    with torch.no_grad():
        for t in range(steps):
            logits = lm(seq).logits[:, -1].float()  # (B, V): the next-token logits
            if t < min_new_tokens:
                logits[:, eos] = -math.inf
            token = draw(torch.softmax(logits / temperature, dim=-1))  # (B,)
            token = torch.where(done, torch.full_like(token, pad), token)
            out.append(token)
            seq = torch.cat([seq, token[:, None]], dim=1)
            done |= token == eos
            if done.all():
                break
    return torch.stack(out, dim=1)  # (B, steps or fewer)


# --- chat prompts ----------------------------------------------------------------------------------------

TAGGED_CHAT_TEMPLATE = (  # "<|user|>The film is\n<|assistant|>"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
COLON_CHAT_TEMPLATE = (  # "user: The film is\nassistant:"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CHATS = [
    [{"role": "user", "content": "The film is"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "A gorgeous"}],
    [{"role": "user", "content": "The acting"}, {"role": "assistant", "content": " is superb."}],
]
RENDERED = [  # CHATS under COLON_CHAT_TEMPLATE: every turn before the last assistant turn, then the generation prompt
    "user: The film is\nassistant:",
    "system: Be kind.\nuser: A gorgeous\nassistant:",
    "user: The acting\nassistant:",
]
STOP_STRINGS = [
    "e",
    "a",
]  # in about one token of five of the tiny tokenizer's: some responses stop, some do not


def smollm2_chat(*user_turns: str, answers: tuple[str, ...] = ()) -> str:
    """A prompt as SmolLM2-Instruct's chat template renders it with the generation prompt (its exact text)."""
    text = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    )
    for i, turn in enumerate(user_turns):
        text += f"<|im_start|>user\n{turn}<|im_end|>\n"
        if i < len(answers):
            text += f"<|im_start|>assistant\n{answers[i]}<|im_end|>\n"
    return text + "<|im_start|>assistant\n"


def tiny_chat_model(folder: Path, chat_template: str, n_positions: int = 1024, kind: str = "llama") -> Path:
    """A tiny model (a Llama, or `kind`) HF folder whose tokenizer has `chat_template` (a recipe's chat prompts
    render with it)."""
    from llm_rlhf.models.loading import load_tokenizer

    model = build_model(folder, kind, n_positions=n_positions)
    tokenizer = load_tokenizer(str(model))
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(model)
    return model


def with_chat_template(model_dir: Path, folder: Path, chat_template: str) -> Path:
    """A copy of the HF folder `model_dir` in `folder` whose tokenizer has `chat_template` (as an instruct
    model's, e.g. SmolLM2-Instruct)."""
    import shutil

    from llm_rlhf.models.loading import load_tokenizer

    shutil.copytree(model_dir, folder)
    tokenizer = load_tokenizer(str(folder))
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    return folder


def eos_prone_model(folder: Path) -> Path:
    """The tiny GPT-2 with its EOS logit raised by 5 at every position (P(EOS) ~ 0.25 instead of ~1/400), so
    responses end early and min_new_tokens has something to prevent: ln_f's bias moved along EOS's (tied)
    output embedding w adds 5 * w.w / w.w to the EOS logit."""
    from transformers import AutoModelForCausalLM

    build_model(folder, "gpt2")
    lm = AutoModelForCausalLM.from_pretrained(folder)
    eos = lm.config.eos_token_id
    with torch.no_grad():
        w = lm.transformer.wte.weight[eos].clone()
        lm.transformer.ln_f.bias += 5.0 * w / w.dot(w)
    lm.save_pretrained(folder, safe_serialization=True)
    return folder


def naive_end(tokenizer, ids: list[int], stop_strings, min_new_tokens: int = 0) -> int | None:
    """Where `ids` ends at its first stop string, checked the long way: the first length n >= min_new_tokens
    (and >= 1) whose decoded text holds more occurrences of some stop string than the text of its first n - 1
    tokens. None when no token completes one."""

    def count(text: str, stop: str) -> int:
        return sum(text.startswith(stop, i) for i in range(len(text)))

    for n in range(max(min_new_tokens, 1), len(ids) + 1):
        before, after = (tokenizer.decode(ids[:m], skip_special_tokens=False) for m in (n - 1, n))
        if any(count(after, stop) > count(before, stop) for stop in stop_strings):
            return n
    return None


# --- PPO -------------------------------------------------------------------------------------------------


def eos_rows(tokenizer):
    """Three prompts and responses in `tokenizer`'s ids as one batch of `Samples` (queries left-padded,
    responses right-padded): one cut by a stop string, one truncated at max_new_tokens (it fills every
    response column), one that ended with EOS. Also each row's real tokens with EOS at the end."""
    from llm_rlhf.rl.rollout import Samples, left_pad

    eos = tokenizer.eos_token_id
    queries = [tokenizer(p)["input_ids"] for p in ("The film", "A gorgeous, moving", "It")]
    responses = [
        tokenizer(" is a dull mess.")["input_ids"],  # stopped at the stop string "."
        tokenizer(" and funny, warm and true and")["input_ids"],  # truncated: the longest, fills R
        tokenizer(" is fine")["input_ids"] + [eos],  # ended with EOS
    ]
    R = max(map(len, responses))
    assert len(responses[1]) == R
    query, query_mask = left_pad(queries, eos)  # (3, P) each
    response = torch.tensor([r + [eos] * (R - len(r)) for r in responses])  # (3, R): padding is EOS
    response_mask = torch.tensor([[True] * len(r) + [False] * (R - len(r)) for r in responses])  # (3, R)
    samples = Samples(query, query_mask, response, response_mask, stopped=torch.tensor([True, False, False]))
    with_eos = [q + r + ([] if r[-1] == eos else [eos]) for q, r in zip(queries, responses)]
    return samples, with_eos


def scores_alone(rm, rows: list[list[int]]) -> torch.Tensor:
    """rm.score of each row alone (no padding at all): (B,)."""
    return torch.cat([rm.score(torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long)) for r in rows])


def perturbed_member(source: Path, folder: Path, *, seed: int, mean: float, std: float) -> Path:
    """The reward model of `source` with a freshly drawn score head and its own stored normalisation, saved in
    `folder`: an ensemble member that disagrees with the others."""
    from llm_rlhf.models.reward_model import load_reward_model, save_reward_model

    rm = load_reward_model(source)
    torch.manual_seed(seed)
    with torch.no_grad():
        rm.model.score.weight.normal_(0.0, 0.5)
    rm.normalization = {"mean": mean, "std": std, "reference_set": "test", "n": 1}
    save_reward_model(rm, folder, merge_lora=False)
    return folder


def ppo_config(model_dir, rm_dir, prompt_file, out, **kw):
    """A PPO config for tiny-model runs: two steps of 8 episodes in minibatches of 4, 8 new tokens, no
    checkpoints or logged samples; `rm_dir` None for no reward model (give a reward_fn then). `kw` wins."""
    from llm_rlhf.ppo import config as ppo_config

    base = dict(
        model_name_or_path=str(model_dir),
        reward_model_path=str(rm_dir) if rm_dir is not None else None,
        prompt_file=str(prompt_file),
        output_dir=str(out),
        steps=2,
        rollout_batch_size=8,
        mini_batch_size=4,
        ppo_epochs=2,
        max_new_tokens=8,
        learning_rate=1e-3,
        save_steps=0,
        log_samples_every=0,
        kl_target=1.0,
        kl_horizon=100,
        gold_judge=SENTIMENT_JUDGE,
    )
    base.update(kw)
    return ppo_config.Config(**base)


def tiny_ppo_trainer(cfg, mixed_precision: str = "no", *, cpu: bool = True):
    """The real trainer on one process, built as `llm-rlhf ppo` builds it (`ppo_building.build_trainer`): on the CPU
    (the same figures on every machine), or with cpu=False on accelerate's device (a GPU's tests)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from llm_rlhf.models.loading import load_tokenizer
    from llm_rlhf.ppo import building as ppo_building

    AcceleratorState._reset_state(reset_partial_state=True)  # a fresh mixed_precision for each test
    tokenizer = load_tokenizer(cfg.model_name_or_path, padding_side="left")
    prompts = ppo_building.load_prompt_ids(cfg, tokenizer)
    return ppo_building.build_trainer(
        cfg, Accelerator(cpu=cpu, mixed_precision=mixed_precision), tokenizer, prompts
    )


def recording_rollouts(trainer) -> list:
    """Keep every rollout the trainer builds (the real `rollout`, called as `ppo_step` calls it)."""
    kept, real = [], trainer.rollout

    def rollout(*args, **kwargs):
        out = real(*args, **kwargs)  # (rollout, scores)
        kept.append(out[0])
        return out

    trainer.rollout = rollout
    return kept


def record_raw_grads(trainer, store: list) -> None:
    """Append the flattened gradient of every trainable parameter to `store` at each optimiser step, as
    it is before clipping (after DDP's all-reduce)."""
    clip = trainer.accelerator.clip_grad_norm_

    def recording(parameters, max_norm, *args, **kwargs):
        parameters = list(parameters)
        store.append(torch.cat([p.grad.detach().flatten().clone() for p in parameters]))
        return clip(parameters, max_norm, *args, **kwargs)

    trainer.accelerator.clip_grad_norm_ = recording


def one_update(cfg, hook=None, *, fixed_responses: bool = False) -> dict[str, torch.Tensor]:
    """The parameters after one update on a fixed rollout with fixed advantages and returns; `hook(trainer)`
    runs before the update. fixed_responses: the rollout's responses are `use_fixed_responses`' (of
    different lengths), not sampled."""
    trainer = tiny_ppo_trainer(cfg)
    if fixed_responses:
        use_fixed_responses(trainer)
    torch.manual_seed(123)
    rollout, _ = trainer.rollout(trainer.collector.queries(trainer.step))
    adv = (
        torch.randn(rollout.logprobs.shape, generator=torch.Generator().manual_seed(0))
        * rollout.response_mask
    )
    returns = (
        torch.randn(rollout.logprobs.shape, generator=torch.Generator().manual_seed(1))
        * rollout.response_mask
    )
    if hook is not None:
        hook(trainer)
    trainer.train_on_rollout(rollout, adv, returns)
    return {k: v.detach().clone() for k, v in trainer.unwrapped_policy.named_parameters()}


def use_fixed_responses(trainer, seed: int = 7) -> None:
    """Replace sampling by fixed responses to the trainer's own prompts: EOS at varied positions (rows
    1, 2, 4, 5, 7 end early, the others never emit EOS), the same on every call (whatever its `sampling`)."""
    from llm_rlhf.rl import token_math
    from llm_rlhf.rl.rollout import Samples, left_pad

    eos, pad, R = trainer.tokenizer.eos_token_id, trainer.tokenizer.pad_token_id, trainer.cfg.max_new_tokens

    device = trainer.accelerator.device  # where `generate` would have sampled them

    def fixed(queries, sampling=None):
        query, query_mask = left_pad(queries, pad, device)
        response = torch.randint(5, 200, (len(queries), R), generator=torch.Generator().manual_seed(seed))
        response = response.to(device)
        for i in range(len(queries)):
            if i % 3:
                response[i, i % R] = eos
        mask = token_math.response_mask_from_tokens(response=response, eos_token_id=eos)
        return Samples(
            query=query, query_mask=query_mask, response=torch.where(mask, response, pad), response_mask=mask
        )

    trainer.collector.generate = fixed


def perturb(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Move every parameter by scale * N(0, 1) noise (seeded): the policy off its reference."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def ppo_cli_args(model_dir, rm_dir, prompt_file, out: Path, steps: int, **kw) -> list[str]:
    """`-m llm_rlhf ppo` with flags for a tiny run (rollouts of 4 per process, a checkpoint every step)."""
    values = dict(
        model_name_or_path=model_dir,
        reward_model_path=rm_dir,
        prompt_file=prompt_file,
        output_dir=out,
        steps=steps,
        rollout_batch_size=4,
        mini_batch_size=2,
        ppo_epochs=1,
        max_new_tokens=6,
        save_steps=1,
        eval_every=0,
        log_samples_every=0,
        learning_rate="1e-3",
    )
    values.update(kw)
    return ["-m", "llm_rlhf", "ppo", *flags(values)]


# --- evaluation ------------------------------------------------------------------------------------------


def eval_config(policy, baseline, prompt_file, out, **kw):
    """An evaluation config for tiny models: 12 prompts in batches of 5, 6 new tokens, no reward model, the
    sentiment-only gold judge. `kw` wins."""
    from llm_rlhf.stages import evaluate

    base = dict(
        policy_path=str(policy),
        baseline_path=str(baseline),
        reward_model_path="none",
        gold_judge=SENTIMENT_JUDGE,
        prompt_file=str(prompt_file),
        num_prompts=12,
        max_new_tokens=6,
        batch_size=5,
        output_dir=str(out),
        print_samples=2,
    )
    base.update(kw)
    return evaluate.Config(**base)


# --- the pipeline ----------------------------------------------------------------------------------------


def tiny_overrides(model: Path, data: dict[str, Path], out: Path, *, max_length: int) -> dict[str, dict]:
    """Per stage: the keys that swap in the tiny model, the small files and a budget of two steps.
    Every other key (learning rates, LoRA, KL control, data_format, skip_long, ...) is the recipe's."""
    return {
        "sft": {
            "model_name_or_path": model,
            "train_file": data["sft"],
            "eval_file": data["sft"],
            "output_dir": out / "sft",
            "max_length": max_length,
            "max_steps": 2,
            "per_device_train_batch_size": 4,
            "warmup_ratio": 0,
            "logging_steps": 1,
            "eval_steps": 0,
            "save_steps": 2,
            "num_samples": 2,
            "max_new_tokens": 4,
        },
        "rm": {
            "model_name_or_path": out / "sft",
            "train_file": data["prefs"],
            "eval_file": data["prefs"],
            "test_file": data["prefs"],
            "output_dir": out / "rm",
            "max_length": max_length,
            "max_steps": 2,
            "per_device_train_batch_size": 4,
            "warmup_ratio": 0,
            "logging_steps": 1,
            "eval_steps": 0,
            "save_steps": 2,
            "normalization_samples": 8,
            "score_batch_size": 8,
        },
        "ppo": {
            "model_name_or_path": out / "sft",
            "reward_model_path": out / "rm",
            "prompt_file": data["prompts"],
            "eval_prompt_file": data["prompts"],
            "gold_judge": SENTIMENT_JUDGE,
            "eval_num_prompts": 2,
            "output_dir": out / "ppo",
            "steps": 2,
            "rollout_batch_size": 4,
            "mini_batch_size": 2,
            "gradient_accumulation_steps": 1,
            "ppo_epochs": 1,
            "max_new_tokens": 4,
            "save_steps": 0,
            "log_samples_every": 0,
        },
        "eval": {
            "policy_path": out / "ppo",
            "baseline_path": out / "sft",
            "reward_model_path": out / "rm",
            "gold_judge": SENTIMENT_JUDGE,
            "prompt_file": data["prompts"],
            "output_dir": out / "eval",
            "num_prompts": 4,
            "max_new_tokens": 4,
            "batch_size": 4,
        },
    }


CHAINED = {  # keys the pipeline sets itself (each stage reads the previous stage's folder)
    "sft": ("output_dir",),
    "rm": ("model_name_or_path", "output_dir"),
    "ppo": ("model_name_or_path", "reward_model_path", "output_dir"),
    "eval": ("policy_path", "baseline_path", "reward_model_path", "output_dir"),
}


def pipeline_argv(
    out: Path,
    model: Path,
    sft_files,
    pref_files,
    prompt_file,
    *,
    config: Path | None = None,
    keys=None,
    **extra,
) -> list[str]:
    """A pipeline recipe (`config`; the reviews one by default) with a tiny model and small files swapped in on
    the command line; `keys`: more keys per stage ({"sft": {"lora_layers": 1}, ...})."""
    data = {"sft": sft_files[0], "prefs": pref_files[0], "prompts": prompt_file}
    overrides = tiny_overrides(model, data, out, max_length=48)
    overrides["ppo"].update(steps=4, save_steps=2, eval_every=2)
    for stage, values in (keys or {}).items():
        overrides[stage].update(values)
    for stage, chained in CHAINED.items():
        for key in chained:
            del overrides[stage][key]
    config = config or ROOT / "recipes" / "reviews" / "pipeline.yaml"
    argv = ["--config", str(config), "--output_dir", str(out)]
    for stage, values in overrides.items():
        plain = {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}
        argv.append(f"--{stage}={yaml.safe_dump(plain, default_flow_style=True, width=10_000).strip()}")
    for key, value in extra.items():
        argv += [f"--{key}", value]
    return argv


def run_pipeline(argv: list[str]) -> dict:
    from llm_rlhf.core.config import parse_config
    from llm_rlhf.interfaces import pipeline

    return pipeline.run(parse_config(pipeline.Config, argv))


def ppo_steps(folder: Path) -> list[int]:
    """The steps a pipeline run's PPO stage logged (`folder`/ppo/metrics.jsonl)."""
    return [row["step"] for row in logged(folder / "ppo")]


def with_lora(lm):
    """lm with a rank-4 LoRA on the attention projections, B drawn at random (peft starts it at zero, which
    would make the adapter a no-op), as PPO holds it: unmerged, eval mode."""
    from peft import LoraConfig, get_peft_model

    targets = ["c_attn"] if lm.config.model_type == "gpt2" else ["q_proj", "v_proj"]
    lm = get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=targets))
    torch.manual_seed(7)
    for name, p in lm.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.3)
    return lm.eval()
