#!/usr/bin/env bash
# One device-tool command: GPU tests, kernel check, engine smoke test and benchmarks.
# Results land in $OUT. Wheels for packages the GPU image lacks travel in .whl/.
set -uo pipefail
export PYTHONUNBUFFERED=1 NINFER_CACHE_DIR=/tmp/ninfer-cache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a $OUT/gpu.txt
timeout 150 python3 -m pytest -q -x tests/test_kernels_triton.py tests/test_sampler.py 2>&1 | tail -3 | tee $OUT/pytest.txt
timeout 120 python3 scripts/gpu_smoke.py --out $OUT/smoke.json 2>&1 | tail -2
timeout 90 python3 scripts/gpu_kernels_check.py --out $OUT/kernels.jsonl 2>&1 | tail -12
timeout 240 ninfer-bench random:qwen3-8b --dtype bf16 --only decode --concurrency 1,8 \
    --decode-prompt-len 512 --decode-output-len 256 2>/dev/null | tee $OUT/bench-8b.jsonl
timeout 200 ninfer-bench random:qwen3-0.6b --dtype bf16 --only offline --num-requests 64 \
    --input-len 100,1024 --output-len 100,1024 --hf-batch 64 2>/dev/null | tee $OUT/bench-0.6b.jsonl
