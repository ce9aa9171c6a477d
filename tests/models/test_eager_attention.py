"""`loading.use_eager_attention`: under bf16 autocast on a CPU every stage's models compute attention with
transformers' eager implementation, which gives SDPA's outputs up to float rounding; elsewhere nothing changes."""

from __future__ import annotations

import pytest
import torch
from helpers import ppo_config, tiny_ppo_trainer
from torch import nn

from llm_rlhf.core.config import parse_config
from llm_rlhf.models.loading import load_causal_lm, use_eager_attention
from llm_rlhf.stages import reward, sft


def attention(model) -> str:
    return model.config._attn_implementation


@pytest.mark.parametrize("kind", ["tiny_model_dir", "tiny_llama_dir"])
def test_eager_attention_gives_sdpas_logits_with_left_padding(request, kind):
    folder = str(request.getfixturevalue(kind))
    sdpa, eager = load_causal_lm(folder), load_causal_lm(folder)
    assert attention(sdpa) == "sdpa"
    assert use_eager_attention(eager, bf16=True, device="cpu") is eager
    assert attention(eager) == "eager"
    torch.manual_seed(0)
    ids = torch.randint(0, sdpa.config.vocab_size, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[1, :1] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = sdpa(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = eager(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


def test_float32_other_devices_and_chosen_implementations_are_left_alone(tiny_llama_dir):
    model = load_causal_lm(str(tiny_llama_dir))
    use_eager_attention(model, bf16=False, device="cpu")
    use_eager_attention(model, bf16=True, device="cuda")
    use_eager_attention(model, bf16=True, device=torch.device("cuda", 0))
    assert attention(model) == "sdpa"
    wrapped = nn.ModuleList([model])  # a policy with its value head, a reward ensemble: the models inside
    use_eager_attention(wrapped, bf16=True, device=torch.device("cpu"))
    assert attention(model) == "eager"
    model.set_attn_implementation("sdpa")
    model.config._attn_implementation = "flash_attention_2"  # a user's choice (as the config reads)
    use_eager_attention(model, bf16=True, device="cpu")
    assert attention(model) == "flash_attention_2"


@pytest.mark.parametrize("bf16", [True, False])
def test_the_stages_models_switch_under_bf16_on_a_cpu(
    bf16, tiny_model_dir, tiny_rm_dir, prompt_file, sft_files, pref_files, tmp_path
):
    """SFT's and the RM's trained models (TRL's trainers on the CPU), and PPO's policy, reference and reward
    model: eager with bf16 true, SDPA with bf16 false."""
    want = "eager" if bf16 else "sdpa"
    paths = ["--model_name_or_path", str(tiny_model_dir), "--bf16", str(bf16).lower()]
    cfg = parse_config(
        sft.Config,
        [*paths, "--train_file", str(sft_files[0]), "--eval_file", str(sft_files[1])]
        + ["--output_dir", str(tmp_path / "sft"), "--max_length", "32"],
    )
    tokenizer, model, train, val = sft.load_inputs(cfg)
    trainer = sft.build_trainer(cfg, model, tokenizer, train, val)
    assert attention(trainer.model) == want

    cfg = parse_config(
        reward.Config,
        [*paths, "--train_file", str(pref_files[0]), "--eval_file", str(pref_files[1])]
        + ["--output_dir", str(tmp_path / "rm"), "--max_length", "48"],
    )
    inputs = reward.load_inputs(cfg)
    pairs, _ = reward._tokenize(inputs.train, inputs.tokenizer, cfg.max_length)
    trainer = reward.build_trainer(cfg, inputs.model, inputs.tokenizer, pairs, pairs)
    assert attention(trainer.model) == want

    cfg = ppo_config(tiny_model_dir, tiny_rm_dir, prompt_file, tmp_path / "ppo", bf16=bf16, use_lora=True)
    ppo = tiny_ppo_trainer(cfg, "bf16" if bf16 else "no")
    models = [ppo.policy, ppo.ref_model, ppo.collector.scorer.reward_model]
    found = {
        attention(m) for model in models for m in model.modules() if hasattr(m, "set_attn_implementation")
    }
    assert found == {want}
