#!/usr/bin/env bash
# The GPU check: the gpu-marked tests (engine, FSDP trainer and CUDA IPC weight sync on CUDA; Megatron
# TP=1 when megatron-core is there), then `python -m miles.bench gpu` (decode tokens/s against the HBM
# bound, train tokens/s). Run from the repository root on a machine with a CUDA device and torch,
# transformers and safetensors installed; it needs no Ray and no network.
#
# What such a machine lacks comes as wheels in WHEEL_DIR (default wheels/gpu), made on a machine with
# a package index by:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d wheels/gpu hydra-core==1.3.2 omegaconf==2.3.0 megatron-core==0.16.1 PyYAML pytest pluggy iniconfig
#   pip download --no-deps --no-binary=:all: -d wheels/gpu antlr4-python3-runtime==4.9.3
#
# Not yet run on a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="${1:-wheels/gpu}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d "$WHEELS" ]; then
  python -m pip install -q --no-index --no-build-isolation --find-links "$WHEELS" \
    hydra-core omegaconf antlr4-python3-runtime pytest || echo "gpu_check: installing from $WHEELS failed" >&2
  ls "$WHEELS"/megatron_core-* >/dev/null 2>&1 && \
    python -m pip install -q --no-index --no-deps --find-links "$WHEELS" megatron-core
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)"
python -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py
python -m miles.bench gpu
