"""Build a smaller student for on-policy distillation: SmolLM2-135M-Instruct without its middle third of blocks.

    python data/make_smaller_smollm2.py [--source data/smollm2-135m-instruct] [--out data/smollm2-20-blocks]

Keeps blocks 0-9 and 20-29 of the source's 30 (20 blocks, 99M parameters against 135M), the embedding (tied to
the LM head), the final norm and the tokenizer with its chat template, so it shares the teacher's vocabulary
exactly; `config.json` says 20 layers. Why these: of the cuts tried on a chain_sum prompt with greedy decoding
(the first 20 or 24 blocks, every other block, every third dropped, the middle third dropped), only this one
still wrote English ("assigned to the last 1, 2, 4, 5, 6,"); every other one gave whitespace or fragments
(every other block: "alrem Remrem'' also to torem..."). Nothing is trained: the student starts as the cut
network, and distillation (or RL) is what teaches it. Written beside the target and renamed into place (an interrupted
run leaves nothing); an existing folder built from the same source is left as it is. Build the source first
with `python data/make_smollm2.py`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(source: Path, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    provenance = {"source": str(source), "kept_blocks": "0-9 and 20-29", "script": Path(__file__).name}
    if (out / "provenance.json").is_file() and json.loads(
        (out / "provenance.json").read_text()
    ) == provenance:
        print(f"{out}: already built from {source}")
        return out
    if not (source / "config.json").is_file():
        sys.exit(f"{source}: no model folder; build it with `python data/make_smollm2.py`")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, use_safetensors=True)
    blocks = model.model.layers
    third = len(blocks) // 3
    kept = torch.nn.ModuleList(b for i, b in enumerate(blocks) if not third <= i < 2 * third)
    for index, block in enumerate(kept):  # each attention layer knows its index (the KV cache's slot)
        block.self_attn.layer_idx = index
    model.model.layers = kept
    model.config.num_hidden_layers = len(kept)
    if getattr(model.config, "layer_types", None) is not None:
        model.config.layer_types = model.config.layer_types[: len(kept)]
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
    (tmp / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp, use_safetensors=True)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, model(ids).logits, atol=1e-5), "reload check failed"
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    n = sum(p.numel() for p in model.parameters())
    print(
        f"{out}: LlamaForCausalLM, {len(kept)} of {len(blocks)} blocks, {n:,} parameters, reload check passed"
    )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=HERE / "smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=HERE / "smollm2-20-blocks")
    args = parser.parse_args(argv)
    build(args.source, args.out)


if __name__ == "__main__":
    main()
