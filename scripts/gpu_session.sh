#!/usr/bin/env bash
# One device-tool command per stage: GPU tests, kernel checks, benchmarks. Results land in
# $OUT. Wheels for packages the GPU image lacks travel in .whl/ (carry it).
#
#   scripts/gpu_session.sh check    GPU tests, hybrid kernel checks, then the 27B shape (~9 min)
#   scripts/gpu_session.sh moe      MoE config sweep (written in place), kernel check, the
#                                   35B-A3B and 30B-A3B shapes with transformers (~9 min)
#   scripts/gpu_session.sh rerun    the sweep again, then MoE decode without transformers
#   scripts/gpu_session.sh rerun2   27B decode/prefill, 8B, prefix reuse (ours only)
#   scripts/gpu_session.sh final    8B regression, prefix reuse on graphs, a 30B-A3B step profile
#   scripts/gpu_session.sh dense    the 8B shape (must not regress), prefix reuse on graphs
#   scripts/gpu_session.sh tune     Gated DeltaNet decode splits and head-dim-256 decode attention sweeps,
#                                   the 35B-A3B decode, ninfer-serve on the 27B shape (startup, HTTP speed)
#   scripts/gpu_session.sh last     the 35B-A3B decode, then the 27B shape with transformers (decode, prefill)
#   scripts/gpu_session.sh probe    step profiles (per kernel kind) of the 35B-A3B and 27B shapes,
#                                   then prefix reuse on graphs with room for the fp32 warm-up
set -uo pipefail
export PYTHONUNBUFFERED=1 NINFER_CACHE_DIR=/tmp/ninfer-cache
stage=${1:-check}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
    | tee -a "$OUT/gpu.txt"
bench() { timeout "$1" ninfer-bench "${@:2}" 2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl"; }
case "$stage" in
check)
    timeout 240 python3 -m pytest -q -x -m gpu tests/test_cuda_graph.py tests/test_moe_kernels.py \
        tests/test_gated_delta_decode.py tests/test_prefill_kernels.py 2>&1 | tail -15 | tee "$OUT/pytest.txt"
    timeout 60 python3 scripts/gpu_gdn_decode_check.py --out "$OUT/gdn_decode.jsonl" 2>&1 | tail -14
    timeout 60 python3 scripts/gpu_prefill_kernels_check.py --out "$OUT/prefill_kernels.jsonl" 2>&1 | tail -14
    bench 330 random:qwen3.6-27b --dtype bf16 --only bandwidth,decode,prefill --concurrency 1,8 \
        --prefill-lens 8192 --prefill-chunk 8192 --hf-dynamic 1,8 --hf-decode-output-len 64
    ;;
moe)
    timeout 170 python3 scripts/gpu_moe_tune.py --budget-s 130 --out kernels/triton/moe_configs/NVIDIA_H200.json \
        2>&1 | tail -8
    cp kernels/triton/moe_configs/NVIDIA_H200.json "$OUT/"
    timeout 90 python3 scripts/gpu_moe_check.py --out "$OUT/moe_check.jsonl" 2>&1 | tail -14
    bench 230 random:qwen3.6-35b-a3b --dtype bf16 --only bandwidth,decode,prefill --concurrency 1,8 \
        --prefill-lens 8192 --prefill-chunk 8192 --hf-dynamic 1,8 --hf-decode-output-len 32
    bench 180 random:qwen3-30b-a3b --dtype bf16 --only bandwidth,decode,prefill --concurrency 1,8 \
        --prefill-lens 8192 --prefill-chunk 8192 --hf-dynamic 1,8 --hf-decode-output-len 32
    ;;
rerun)
    timeout 130 python3 scripts/gpu_moe_tune.py --budget-s 90 --out kernels/triton/moe_configs/NVIDIA_H200.json \
        2>&1 | tail -40
    cp kernels/triton/moe_configs/NVIDIA_H200.json "$OUT/"
    timeout 60 python3 scripts/gpu_moe_check.py --out "$OUT/moe_check.jsonl" 2>&1 | tail -12
    bench 120 random:qwen3.6-35b-a3b --dtype bf16 --only bandwidth,decode --concurrency 1,8 --no-transformers
    bench 120 random:qwen3-30b-a3b --dtype bf16 --only bandwidth,decode --concurrency 1,8 --no-transformers
    ;;
rerun2)
    bench 200 random:qwen3.6-27b --dtype bf16 --only bandwidth,decode,prefill --concurrency 1,8 \
        --prefill-lens 8192 --prefill-chunk 8192 --no-transformers
    bench 150 random:qwen3-8b --dtype bf16 --only bandwidth,decode --concurrency 1,8 --no-transformers
    timeout 120 python3 scripts/gpu_prefix_reuse_check.py --dtype fp32 2>&1 | tail -22
    ;;
final)
    bench 110 random:qwen3-8b --dtype bf16 --only bandwidth,decode --concurrency 1,8 --no-transformers
    timeout 80 python3 scripts/gpu_prefix_reuse_check.py --dtype fp32 2>&1 | tail -22
    timeout 130 python3 scripts/gpu_step_profile.py random:qwen3-30b-a3b --concurrency 8 --steps 30 --top 14 \
        --host 2>&1 | tail -60
    ;;
dense)
    bench 200 random:qwen3-8b --dtype bf16 --only bandwidth,decode --concurrency 1,8 --no-transformers
    timeout 120 python3 scripts/gpu_prefix_reuse_check.py --dtype fp32 2>&1 | tail -22
    ;;
tune)
    timeout 90 python3 -m pytest -q -x -m gpu tests/test_gated_delta_decode.py 2>&1 | tail -4 | tee "$OUT/pytest.txt"
    timeout 150 python3 scripts/gpu_gdn_decode_check.py --out "$OUT/gdn_decode.jsonl" 2>&1 | tail -80
    for shape in qwen3.6-35b-a3b qwen3.6-27b; do
        timeout 75 python3 scripts/gpu_decode_attention_sweep.py --shape $shape --cases 1x768,8x768 \
            --max-context 1536 --warps 2,4,8 --stages 1 --block-n 16,32,64 --splits default,8,32 \
            2>&1 | tee -a "$OUT/attention_sweep.jsonl" | tail -1
    done
    bench 110 random:qwen3.6-35b-a3b --dtype bf16 --only bandwidth,decode --concurrency 1,8 --no-transformers
    timeout 170 python3 scripts/gpu_serve_speed.py random:qwen3.6-27b --requests 2 --max-tokens 256 \
        --log "$OUT/serve_speed.log" 2>&1 | tee "$OUT/serve_speed.jsonl"
    grep -E "building|loaded|captured|warmed|memory|ready|listening" "$OUT/serve_speed.log" | cut -c1-220 | head -20
    ;;
last)
    bench 105 random:qwen3.6-35b-a3b --dtype bf16 --only bandwidth,decode --concurrency 1,8 --no-transformers
    bench 300 random:qwen3.6-27b --dtype bf16 --only bandwidth,decode,prefill --concurrency 1,8 \
        --prefill-lens 8192 --prefill-chunk 8192 --hf-dynamic 1,8 --hf-decode-output-len 48
    ;;
probe)
    timeout 170 python3 scripts/gpu_step_profile.py random:qwen3.6-35b-a3b --concurrency 1,8 --steps 20 \
        --top 30 2>&1 | tee "$OUT/profile_35b.jsonl" | tail -4
    timeout 170 python3 scripts/gpu_step_profile.py random:qwen3.6-27b --concurrency 1,8 --steps 20 \
        --top 30 2>&1 | tee "$OUT/profile_27b.jsonl" | tail -4
    timeout 200 python3 scripts/gpu_prefix_reuse_check.py --dtype fp32 2>&1 | tee "$OUT/prefix_reuse.txt" | tail -24
    ;;
esac
tail -5 "$OUT/bench.err" 2>/dev/null
true
