#!/usr/bin/env bash
# One device-tool command per stage: GPU tests, kernel checks, benchmarks. Results land in
# $OUT. Wheels for packages the GPU image lacks travel in .whl/ (carry it; scripts/gpu_wheels.sh
# fills it).
#
#   scripts/gpu_session.sh check    GPU tests, hybrid kernel checks, then the 27B shape (~9 min)
#   scripts/gpu_session.sh moe      MoE GPU tests, the one-token expert sweep (written in place; MOE_TUNE=1:
#                                   the grouped shapes too), kernel check, 35B-A3B decode (30B-A3B with MOE_30B=1;
#                                   MOE_TESTS=0: no tests nor kernel check)
#   scripts/gpu_session.sh dense    the 8B shape (must not regress), prefix reuse on graphs
#   scripts/gpu_session.sh ab       AB="VAR=v1,v2 [VAR=...]": each of AB_MODELS (AB_MODEL, 35B-A3B) decode at
#                                   AB_C (1,8) per value of each switch, in order (A=1+B=1: one run with both;
#                                   AB_TESTS: GPU test files to run first); the table printed at the end
#   scripts/gpu_session.sh moe35    the 35B-A3B decode at c=1 and 8 alone (committed tables)
#   scripts/gpu_session.sh router-ab  MoE blocks' norm and router matmul as one launch (NINFER_NORM_ROUTER=1)
#                                   against two: its GPU tests, then ROUTER_MODELS (35B-A3B, 30B-A3B) at c=1, 8
#   scripts/gpu_session.sh moe30    the 30B-A3B decode at c=1 and 8 alone (committed tables)
#   scripts/gpu_session.sh profile35  PROFILE_MODEL's step (35B-A3B) at PROFILE_C (1) profiled, the host's side included,
#                                   per PROFILE_PDL (1; "1 0": without PDL too, each kernel's own time)
#   scripts/gpu_session.sh gdn-splits  GDN_MODEL (35B-A3B) decode at GDN_C (1) per Gated DeltaNet value split
#                                   count GDN_SPLITS (4 2 1 8; NINFER_GDN_VALUE_SPLITS)
#   scripts/gpu_session.sh launch-floor  one link of a replayed chain of dependent launches, PDL on and off
#   scripts/gpu_session.sh pdl-ab     kernels triggering the next launch at their exit (NINFER_PDL_TRIGGER=0)
#                                   against after their wait (the default): PDL_MODEL (35B-A3B) at PDL_C (1,8)
#                                   both ways, then the GPU tests with the trigger (PDL_TESTS=0: none;
#                                   PDL_27B=1: the 27B at c=1 both ways too)
#   scripts/gpu_session.sh skinny-ab  35B-A3B decode with its projections on the few-row kernel (swept, taken
#                                   within SKINNY_MARGIN of cuBLAS), then with the committed table
#   scripts/gpu_session.sh segments   the dense rows beside quantized ones (SEGMENT_MODELS' in_proj b/a) swept
#                                   for the few-row kernel against cuBLAS at rows 1 and 8
#   scripts/gpu_session.sh gate-tests the output gate in the decode kernels, graph decode, the MoE kernels (CUDA tests)
#   scripts/gpu_session.sh presets  27B decode with the family's sampler presets beside plain greedy
#   scripts/gpu_session.sh skinny   the few-row linear and one-token MoE kernels: GPU tests, the sweep
#                                   (tables written in place, copies in $OUT), the head-dim-256
#                                   prefill attention tiles, the 35B-A3B decode
#   scripts/gpu_session.sh insitu   35B-A3B step profiles with and without those kernels, a 27B 8k prefill profile
#   scripts/gpu_session.sh prefill  prefill kernel tests, the 27B 8k prefill against transformers, 30B-A3B decode
#   scripts/gpu_session.sh prefill27  the 27B 8k prefill against transformers alone
#   scripts/gpu_session.sh spec     speculative decoding: GPU tests, the 27B round cost at 512 and 32k
#                                   context, then TRAINED (a checkpoint dir) with MTP k=1..5 at c=1 and 8
#   scripts/gpu_session.sh spec-head  the 27B's k=3 round cost at 512 and 32k drafting over the full LM head, then over
#                                   the --lm-head-draft shortlist of each HEAD_SIZES (32768), then with verify
#                                   attention in the decode kernel (NINFER_FUSED_VERIFY=1); SPEC_REPORT: a
#                                   train_report.json whose round acceptance the implied speedups assume;
#                                   HEAD_FULL=0 / HEAD_FUSED=0: not the first / the last run
#   scripts/gpu_session.sh spec2    a TRAIN_PRESET (gpu) model trained on the GPU for at most TRAIN_S (300) seconds of
#                                   its loop (TRAIN_STEPS: steps instead of the preset's; SPEC_TESTS=1: the spec GPU
#                                   tests first; TRAIN_TESTS=0: not the captured step's; .corpus carried: on the
#                                   whole stdlib, scripts/stdlib_corpus.sh), then MTP k=DRAFTS (1..5) at SPEC_C (1,8) on
#                                   held-out stdlib prompts (device rounds; SPEC_BENCH_S=0: none; SPEC_AB="NINFER_PDL=0":
#                                   k=3 again per VAR=value[,VAR=value] set), then k=3 with the
#                                   host driving every round (NINFER_DEVICE_ROUNDS=0; SPEC_HOST_PEER=0 skips it),
#                                   last the engine's acceptance against the trainer's chain (SPEC_CHECK=0 skips it;
#                                   scripts/spec_acceptance_check.py); a warm machine's /tmp/trained-PRESET is reused
#   scripts/gpu_session.sh train-ab the training loop's speed per delta-rule variant (TRAIN_AB: fp32 tf32 fla), TRAIN_AB_S
#                                   (90) seconds each, after the GPU training tests
#   scripts/gpu_session.sh gap      the plain engine at c=1 on a random gpu-deep shape: one random prompt, 16 random prompts
#                                   and 16 text windows pooled, each on the process's first and on a second engine
#   scripts/gpu_session.sh slowdown what slows every graph's replay once more graphs are captured (with PDL; capture
#                                   by capture, on side streams, without PDL; a speculating engine first in its process)
#   scripts/gpu_session.sh spec-gap a GAP_PRESET (gpu-deep) model trained GAP_TRAIN_S (60) seconds, then the engine's
#                                   acceptance, drafts and greedy outputs against the trainer's on the GPU: fp32 and
#                                   bf16, graphs and eager, device and host rounds; then the spec bench's sample
#   scripts/gpu_session.sh agent    the agent workload (#23) on the 27B shape, with and without reuse, over capacity
#   scripts/gpu_session.sh kv128    27B decode per KV_FORMATS: c=1 after a 128k prompt, c=8 after 32k prompts
#   scripts/gpu_session.sh kvsyn    27B decode per KV_FORMATS at c=1 and 8 over 32k and 128k synthetic contexts
#   scripts/gpu_session.sh kv128x8  27B decode per KV_FORMATS at c=8 after 128k prompts (one format a call)
#   scripts/gpu_session.sh kv       quantized-KV kernel tests on CUDA, then 27B decode at c=1 and 8 over a
#                                   KV_CONTEXT-token prompt (32k) for each of KV_FORMATS (bf16 fp8 k8v4)
#   scripts/gpu_session.sh validate the spec and quantized-KV GPU tests, then 27B decode at 32k for bf16 and fp8 KV
#   scripts/gpu_session.sh quant    27B decode with WEIGHT_FORMATS
#                                   (random:qwen3.6-27b@QUANT; FP8-block and bf16), then fp8 KV at 32k, c=1
#   scripts/gpu_session.sh quant-sweep  the quantized GEMM and MoE kernels against bf16 at the 27B/35B shapes
#   scripts/gpu_session.sh profile27  configs/qwen27b-fp8-mtp.yaml served on the 27B shape, two chat requests
#   scripts/gpu_session.sh quant-moe-tune  the quantized experts: GPU tests (MOE_TESTS=0: none), launch shapes
#                                   tuned (MOE_FORMATS fp8,int4; MOE_TOKENS 1, e.g. 1,1024,8192), then the
#                                   35B-A3B at BENCH_C (1) per WEIGHT_FORMATS (" ": none)
#   scripts/gpu_session.sh prefill-host  8k prompts in PREFILL_CHUNK (1024) chunks per PREFILL_MODELS: tok/s, the host
#                                   syncs by call site, a cProfile of the host (scripts/gpu_prefill_host.py;
#                                   PREFILL_PUBLISH=1: each prompt published, evicting the last to the host tier)
#   scripts/gpu_session.sh chunk-latency  the prefill kernels' GPU tests (CHUNK_TESTS=0: none), then per CHUNK_MODELS
#                                   an 8k prompt's time to first token alone and beside 8 decoders, their token
#                                   gaps, at chunks CHUNKS (1024..8192; scripts/gpu_chunk_latency.py), and the
#                                   Triton compiles the warm-up missed
#   scripts/gpu_session.sh spec-profile  the round kernels', device rounds', decode/verify attention and GDN GPU tests
#                                   (SPEC_TESTS=0: none), then
#                                   plain decode steps and speculative rounds (SPEC_K drafts, SPEC_C rows) of SPEC_MODEL
#                                   (train-gpu-deep: the gpu-deep preset's shape, random weights) per kernel kind
#                                   (SPEC_HEAD=N: drafting over the shortlist's N tokens; SPEC_SKINNY=1: its
#                                   projections swept for the few-row kernel first), and the round
#                                   again with verify attention in the decode kernel (NINFER_FUSED_VERIFY=1); last, in
#                                   what time is left, verify attention alone per launch shape (SPEC_SWEEP=attention,
#                                   scripts/gpu_verify_attention_sweep.py) or the Gated DeltaNet decode and verify
#                                   launch shapes (SPEC_SWEEP=gdn), at gpu-deep's and the 27B's heads (none: neither)
#   scripts/gpu_session.sh serve27  ninfer-serve's startup on the 27B shape, Triton cache cold then warm (#18's 90 s)
#   scripts/gpu_session.sh fla-tune fla's autotuned Gated DeltaNet kernels tuned at the engine's calls, kept as the
#                                   card's table (kernels/triton/fla_configs/; copy in $OUT): run before serve27
#   scripts/gpu_session.sh quant-tests  the quantized-KV, quantized-weight and speculative GPU tests (~4-7 min)
#   scripts/gpu_session.sh new-tests    the GPU tests of what sessions 18-20 changed (quantized weights, packed
#                                   steps, speculative rounds, MoE kernels and graph decode, the output gate)
#   scripts/gpu_session.sh quant-tune   the quantized GEMM table tuned in place, then 27B decode per WEIGHT_FORMATS
#                                   (TUNE_S budget, TUNE_JOBS e.g. fp8:1, TUNE_ARGS e.g. --fp8-tensor-cores or
#                                   --tune-models qwen3.6-27b,qwen3.6-35b-a3b or --shapes 16384x5120;
#                                   BENCH_C concurrencies, BENCH_S seconds a bench; TUNE_WARM (12) processes
#                                   compile the candidates first, in up to 40% of TUNE_S)
#   scripts/gpu_session.sh gemv         the packed FP8/int4 steps for GEMV_WEIGHTS (@fp8-block or @gptq): the
#                                   table tuned at one row, then GEMV_MODEL (qwen3.6-27b) decode at BENCH_C (1)
#                                   packed and value by value (NINFER_PACKED_STEPS=0), beside bf16 (TUNE_S)
#   scripts/gpu_session.sh ratio        FP8-block 27B decode at BENCH_C (1) beside bf16, from the committed table
#   scripts/gpu_session.sh prefill-routes  the 27B's quantized projections at 1k and 8k rows by every route (our tiles,
#                                   dequantize + cuBLAS, block-scaled FP8 cuBLAS) beside bf16 (PROBE_SHAPES, PROBE_FORMATS)
#   scripts/gpu_session.sh staged-tests FP8's one-row step with its words staged through shared memory (a config's
#                                   staged): its GPU tests against the register prefetch
#   scripts/gpu_session.sh quant35      the 35B-A3B per WEIGHT_FORMATS (@fp8-block @gptq @bf16): decode at c=1 and 8, an 8k
#                                   prefill, one build a format (quantized a layer at a time: fits an H100)
#   scripts/gpu_session.sh prefill-quant   the prefill rows of the quantized table tuned in place (TUNE_S), then the
#                                   27B 8k prefill per WEIGHT_FORMATS (@fp8-block @gptq @bf16)
#   scripts/gpu_session.sh int4-ahead   the one-row int4 and FP8 steps with x and the scales loaded a step ahead (a
#                                   config's ahead): the packed steps' GPU tests, then A/B against loading them in
#                                   the step (scripts/gpu_int4_ahead_ab.py; AHEAD_AB=0: the tests alone)
#   scripts/gpu_session.sh profile-quant  PROFILE_MODEL's step (qwen3.6-27b) at c=1 profiled per WEIGHT_FORMATS
#                                   (@gptq @fp8-block @bf16)
#   scripts/gpu_session.sh int4-mma     int4 on the tensor cores (kernels/triton/int4_mma.py): its GPU tests, then
#                                   against the tuned packed steps and bf16 at the 27B's projections, 1 and 8 rows
#   scripts/gpu_session.sh fp8-mma      the same for FP8 (kernels/triton/fp8_mma.py) against the table's FP8 kernels
#   scripts/gpu_session.sh mma-ratio    27B decode at BENCH_C (1) in MMA_FORMAT (int4: GPTQ, fp8: FP8 block) on the
#                                   tensor-core kernel, then on the table's kernels (NINFER_INT4_MMA=0
#                                   or NINFER_FP8_MMA=0), then bf16: #22's ratios both ways (MMA_RUNS: each
#                                   quantized run's environment, one VAR=value a run)
#   scripts/gpu_session.sh int4-check   whole tiny int4 models on CUDA (the tensor-core kernel in them), then the 27B
#                                   int4 decode at BENCH_C (8) on it (INT4_BENCH=0: the tests alone)
#   scripts/gpu_session.sh gemv-ncu     Nsight Compute's counters for one launch of the one-row int4 kernels (tensor
#                                   cores, packed steps), FP8 and bf16 cuBLAS (NCU_CASES fmt:N:K[:rows], scripts/gpu_gemv_ncu.py),
#                                   all into $OUT/ncu.txt
#   scripts/gpu_session.sh kv-sweep     decode attention launch shapes per KV format at 32k/128k, table in place
#                                   (SWEEP_FORMATS, SWEEP_CASES, SWEEP_S, SWEEP_ARGS e.g. --splits 8,16)
#   scripts/gpu_session.sh kvab     27B decode at 8 x 128k (synthetic contexts): bf16, fp8 with the table's
#                                   batch-8 shape, then fp8 with each KV_AB shape (splits/block/warps/stages)
#   scripts/gpu_session.sh kvprof   27B step profiles at 8 x 128k (synthetic contexts) per KV_FORMATS
#   scripts/gpu_session.sh acc      train the default model on the GPU, then the KV formats' accuracy there
#                                   (and the weight formats' with ACC_WEIGHTS=1)
#   scripts/gpu_session.sh weight-tests  the quantized-weight GPU tests alone (TESTS_S seconds)
#   scripts/gpu_session.sh probe    step profiles (per kernel kind) of the 35B-A3B and 27B shapes,
#                                   then prefix reuse on graphs with room for the fp32 warm-up
#
# Several stages run in one command, in order: scripts/gpu_session.sh agent profile27
# (DEADLINE_S=560 keeps them inside one call's ten minutes: later stages and benches are cut short)
#
# Triton's compiled kernels travel between calls: a call unpacks .tcache/triton.tar.gz (carry
# .tcache beside .whl) and leaves the binaries it compiled itself in $OUT/triton.tar.gz (split
# into triton.tar.gz.part-aa, -ab, ... past 15 MiB: one file comes back only up to 16 MiB).
# scripts/gpu_cache_merge.sh DIR merges that into .tcache/ here before the next call. Every
# call starts on a fresh machine, so without it each one compiles every kernel it touches
# again (most of a test stage's minutes: session 34's spec-profile lost its profiles to them).
# Entries are keyed by source and Triton version, so stale ones only take space.
#
# Tables a stage tunes are written in place on the device and copied to $OUT (quant_configs/,
# linear_configs_*.json, ...): copy them into the tree here before the next call, or that
# call runs the old entries (session 24's counters ran the stale int4 shapes that way).
# At most eight files come back from a call (session 40: the ninth, fla-tune's table, was
# left out "(count)"), so a stage whose table matters runs where few others write files.
set -uo pipefail
# DEADLINE_S counts from here: the wheels' install and the cache's unpacking take part of the call too
started=$(date +%s)
export PYTHONUNBUFFERED=1 NINFER_CACHE_DIR=/tmp/ninfer-cache TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .tcache/triton.tar.gz ] && tar -xzf .tcache/triton.tar.gz -C "$TRITON_CACHE_DIR"
touch /tmp/triton-cache.start
save_triton_cache() {
    # what this call compiled (the rest is in .tcache already): binaries, their metadata and any
    # launcher modules; a cache hit reads nothing else, and the IR beside them is two thirds of the bytes
    (cd "$TRITON_CACHE_DIR" && find . -mindepth 2 -maxdepth 2 -newer /tmp/triton-cache.start \
        \( -name '*.json' -o -name '*.cubin' -o -name '*.so' \) -print0 | tar -czf "$OUT/triton.tar.gz" --null -T -)
    [ "$(tar -tzf "$OUT/triton.tar.gz" | head -1)" ] || { rm -f "$OUT/triton.tar.gz"; return; }  # none
    if [ "$(stat -c %s "$OUT/triton.tar.gz")" -gt $((15 * 1024 * 1024)) ]; then
        split -b 15M "$OUT/triton.tar.gz" "$OUT/triton.tar.gz.part-" && rm -f "$OUT/triton.tar.gz"
    fi
    true
}
trap save_triton_cache EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
    | tee -a "$OUT/gpu.txt"
# DEADLINE_S (seconds from the start of this script): no bench runs past it, and a stage
# that would start with under a minute left is skipped, so what ran comes back whole
# (never below 1: `timeout 0` would run unbounded and a negative limit is a usage error)
left() { local r=$(( ${DEADLINE_S:-100000} - ($(date +%s) - started) )); echo $(( r < 1 ? 1 : r )); }
bench() {
    local limit=$1 rest
    rest=$(left); [ "$rest" -lt "$limit" ] && limit=$rest
    [ "$limit" -le 5 ] && { echo "skipped: ninfer-bench ${*:2} (deadline)"; return; }
    timeout "$limit" ninfer-bench "${@:2}" 2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl"
    # a bench cut short prints nothing: say so (session 29 lost two FP8 runs to first-use
    # compiles of a freshly tuned table inside a 80-100 s limit)
    [ "${PIPESTATUS[0]}" = 124 ] && echo "bench timed out after $limit s: ninfer-bench ${*:2}" | tee -a "$OUT/bench.err"
    true
}
stdlib_arg() {
    # `--stdlib DIR` when .corpus/stdlib.tar.gz was carried (scripts/stdlib_corpus.sh: a whole
    # standard library, tests included, which this image's Python lacks), unpacked once a machine
    [ -f .corpus/stdlib.tar.gz ] || return 0
    if [ ! -d /tmp/stdlib ]; then mkdir -p /tmp/stdlib && tar -xzf .corpus/stdlib.tar.gz -C /tmp/stdlib; fi
    echo --stdlib "$(find /tmp/stdlib -mindepth 1 -maxdepth 1 -type d | head -1)"
}
write_heldout() {
    # DIR/heldout.txt: the held-out files DIR's model was evaluated on, as many bytes as its report
    # read (the bench's --spec-prompts and the accuracy scripts' --heldout; session 35's bench read
    # the first 100 KB of a 400 KB held-out split, a few files, and kept 1.82 tokens a round where
    # the report's 64 windows kept 2.09)
    python3 -c "import sys; from ninfer.train.pipeline import trained_corpus
open(sys.argv[1] + '/heldout.txt', 'w').write(chr(10).join(trained_corpus(sys.argv[1]).heldout_texts))" "$1"
}
quant_tests() {
    # three groups at once: Triton compiles most of the time away and compiling is CPU-bound
    # (session 17: the kernel tests took 222 s and the weight tests 204 s side by side)
    timeout 420 python3 -m pytest -q -rf --tb=short tests/test_kv_quant_kernels.py -k "triton or gpu" \
        > "$OUT/pytest_kv.txt" 2>&1 &
    timeout 420 python3 -m pytest -q -rf --tb=short tests/test_kv_quant_gpu.py > "$OUT/pytest_kv_engine.txt" 2>&1 &
    timeout 420 python3 -m pytest -q -rf --tb=short -m gpu tests/test_quant_kernels.py tests/test_packed_gemv.py \
        tests/test_quant_moe_one_token.py tests/test_weight_formats_gpu.py tests/test_cublas_prefill.py \
        > "$OUT/pytest_quant.txt" 2>&1 &
    # the speculative GPU tests (device rounds among them) ride along: spec2's call has no room
    timeout 420 python3 -m pytest -q -rf --tb=short -m gpu tests/test_spec_gpu.py tests/test_spec_verdict.py \
        tests/test_spec_rounds_kernels.py tests/test_train_gpu.py > "$OUT/pytest_spec.txt" 2>&1 &
    wait
    for f in pytest_kv pytest_kv_engine pytest_quant pytest_spec; do echo "$f: $(tail -1 "$OUT/$f.txt")"; done
}
for stage in "${@:-check}"; do
[ "$(left)" -lt 60 ] && { echo "== stage $stage skipped: $(left) s left before DEADLINE_S"; continue; }
case "$stage" in
kvab|kv128x8|kvprof|kvsyn)
    # 8 x 128k tokens of bf16 KV on the 27B shape (69 GB) beside its weights (54 GB)
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    if [ "$mib" -lt 120000 ]; then
        echo "== stage $stage skipped: 8 x 128k of bf16 KV beside the 27B needs an H200 (run's needs_h200);" \
            "this card has $mib MiB"
        continue
    fi
    ;;
esac
echo "== stage $stage ($(date +%T))"
case "$stage" in
check)
    timeout 240 python3 -m pytest -q -x -m gpu tests/test_cuda_graph.py tests/test_moe_kernels.py tests/test_moe_routing.py \
        tests/test_gated_delta_decode.py tests/test_prefill_kernels.py tests/test_skinny_linear.py \
        tests/test_lora.py tests/test_sampler.py tests/test_kernels_triton.py tests/test_decode_attention_kernel.py 2>&1 | tail -15 | tee "$OUT/pytest.txt"
    timeout 60 python3 scripts/gpu_gdn_decode_check.py --out "$OUT/gdn_decode.jsonl" 2>&1 | tail -14
    timeout 60 python3 scripts/gpu_prefill_kernels_check.py --out "$OUT/prefill_kernels.jsonl" 2>&1 | tail -14
    bench 330 random:qwen3.6-27b --dtype bf16 --only bandwidth,decode,prefill --concurrency 1,8 \
        --prefill-lens 8192 --prefill-chunk 8192 --hf-dynamic 1,8 --hf-decode-output-len 64
    ;;
moe)
    # the routing kernel, the fused MoE and graph decode of the MoE families (whose norms now
    # sum the rows); the one-token expert shapes re-swept (their gate/up loop changed in
    # session 19; MOE_TUNE=1 re-tunes the grouped shapes too); then decode of the 35B-A3B
    # (MOE_30B=1: the 30B-A3B too, swept and timed; a call's ten minutes rarely hold both)
    # MOE_TESTS=0 skips the GPU tests and the kernel check (when new-tests already ran them)
    [ "${MOE_TESTS:-1}" = 1 ] && timeout 100 python3 -m pytest -q -x -m gpu tests/test_moe_kernels.py \
        tests/test_cuda_graph.py 2>&1 | tail -3
    models=qwen3.6-35b-a3b$([ "${MOE_30B:-0}" = 1 ] && echo ,qwen3-30b-a3b)
    timeout 200 python3 scripts/gpu_skinny_sweep.py --parts moe --moe-models "$models" --write --out-dir "$OUT" \
        2>&1 | tee "$OUT/moe_one_token_sweep.jsonl" | cut -c1-330
    if [ "${MOE_TUNE:-0}" = 1 ]; then
        card=$(python3 -c "import torch; from ninfer_kernels.triton import fused_moe as f; print(f.device_name(torch.device('cuda')))")
        timeout 170 python3 scripts/gpu_moe_tune.py --budget-s 130 --out "kernels/triton/moe_configs/$card.json" \
            2>&1 | tail -8
    fi
    # (the sweep's --out-dir already holds a copy of the table it wrote, this card's own)
    [ "${MOE_TESTS:-1}" = 1 ] && timeout 90 python3 scripts/gpu_moe_check.py --out "$OUT/moe_check.jsonl" 2>&1 | tail -14
    bench 150 random:qwen3.6-35b-a3b --dtype bf16 --only bandwidth,decode --concurrency 1,8 --no-transformers
    if [ "${MOE_30B:-0}" = 1 ]; then
        bench 150 random:qwen3-30b-a3b --dtype bf16 --only bandwidth,decode --concurrency 1,8 --no-transformers
    fi
    ;;
router-ab)
    # a MoE block's residual add, norm and router matmul in one launch (NINFER_NORM_ROUTER=1,
    # kernels/triton/norm_router.py) against the two launches: its GPU tests, then each of
    # ROUTER_MODELS at c=1 and 8 both ways, the two launches first (ROUTER_TESTS=0: no tests)
    [ "${ROUTER_TESTS:-1}" = 1 ] && timeout 120 python3 -m pytest -q -m gpu tests/test_norm_router.py 2>&1 | tail -3
    for model in ${ROUTER_MODELS:-qwen3.6-35b-a3b qwen3-30b-a3b}; do
        for fused in 0 1; do
            echo "{\"norm_router\": $fused, \"model\": \"$model\"}" | tee -a "$OUT/bench.jsonl"
            NINFER_NORM_ROUTER=$fused bench 150 "random:$model" --dtype bf16 --only decode --concurrency 1,8 \
                --no-transformers
        done
    done
    ;;
ab)
    # switches A/B'd inside whole steps: for each of AB_MODELS (default AB_MODEL, else the
    # 35B-A3B), for each VAR=v1,v2,... group of AB (space-separated), the model at AB_C (1,8)
    # once per value, in order; AB_TESTS first (files or node ids, their GPU tests; none by
    # default; AB_TESTS_S bounds them, 150 s). The table at the end (scripts/ab_table.py) is
    # the comparison.
    [ -n "${AB_TESTS:-}" ] && timeout "${AB_TESTS_S:-150}" python3 -m pytest -q -m gpu $AB_TESTS 2>&1 | tail -3
    ab_bench() {
        echo "{\"ab\": \"$1\", \"model\": \"$2\"}" | tee -a "$OUT/bench.jsonl"
        bench 150 "random:$2" --dtype bf16 --only decode --concurrency "${AB_C:-1,8}" --no-transformers
    }
    for model in ${AB_MODELS:-${AB_MODEL:-qwen3.6-35b-a3b}}; do
        for group in ${AB:?AB=VAR=v1,v2 [VAR=...]}; do
            if [[ $group == *+* ]]; then  # A=1+B=2: one run with both set
                IFS=+ read -ra pairs <<< "$group"
                for pair in "${pairs[@]}"; do export "$pair"; done
                ab_bench "$group" "$model"
                for pair in "${pairs[@]}"; do unset "${pair%%=*}"; done
                continue
            fi
            var=${group%%=*}
            for value in $(echo "${group#*=}" | tr , ' '); do
                export "$var=$value"
                ab_bench "$var=$value" "$model"
            done
            unset "$var"
        done
    done
    python3 scripts/ab_table.py "$OUT/bench.jsonl"  # the comparison, in the call's output tail
    ;;
moe35)
    # the 35B-A3B decode alone, from the committed tables (no tests, no sweep)
    bench 170 random:qwen3.6-35b-a3b --dtype bf16 --only bandwidth,decode --concurrency 1,8 --no-transformers
    ;;
moe30)
    # the 30B-A3B decode alone, from the committed tables
    bench 170 random:qwen3-30b-a3b --dtype bf16 --only bandwidth,decode --concurrency 1,8 --no-transformers
    ;;
pdl-ab)
    # kernels letting the next one launch only at their exit (NINFER_PDL_TRIGGER=0) against
    # right after their own wait (the default since session 22, kernels/triton/pdl.py), in one
    # call: PDL_MODEL at PDL_C both ways (the switch changes every kernel's cache key: the
    # first run each way compiles), then the graph-decode and MoE GPU tests with the trigger;
    # PDL_27B=1: the 27B at c=1 both ways too
    for trigger in 0 1; do
        NINFER_PDL_TRIGGER=$trigger bench 180 "random:${PDL_MODEL:-qwen3.6-35b-a3b}" --dtype bf16 \
            --only bandwidth,decode --concurrency "${PDL_C:-1,8}" --no-transformers
    done
    if [ "${PDL_TESTS:-1}" = 1 ]; then
        limit=$(left); [ "$limit" -gt 200 ] && limit=200
        NINFER_PDL_TRIGGER=1 timeout "$limit" python3 -m pytest -q -rf --tb=short -m gpu tests/test_cuda_graph.py \
            tests/test_moe_kernels.py > "$OUT/pytest_trigger.txt" 2>&1
        echo "pytest_trigger: $(tail -1 "$OUT/pytest_trigger.txt")"
        grep -E "^(FAILED|ERROR)" "$OUT/pytest_trigger.txt" | head -8
    fi
    if [ "${PDL_27B:-0}" = 1 ]; then
        for trigger in 0 1; do
            NINFER_PDL_TRIGGER=$trigger bench 150 random:qwen3.6-27b --dtype bf16 --only decode --concurrency 1 \
                --decode-output-len 128 --no-transformers
        done
    fi
    ;;
segments)
    # the dense rows quantized checkpoints keep beside quantized ones (the 27B in_proj's 96
    # b/a rows, cuBLAS's 64x8 tile at about 9 us a layer in session 26's profile) on the
    # few-row kernel where it beats cuBLAS (table written in place, a copy in $OUT)
    timeout 200 python3 scripts/gpu_skinny_sweep.py --parts linear --linear-models "${SEGMENT_MODELS:-qwen3.6-27b}" \
        --rows "${SEGMENT_ROWS:-1,8}" --dense-segments --write --out-dir "$OUT" > "$OUT/segments_sweep.jsonl" 2>&1
    grep '"linear"' "$OUT/segments_sweep.jsonl" | cut -c1-300
    ;;
skinny-ab)
    # projections on the few-row kernel in whole steps. The sweep times back-to-back calls of
    # one kernel, where cuBLAS won the projections (session 8); inside a step the kernel's
    # PDL start (its first weight tile fetched before the wait) may overlap the
    # latency-bound kernel before it, which cuBLAS cannot. The 35B-A3B's linear table is
    # rewritten with every shape within SKINNY_MARGIN (0.15) of cuBLAS, then decode; then
    # the committed table and decode again (the peer), in one call
    rm -rf /tmp/linear_committed && cp -r kernels/triton/linear_configs /tmp/linear_committed
    timeout 240 python3 scripts/gpu_skinny_sweep.py --parts linear --linear-models qwen3.6-35b-a3b --rows 1,8 \
        --margin=-"${SKINNY_MARGIN:-0.15}" --write --out-dir "$OUT" > "$OUT/skinny_ab_sweep.jsonl" 2>&1
    grep '"linear"' "$OUT/skinny_ab_sweep.jsonl" | grep '"rows": 1,' | cut -c1-260
    bench 150 random:qwen3.6-35b-a3b --dtype bf16 --only bandwidth,decode --concurrency 1,8 --no-transformers
    rm -rf kernels/triton/linear_configs && cp -r /tmp/linear_committed kernels/triton/linear_configs
    bench 150 random:qwen3.6-35b-a3b --dtype bf16 --only decode --concurrency 1,8 --no-transformers
    ;;
profile35)
    # PROFILE_MODEL's step (35B-A3B) at PROFILE_C (1) under the profiler, the host's side included (where the
    # bench's step and its graph replay part), once per PROFILE_PDL value (1: launched with PDL,
    # as served; 0: without, where each kernel's time is its own and not its wait for the one before)
    for pdl_on in ${PROFILE_PDL:-1}; do
        NINFER_PDL=$pdl_on timeout 200 python3 scripts/gpu_step_profile.py "random:${PROFILE_MODEL:-qwen3.6-35b-a3b}" \
            --concurrency "${PROFILE_C:-1}" --steps 20 --top 30 --host 2>&1 \
            | tee "$OUT/profile_${PROFILE_MODEL:-qwen3.6-35b-a3b}_pdl$pdl_on.jsonl" \
            | cut -c1-9000 | tail -80
    done
    ;;
gdn-splits)
    # the Gated DeltaNet decode launch's value splits inside whole steps (NINFER_GDN_VALUE_SPLITS):
    # GDN_MODEL (35B-A3B) at GDN_C (1) per GDN_SPLITS, the default (4 at batch 1) first
    for splits in ${GDN_SPLITS:-4 2 1 8}; do
        echo "{\"gdn_value_splits\": $splits}" | tee -a "$OUT/bench.jsonl"
        NINFER_GDN_VALUE_SPLITS=$splits bench 100 "random:${GDN_MODEL:-qwen3.6-35b-a3b}" --dtype bf16 --only decode \
            --concurrency "${GDN_C:-1}" --no-transformers
    done
    ;;
launch-floor)
    # what one link of a chain of dependent launches costs in a replayed graph, PDL on and off,
    # for a one-element, a norm-sized and a full-grid payload (scripts/gpu_launch_floor.py)
    timeout 120 python3 scripts/gpu_launch_floor.py 2>&1 | tee "$OUT/launch_floor.jsonl"
    ;;
gate-tests)
    # session 20's output gate inside the decode kernels, graph decode with it, the MoE kernels
    limit=$(left); [ "$limit" -gt 300 ] && limit=300
    timeout "$limit" python3 -m pytest -q -rf --tb=short tests/test_decode_attention_kernel.py tests/test_kernels_triton.py \
        tests/test_kv_quant_kernels.py -k "decode_attention or one_launch or output_gate" > "$OUT/pytest_gate.txt" 2>&1 &
    timeout "$limit" python3 -m pytest -q -rf --tb=short -m gpu tests/test_cuda_graph.py tests/test_moe_kernels.py \
        > "$OUT/pytest_graph.txt" 2>&1 &
    wait
    for f in pytest_gate pytest_graph; do echo "$f: $(tail -1 "$OUT/$f.txt")"; grep -E "^(FAILED|ERROR)" "$OUT/$f.txt" | head -8; done
    ;;
presets)
    # what a request naming no sampler settings gets on the 27B shape (Qwen3.5's presets: top-k,
    # top-p, presence penalty; since session 19 its rows run ahead) beside plain greedy, one command
    for sampling in greedy presets; do
        bench 150 random:qwen3.6-27b --dtype bf16 --only decode --concurrency 1,8 --decode-prompt-len 512 \
            --decode-output-len "${PRESET_OUT:-512}" --sampling "$sampling" --no-transformers
    done
    ;;
dense)
    bench 200 random:qwen3-8b --dtype bf16 --only bandwidth,decode --concurrency 1,8 --no-transformers
    timeout 120 python3 scripts/gpu_prefix_reuse_check.py --dtype fp32 2>&1 | tail -22
    ;;
skinny)
    timeout 120 python3 -m pytest -q -x -m gpu tests/test_skinny_linear.py tests/test_moe_kernels.py 2>&1 \
        | tail -3 | tee "$OUT/pytest.txt"
    timeout 200 python3 scripts/gpu_skinny_sweep.py --write --out-dir "$OUT" 2>&1 | tee "$OUT/skinny_sweep.jsonl" \
        | grep -v '"config"' | cut -c1-330
    timeout 60 python3 scripts/gpu_prefill_attention_sweep.py 2>&1 | tee "$OUT/prefill_attention.jsonl" | cut -c1-200
    bench 150 random:qwen3.6-35b-a3b --dtype bf16 --only bandwidth,decode --concurrency 1,8 --no-transformers
    ;;
prefill)
    timeout 60 python3 -m pytest -q -x -m gpu tests/test_prefill_kernels.py 2>&1 \
        | tail -2 | tee "$OUT/pytest.txt"
    bench 260 random:qwen3.6-27b --dtype bf16 --only prefill --prefill-lens 8192 --prefill-chunk 8192
    bench 130 random:qwen3-30b-a3b --dtype bf16 --only bandwidth,decode --concurrency 1,8 --no-transformers
    ;;
prefill27)
    bench 230 random:qwen3.6-27b --dtype bf16 --only prefill --prefill-lens 8192 --prefill-chunk 8192
    ;;
insitu)
    timeout 220 python3 scripts/gpu_step_profile.py random:qwen3.6-35b-a3b --concurrency 1,8 --steps 20 --top 40 \
        --host 2>&1 | tee "$OUT/profile_35b.jsonl" | grep -v "^ " | cut -c1-6000 | tail -4
    (export NINFER_SKINNY_LINEAR=0 NINFER_MOE_ONE_TOKEN=0; timeout 130 python3 scripts/gpu_step_profile.py \
        random:qwen3.6-35b-a3b --concurrency 1 --steps 20 --top 40 2>&1 | tee "$OUT/profile_35b_before.jsonl" | tail -1)
    timeout 170 python3 scripts/gpu_step_profile.py random:qwen3.6-27b --prefill 8192 --top 30 2>&1 \
        | tee "$OUT/profile_27b_prefill.jsonl" | tail -1
    ;;
spec)
    timeout 220 python3 -m pytest -q -m gpu tests/test_spec_gpu.py tests/test_spec_verdict.py \
        tests/test_gated_delta_decode.py tests/test_cuda_graph.py 2>&1 | tail -30 | tee "$OUT/pytest.txt"
    timeout 60 python3 -m pytest -q tests/test_kernels_triton.py -k copy_state_rows 2>&1 | tail -2
    bench 300 random:qwen3.6-27b --dtype bf16 --only spec_cost --spec mtp --draft-tokens 3 \
        --spec-context 512,32768 --no-transformers
    if [ -n "${TRAINED:-}" ]; then
        bench 240 "$TRAINED" --dtype bf16 --only decode --spec mtp --draft-tokens 1,2,3,4,5 --concurrency 1,8 \
            --decode-prompt-len 256 --decode-output-len 256 --spec-prompts "$TRAINED/heldout.txt" --no-transformers
    fi
    ;;
spec-head)
    # the spec's headline on the 27B shape: a k=3 round drafting over the full 248k-entry LM head,
    # then over the --lm-head-draft shortlist (HEAD_SIZES: what #19's 2x hangs on, so second), then
    # with verify attention in the decode kernel (NINFER_FUSED_VERIFY=1: one launch a layer, the
    # peer of the default four; session 35 measured it slower). SPEC_REPORT (a ninfer-train
    # train_report.json, e.g. spec2's, carried in): the implied speedups at that model's round
    # acceptance instead of the default rates. HEAD_FULL=0 / HEAD_FUSED=0 leave out the first and
    # the last run (a call with little device time left: the shortlist's run alone)
    cost27() { bench 200 random:qwen3.6-27b --dtype bf16 --only spec_cost --spec mtp --draft-tokens 3 \
        --spec-context 512,32768 ${SPEC_REPORT:+--spec-acceptance "$SPEC_REPORT"} --no-transformers "$@"; }
    [ "${HEAD_FULL:-1}" = 1 ] && cost27
    for head in ${HEAD_SIZES:-32768}; do cost27 --lm-head-draft "$head"; done
    [ "${HEAD_FUSED:-1}" = 1 ] && NINFER_FUSED_VERIFY=1 cost27
    true
    ;;
spec2)
    # SPEC_BENCH_S=0 skips the benches (a call that only trains: the next call on the warm machine
    # benches the same model). The spec GPU tests run with quant-tests (SPEC_TESTS=1 runs them
    # here too): training and the benches fill this call
    if [ "${SPEC_TESTS:-0}" = 1 ]; then
        timeout 150 python3 -m pytest -q -m gpu tests/test_spec_verdict.py tests/test_spec_gpu.py 2>&1 | tail -3
    fi
    # Carry .corpus too (scripts/stdlib_corpus.sh): it trains on a whole standard library, tests
    # included, which this image's Python lacks (session 35: 2.1M tokens, ten passes in 440 s).
    # A warm machine keeps /tmp: a model trained by the previous call is reused. TRAIN_S caps the
    # training loop (ninfer-train --train-seconds: the run takes the preset's steps that fit), so
    # the call always ends with a checkpoint; corpus, tokenizer and evaluation come on top
    trained=/tmp/trained-${TRAIN_PRESET:-gpu}
    if [ ! -f $trained/config.json ] && [ "${TRAIN_TESTS:-1}" = 1 ]; then
        # the captured training step against the eager loop first; should it fail, train eagerly
        # (TRAIN_TESTS=0: not, when they passed in an earlier call and the call's minutes are for training)
        timeout 120 python3 -m pytest -q -rf --tb=short tests/test_train_gpu.py > "$OUT/pytest_train.txt" 2>&1 \
            || export NINFER_TRAIN_GRAPH=0
        echo "pytest_train: $(tail -1 "$OUT/pytest_train.txt") (NINFER_TRAIN_GRAPH=${NINFER_TRAIN_GRAPH:-1})"
    fi
    if [ ! -f $trained/config.json ]; then
        timeout "$(( ${TRAIN_S:-300} + 150 ))" ninfer-train $trained --device cuda --preset "${TRAIN_PRESET:-gpu}" \
            --train-seconds "${TRAIN_S:-300}" ${TRAIN_STEPS:+--steps "$TRAIN_STEPS"} $(stdlib_arg) -q \
            | tee "$OUT/train.json"
        # the report comes back from the call that trained only: at most 8 files come back a call
        cp $trained/train_report.json "$OUT/" 2>/dev/null
    fi
    write_heldout $trained
    bench "${SPEC_BENCH_S:-200}" $trained --dtype bf16 --only decode --spec mtp --draft-tokens "${DRAFTS:-1,2,3,4,5}" \
        --concurrency "${SPEC_C:-1,8}" --decode-prompt-len 128 --decode-output-len 256 --spec-prompts $trained/heldout.txt \
        --no-transformers
    # SPEC_AB: k=3 again under each VAR=value[,VAR=value] (e.g. NINFER_PDL=0: session 40's
    # speculating engine replays its decode graph faster without PDL than in the slow state)
    for ab in ${SPEC_AB:-}; do
        echo "{\"spec_ab\": \"$ab\"}" | tee -a "$OUT/bench.jsonl"
        (export ${ab//,/ }; bench 150 $trained --dtype bf16 --only decode --spec mtp --draft-tokens 3 \
            --concurrency 1,8 --decode-prompt-len 128 --decode-output-len 256 --spec-prompts $trained/heldout.txt \
            --no-transformers)
    done
    # the peer: the same k=3 rounds driven from the host (no device rounds, none launched ahead)
    [ "${SPEC_HOST_PEER:-1}" = 1 ] && NINFER_DEVICE_ROUNDS=0 bench 120 $trained --dtype bf16 --only decode --spec mtp --draft-tokens 3 \
        --concurrency 1,8 --decode-prompt-len 128 --decode-output-len 256 --spec-prompts $trained/heldout.txt \
        --no-transformers
    # last (a bench cut short keeps only the rows it printed, so the headline goes first): the engine's acceptance
    # on the GPU against the trainer's chain on the same prompts (SPEC_CHECK=0: not)
    limit=$(left); [ "$limit" -gt 150 ] && limit=150
    [ "${SPEC_CHECK:-1}" = 1 ] && timeout "$limit" python3 scripts/spec_acceptance_check.py $trained \
        --preset "${TRAIN_PRESET:-gpu}" --device cuda --dtype bf16 --trainer-device cuda \
        2>>"$OUT/acceptance_check.err" | tee "$OUT/acceptance_check.jsonl" | cut -c1-300
    true
    ;;
train-ab)
    # the training loop's speed per way of running the delta rule: the GPU training tests first
    # (the fla rule against the float32 one, TRAIN_AB_TESTS=0: not), then TRAIN_PRESET (gpu-deep)
    # trained TRAIN_AB_S (90) seconds per variant of TRAIN_AB ("fp32 tf32 fla": full float32,
    # TF32 (the default since session 39), fla's chunked kernels), each line tagged; compare
    # their steps and perplexity
    if [ "${TRAIN_AB_TESTS:-1}" = 1 ]; then
        timeout 150 python3 -m pytest -q -rf --tb=short tests/test_train_gpu.py 2>&1 | tail -4
    fi
    for variant in ${TRAIN_AB:-fp32 tf32 fla}; do
        [ "$(left)" -lt $(( ${TRAIN_AB_S:-90} + 60 )) ] && { echo "train-ab $variant skipped: $(left) s left"; break; }
        tf32=1 fla=0
        [ "$variant" = fp32 ] && tf32=0
        [ "$variant" = fla ] && fla=1
        NINFER_TRAIN_TF32=$tf32 NINFER_TRAIN_FLA=$fla timeout $(( ${TRAIN_AB_S:-90} + 120 )) ninfer-train \
            /tmp/train-ab-$variant --device cuda --preset "${TRAIN_PRESET:-gpu-deep}" --train-seconds "${TRAIN_AB_S:-90}" \
            $(stdlib_arg) -q 2>>"$OUT/train_ab.err" | sed "s/^{/{\"variant\": \"$variant\", /" | tee -a "$OUT/train_ab.jsonl" \
            | cut -c1-400
    done
    ;;
gap)
    # #19's plain-peer question on a random-weight gpu-deep shape (speed only): one random
    # prompt, 16 pooled random prompts and 16 pooled text windows, on the first engine of the
    # process and on a second one (scripts/gpu_plain_gap.py; sessions 34 and 36: the bench's
    # single prompt stepped 11% faster than its pooled text sample)
    mkdir -p /tmp/gap && src=$(stdlib_arg | cut -d' ' -f2)
    cat "$src"/dataclasses.py "$src"/argparse.py "$src"/subprocess.py > /tmp/gap/text.txt
    limit=$(left); [ "$limit" -gt 200 ] && limit=200
    timeout "$limit" python3 scripts/gpu_plain_gap.py random:train-gpu-deep --text /tmp/gap/text.txt \
        2>>"$OUT/gap.err" | tee "$OUT/gap.jsonl"
    ;;
slowdown)
    # what slows every engine's decode graph once more graphs are captured (session 39, H100:
    # the batch-1 replay 0.87 -> 0.98 ms after two small extra graphs, device time, only with
    # PDL on): scripts/gpu_engine_slowdown.py's capture-by-capture probe (empties, captures,
    # side streams), then the same with NINFER_PDL=0, then the speculating engine first in its
    # process on the default and on a side stream. SLOWDOWN_PARTS picks (graphs nopdl late fresh
    # prelaunch spec first; late: the graphs probe with kernels letting the next launch at their
    # exit; fresh: small graphs captured before the engine; prelaunch: after it, before any launch)
    # PART:VAR=value[,VAR=value] runs PART with that environment (graphs:CUDA_DEVICE_MAX_CONNECTIONS=1;
    # spec:NINFER_GRAPH_SHARE=1;
    # shared:NINFER_GRAPH_SHARE=1: which graphs on the engine's own stream and pool slow it;
    # trigger-pdl, trigger-plain, trigger-torch, trigger-eager: four extra graphs of one kind, then the
    # engine's graphs captured again; rounds: a speculating engine's round graph; buckets: every decode
    # bucket's replay, buckets:NINFER_PDL=0 its peer)
    for part in ${SLOWDOWN_PARTS:-graphs nopdl late fresh prelaunch spec}; do
        limit=$(left); [ "$limit" -gt 120 ] && limit=120
        extra=; case "$part" in *:*) extra=${part#*:}; extra=${extra//,/ }; part=${part%%:*} ;; esac
        pdl=1 trigger=1 arg=$part kind=pdl
        [ "$part" = nopdl ] && { pdl=0; arg=graphs; }
        [ "$part" = late ] && { trigger=0; arg=graphs; }
        case "$part" in trigger-*) kind=${part#trigger-}; arg=trigger ;; esac
        echo "== slowdown --part $arg --graphs $kind (NINFER_PDL=$pdl NINFER_PDL_TRIGGER=$trigger $extra)"
        env NINFER_PDL=$pdl NINFER_PDL_TRIGGER=$trigger $extra timeout "$limit" python3 scripts/gpu_engine_slowdown.py \
            random:train-gpu-deep --part "$arg" --graphs "$kind" 2>>"$OUT/slowdown.err" | sed "s/^{/{\"env\": \"$extra\", /" \
            | tee -a "$OUT/slowdown.jsonl" | cut -c1-240
    done
    ;;
spec-gap)
    # the engine against the trainer's own greedy rounds on the same held-out prompts, one switch
    # at a time. mean_common_prefix low: the target's forward differs (a kernel at this shape);
    # drafts_equal_to_trainer low with it high: the drafting path. Session 34 (H100): bf16 with
    # graphs and device rounds, and eager with host rounds, both within 0.004 of the trainer, so
    # session 32's low bench figure was not the engine. A short-trained GAP_PRESET model is
    # enough (its logits are no longer flat); a warm machine's is reused
    gap=/tmp/trained-gap-${GAP_PRESET:-gpu-deep}
    [ -f $gap/config.json ] || timeout $(( ${GAP_TRAIN_S:-60} + 150 )) ninfer-train $gap --device cuda \
        --preset "${GAP_PRESET:-gpu-deep}" --train-seconds "${GAP_TRAIN_S:-60}" $(stdlib_arg) -q | tee "$OUT/train_gap.json"
    # the bench's own setting first (bf16, graphs, device rounds), then one switch at a time
    for how in "--dtype bf16" "--dtype bf16 --no-cuda-graph" "--dtype fp32" "--dtype bf16 --host-rounds" \
               "--dtype fp32 --no-cuda-graph"; do
        [ "$(left)" -lt 40 ] && { echo "skipped: acceptance check $how (deadline)"; continue; }
        flags=${how/--host-rounds/}
        env $([ "$flags" != "$how" ] && echo NINFER_DEVICE_ROUNDS=0) timeout 150 python3 \
            scripts/spec_acceptance_check.py $gap --preset "${GAP_PRESET:-gpu-deep}" --device cuda --trainer-device cuda \
            --prompts 16 --prompt-len 128 --new-tokens 128 $flags 2>>"$OUT/acceptance_gap.err" \
            | sed "s|^|$how: |" | tee -a "$OUT/acceptance_gap.jsonl" | cut -c1-700
    done
    # the bench's sample (now spread over the held-out text) on the same model
    write_heldout $gap
    bench 120 $gap --dtype bf16 --only decode --spec mtp --draft-tokens 3 --concurrency 1,8 --decode-prompt-len 128 \
        --decode-output-len 256 --spec-prompts $gap/heldout.txt --no-transformers
    ;;
agent)
    bench 330 random:qwen3.6-27b --dtype bf16 --workload agent --agents 4 --turns 10 --agent-over-capacity 8 \
        --prefill-chunk 4096
    ;;
kv128)
    for kv in ${KV_FORMATS:-bf16 fp8}; do
        bench 180 random:qwen3.6-27b --dtype bf16 --kv-dtype "$kv" --only decode --concurrency 1 \
            --decode-prompt-len 131072 --decode-output-len 64 --no-transformers
        # 512 tokens each: the first requests decode while the later ones prefill, and the
        # figure needs all 8 decoding at once (full_batch)
        bench 200 random:qwen3.6-27b --dtype bf16 --kv-dtype "$kv" --only decode --concurrency 8 \
            --decode-prompt-len 32768 --decode-output-len 512 --no-transformers
    done
    ;;
kvsyn)
    # every KV format at c=1 and 8 over 32k and 128k contexts, filled without a prefill
    # (--synthetic-context): the decode side of issue #21's table in minutes, not an hour
    timeout 150 python3 -m pytest -q tests/test_kv_quant_kernels.py -k "triton_attention or decode_rows or fp16" 2>&1 | tail -2
    for kv in ${KV_FORMATS:-bf16 fp8}; do
        bench 200 random:qwen3.6-27b --dtype bf16 --kv-dtype "$kv" --only bandwidth,decode --concurrency 1,8 \
            --decode-prompt-len 32768,131072 --decode-output-len "${KV_OUT:-128}" --synthetic-context --no-transformers
    done
    ;;
kv128x8)
    # issue #21's batch-8 goal lives at long contexts (at 8 x 32k the KV is a quarter of a
    # step's bytes): 8 x 128k prompts, about 4 minutes of prefill a format
    for kv in ${KV_FORMATS:-bf16 fp8}; do
        bench 290 random:qwen3.6-27b --dtype bf16 --kv-dtype "$kv" --only decode --concurrency 8 \
            --decode-prompt-len 131072 --decode-output-len 512 --prefill-chunk 16384 --no-transformers
    done
    ;;
kv)
    timeout 150 python3 -m pytest -q tests/test_kv_quant.py tests/test_kv_quant_kernels.py 2>&1 | tail -3 | tee "$OUT/pytest.txt"
    for fmt in ${KV_FORMATS:-bf16 fp8 k8v4}; do
        bench 170 random:qwen3.6-27b --dtype bf16 --kv-dtype "$fmt" --only bandwidth,decode --concurrency 1,8 \
            --decode-prompt-len "${KV_CONTEXT:-32768}" --decode-output-len 128 --no-transformers
    done
    ;;
validate)
    timeout 200 python3 -m pytest -q -m gpu tests/test_spec_gpu.py tests/test_spec_verdict.py \
        tests/test_gated_delta_decode.py tests/test_cuda_graph.py 2>&1 | tail -30 | tee "$OUT/pytest_spec.txt"
    timeout 150 python3 -m pytest -q tests/test_kv_quant.py tests/test_kv_quant_kernels.py tests/test_kv_quant_gpu.py 2>&1 | tail -30 \
        | tee "$OUT/pytest_kv.txt"
    for fmt in ${KV_FORMATS:-bf16 fp8}; do
        bench 130 random:qwen3.6-27b --dtype bf16 --kv-dtype "$fmt" --only decode --concurrency 1,8 \
            --decode-prompt-len "${KV_CONTEXT:-32768}" --decode-output-len 64 --no-transformers
    done
    ;;
quant-tests)
    quant_tests
    ;;
new-tests)
    # the GPU tests of what sessions 18-20 changed, four groups at once: the quantized
    # kernels and packed steps with the weight formats, the speculative rounds (device
    # rounds among them), the MoE kernels and graph decode (the quantized-KV tests, unchanged
    # since they last passed, stay out)
    timeout 420 python3 -m pytest -q -rf --tb=short -m gpu tests/test_quant_kernels.py tests/test_packed_gemv.py \
        tests/test_quant_moe_one_token.py tests/test_weight_formats_gpu.py > "$OUT/pytest_quant.txt" 2>&1 &
    timeout 420 python3 -m pytest -q -rf --tb=short -m gpu tests/test_spec_gpu.py tests/test_spec_verdict.py \
        tests/test_spec_rounds_kernels.py tests/test_train_gpu.py > "$OUT/pytest_spec.txt" 2>&1 &
    timeout 420 python3 -m pytest -q -rf --tb=short -m gpu tests/test_moe_kernels.py tests/test_cuda_graph.py \
        > "$OUT/pytest_moe.txt" 2>&1 &
    # session 20: the output gate inside the bf16 and quantized one-launch decode kernels
    timeout 420 python3 -m pytest -q -rf --tb=short tests/test_decode_attention_kernel.py tests/test_kernels_triton.py \
        tests/test_kv_quant_kernels.py -k "decode_attention or one_launch or output_gate" > "$OUT/pytest_gate.txt" 2>&1 &
    wait
    for f in pytest_quant pytest_spec pytest_moe pytest_gate; do echo "$f: $(tail -1 "$OUT/$f.txt")"; grep -E "^(FAILED|ERROR)" "$OUT/$f.txt" | head -8; done
    ;;
quant)
    # the GPU tests no longer fit beside these (about 8 minutes): quant-tests, a call of its own
    for fmt in ${WEIGHT_FORMATS:-@fp8-block @bf16}; do
        bench "${BENCH_S:-110}" "random:qwen3.6-27b${fmt%@bf16}" --dtype bf16 --only bandwidth,decode \
            --concurrency "${BENCH_C:-1,8}" \
            --decode-prompt-len 512 --decode-output-len 64 --no-transformers
    done
    for kv in ${KV_FORMATS:-fp8}; do
        bench 90 random:qwen3.6-27b --dtype bf16 --kv-dtype "$kv" --only decode --concurrency 1 \
            --decode-prompt-len "${KV_CONTEXT:-32768}" --decode-output-len 64 --no-transformers
    done
    ;;
quant-sweep)
    timeout 170 python3 scripts/gpu_quant_gemm_sweep.py --parts linear,moe --budget-s 140 --out-dir "$OUT" \
        > "$OUT/quant_sweep.jsonl" 2> "$OUT/quant_sweep.err"; tail -3 "$OUT/quant_sweep.err"
    ;;
quant-tune)
    # tune the quantized GEMM launch table (written in place, a copy in $OUT), then the 27B decode with it
    timeout "$(( ${TUNE_S:-180} + 60 ))" python3 scripts/gpu_quant_gemm_sweep.py --parts tune \
        --budget-s "${TUNE_S:-180}" --warm "${TUNE_WARM:-12}" --jobs "${TUNE_JOBS:-}" ${TUNE_ARGS:-} --write --out-dir "$OUT" \
        > "$OUT/quant_tune.jsonl" \
        2> "$OUT/quant_tune.err"; tail -3 "$OUT/quant_tune.err"; grep -c best_us "$OUT/quant_tune.jsonl"
    for fmt in ${WEIGHT_FORMATS:-@fp8-block @bf16}; do
        # the new table's kernels compile on first use inside the bench (FP8 at c=1 took more
        # than 100 s on a fresh compile cache in session 29)
        bench "${BENCH_S:-180}" "random:qwen3.6-27b${fmt%@bf16}" --dtype bf16 --only bandwidth,decode \
            --concurrency "${BENCH_C:-1,8}" \
            --decode-prompt-len 512 --decode-output-len 64 --no-transformers
    done
    ;;
gemv)
    # the packed steps (FP8 words, int4 fp16 pairs) for GEMV_WEIGHTS (one format a call):
    # its one-row table entries tuned, then 27B decode at c=1 packed, value by value
    # (NINFER_PACKED_STEPS=0) and bf16, in one command
    weights="${GEMV_WEIGHTS:-@fp8-block}"
    job=$([ "$weights" = "@fp8-block" ] && echo fp8:1 || echo int4:1)
    timeout "$(( ${TUNE_S:-120} + 60 ))" python3 scripts/gpu_quant_gemm_sweep.py --parts tune \
        --budget-s "${TUNE_S:-120}" --warm "${TUNE_WARM:-12}" --jobs "$job" --write --out-dir "$OUT" > "$OUT/quant_tune.jsonl" \
        2> "$OUT/quant_tune.err"; tail -3 "$OUT/quant_tune.err"; grep -c best_us "$OUT/quant_tune.jsonl"
    for packed in 1 0; do
        NINFER_PACKED_STEPS=$packed bench 110 "random:${GEMV_MODEL:-qwen3.6-27b}$weights" --dtype bf16 --only bandwidth,decode \
            --concurrency "${BENCH_C:-1}" --decode-prompt-len 512 --decode-output-len 64 --no-transformers
    done
    bench 90 "random:${GEMV_MODEL:-qwen3.6-27b}" --dtype bf16 --only decode --concurrency "${BENCH_C:-1}" --decode-prompt-len 512 \
        --decode-output-len 64 --no-transformers
    ;;
ratio)
    # RATIO_WEIGHTS (@fp8-block) 27B decode beside bf16, from the committed tuned table (no tuning): #22's ratios
    for fmt in ${RATIO_WEIGHTS:-@fp8-block}; do
        bench 150 "random:${GEMV_MODEL:-qwen3.6-27b}$fmt" --dtype bf16 --only bandwidth,decode \
            --concurrency "${BENCH_C:-1}" --decode-prompt-len 512 --decode-output-len 64 --no-transformers
    done
    bench 200 "random:${GEMV_MODEL:-qwen3.6-27b}" --dtype bf16 --only decode --concurrency "${BENCH_C:-1}" \
        --decode-prompt-len 512 --decode-output-len 64 --no-transformers
    ;;
prefill-routes)
    # which code should run a quantized projection at prefill sizes (scripts/gpu_prefill_gemm_probe.py)
    limit=$(left); [ "$limit" -gt 300 ] && limit=300
    timeout "$limit" python3 scripts/gpu_prefill_gemm_probe.py --shapes "${PROBE_SHAPES:-5}" \
        --formats "${PROBE_FORMATS:-fp8,int4,nvfp4}" 2>"$OUT/prefill_routes.err" | tee "$OUT/prefill_routes.jsonl" | cut -c1-260
    tail -3 "$OUT/prefill_routes.err"
    ;;
int4-ahead)
    # the one-row steps with x and the scales loaded a step ahead: GPU tests, then against loading them in the step
    timeout 240 python3 -m pytest -q -rf --tb=short -m gpu tests/test_packed_gemv.py > "$OUT/pytest_packed.txt" 2>&1
    echo "packed-step GPU tests: $(tail -1 "$OUT/pytest_packed.txt")"
    [ "${AHEAD_AB:-1}" = 1 ] && timeout 150 python3 scripts/gpu_int4_ahead_ab.py 2>"$OUT/int4_ahead.err" | tee "$OUT/int4_ahead.jsonl" | cut -c1-400
    [ -f "$OUT/int4_ahead.err" ] && tail -2 "$OUT/int4_ahead.err"
    ;;
int4-mma|fp8-mma)
    # compiling is most of it: eight processes
    fmt=${stage%-mma}
    timeout 200 python3 -m pytest -q -rf --tb=short -n 8 -m gpu "tests/test_${fmt}_mma.py" > "$OUT/pytest_${fmt}_mma.txt" 2>&1
    echo "$fmt MMA GPU tests: $(tail -1 "$OUT/pytest_${fmt}_mma.txt")"
    grep -E "^(FAILED|ERROR)" "$OUT/pytest_${fmt}_mma.txt" | head -8
    grep -E "^E  " "$OUT/pytest_${fmt}_mma.txt" | head -12
    limit=$(left); [ "$limit" -gt 300 ] && limit=300
    timeout "$limit" python3 scripts/gpu_mma_ab.py --format "$fmt" --rows "${MMA_ROWS:-1,8}" ${MMA_ARGS:-} \
        2>"$OUT/${fmt}_mma.err" | tee "$OUT/${fmt}_mma.jsonl" | cut -c1-700
    tail -2 "$OUT/${fmt}_mma.err"
    ;;
mma-ratio)
    # MMA_FORMAT int4 (GPTQ) or fp8 (FP8 block): the tensor-core kernel, then the table's kernels, then bf16
    case ${MMA_FORMAT:-int4} in
        int4) quant=gptq switch=NINFER_INT4_MMA ;;
        fp8) quant=fp8-block switch=NINFER_FP8_MMA ;;
    esac
    # MMA_RUNS: the environment of each quantized run (default: the kernel on, then off)
    for run in ${MMA_RUNS:-$switch=1 $switch=0}; do
        echo "{\"run\": \"$run\"}" | tee -a "$OUT/bench.jsonl"
        env "$run" bash -c "$(declare -f bench left); started=$started OUT=$OUT; bench 150 \
            random:${GEMV_MODEL:-qwen3.6-27b}@$quant --dtype bf16 --only bandwidth,decode \
            --concurrency ${BENCH_C:-1} --decode-prompt-len 512 --decode-output-len 64 --no-transformers"
    done
    bench 200 "random:${GEMV_MODEL:-qwen3.6-27b}" --dtype bf16 --only decode --concurrency "${BENCH_C:-1}" \
        --decode-prompt-len 512 --decode-output-len 64 --no-transformers
    ;;
int4-check)
    timeout 120 python3 -m pytest -q -rf --tb=short -n 8 -m gpu tests/test_weight_formats_gpu.py -k "awq or gptq or w4a16" \
        > "$OUT/pytest_int4_models.txt" 2>&1
    echo "int4 models on CUDA: $(tail -1 "$OUT/pytest_int4_models.txt")"
    grep -E "^(FAILED|ERROR)" "$OUT/pytest_int4_models.txt" | head -8
    [ "${INT4_BENCH:-1}" = 0 ] || bench 120 "random:${GEMV_MODEL:-qwen3.6-27b}@gptq" --dtype bf16 --only decode \
        --concurrency "${BENCH_C:-8}" --decode-prompt-len 512 --decode-output-len 64 --no-transformers
    ;;
gemv-ncu)
    # what holds the one-row steps back: Nsight Compute's counters for one launch each (NCU_CASES fmt:N:K)
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    # one file for all cases (a call brings back at most eight)
    for case in ${NCU_CASES:-int4:16384:5120 int4-packed:16384:5120 bf16:16384:5120 int4:5120:17408}; do
        IFS=: read -r fmt n k rows <<<"$case"
        echo "=== ncu $case" >> "$OUT/ncu.txt"
        timeout 120 "$ncu_bin" --clock-control none --nvtx --nvtx-include "probe/" \
            --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
            --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
            --section InstructionStats python3 scripts/gpu_gemv_ncu.py --format "$fmt" --n "$n" --k "$k" \
            --rows "${rows:-1}" > /tmp/ncu_case.txt 2>&1
        echo "ncu $case: rc $?"; cat /tmp/ncu_case.txt >> "$OUT/ncu.txt"
        grep -E "config:|Duration|DRAM Throughput|Memory Throughput|Issue Slots Busy|Registers Per|Achieved Occupancy|No Eligible|Executed Ipc A|Warp Cycles Per Issued" \
            /tmp/ncu_case.txt | head -16
    done
    ;;
staged-tests)
    # FP8's one-row step with its words staged through shared memory against the register
    # prefetch (bit for bit), and the unrolled loop beside it
    timeout "${TESTS_S:-240}" python3 -m pytest -q -rf --tb=short -m gpu tests/test_packed_gemv.py -k "staged or unrolled" \
        > "$OUT/pytest_staged.txt" 2>&1; tail -3 "$OUT/pytest_staged.txt"
    ;;
quant-moe-tune)
    # the quantized experts: the one-token staged/narrow shapes' GPU tests, then their launch shapes
    # tuned per MOE_FORMATS (fp8,int4) at MOE_TOKENS (1) on the 35B-A3B's layer (scripts/gpu_quant_moe_tune.py;
    # table written in place, a copy in $OUT), then the 35B-A3B at c=1 per WEIGHT_FORMATS with it.
    # 8 compiling workers: 12, each holding a layer's experts in each format, ran an H100 out of memory
    if [ "${MOE_TESTS:-1}" = 1 ]; then
        timeout 150 python3 -m pytest -q -rf --tb=short -m gpu tests/test_quant_moe_one_token.py \
            > "$OUT/pytest_moe_one.txt" 2>&1; echo "pytest_moe_one: $(tail -1 "$OUT/pytest_moe_one.txt")"
    fi
    timeout 330 python3 scripts/gpu_quant_moe_tune.py --formats "${MOE_FORMATS:-fp8,int4}" --tokens "${MOE_TOKENS:-1}" \
        --warm 8 --warm-s 110 --budget-s "${MOE_TUNE_S:-160}" --write --out-dir "$OUT" > "$OUT/quant_moe_tune.jsonl" \
        2> "$OUT/quant_moe_tune.err"
    tail -2 "$OUT/quant_moe_tune.err"; grep -E '"(best_us|format": "bf16|warm)' "$OUT/quant_moe_tune.jsonl" | cut -c1-300
    for fmt in ${WEIGHT_FORMATS:-@fp8-block @bf16 @gptq}; do
        bench "${BENCH_S:-110}" "random:qwen3.6-35b-a3b${fmt%@bf16}" --dtype bf16 --only bandwidth,decode \
            --concurrency "${BENCH_C:-1}" --decode-prompt-len 512 --decode-output-len 64 --no-transformers
    done
    ;;
prefill-host)
    # where a chunked prefill's wall time goes on the host: the syncs by call site and a cProfile
    # (scripts/gpu_prefill_host.py), 8k prompts in PREFILL_CHUNK (1024) chunks, per PREFILL_MODELS;
    # first (PREFILL_TESTS=0: not) the GPU tests of the chunked prefill's pieces (fla's sequence
    # bounds and initial states, the MoE layout's grid launches) and of graph decode
    if [ "${PREFILL_TESTS:-1}" = 1 ]; then
        timeout 200 python3 -m pytest -q -rf --tb=short -m gpu tests/test_hybrid_kernels.py tests/test_moe_kernels.py \
            tests/test_cuda_graph.py > "$OUT/pytest_prefill.txt" 2>&1; echo "pytest_prefill: $(tail -1 "$OUT/pytest_prefill.txt")"
        grep -E "^(FAILED|ERROR)" "$OUT/pytest_prefill.txt" | head -8
    fi
    for m in ${PREFILL_MODELS:-qwen3.6-35b-a3b qwen3.6-35b-a3b@fp8-block}; do
        limit=$(left); [ "$limit" -gt 200 ] && limit=200
        timeout "$limit" python3 scripts/gpu_prefill_host.py "random:$m" --prefill 8192 \
            --chunk "${PREFILL_CHUNK:-1024}" ${PREFILL_PUBLISH:+--publish} 2>>"$OUT/prefill_host.err" | tee -a "$OUT/prefill_host.jsonl" | cut -c1-2500
    done
    ;;
chunk-latency)
    # the prefill chunk's trade: a long prompt's time to first token against the token gaps of
    # the requests decoding beside it, per chunk size; device time of the ends profiled. First
    # (CHUNK_TESTS=0: not) the prefill kernels' GPU tests (session 31's Gated DeltaNet gates)
    if [ "${CHUNK_TESTS:-1}" = 1 ]; then
        timeout 150 python3 -m pytest -q -rf --tb=short -m gpu tests/test_prefill_kernels.py \
            > "$OUT/pytest_chunk.txt" 2>&1; echo "pytest_chunk: $(tail -1 "$OUT/pytest_chunk.txt")"
        grep -E "^(FAILED|ERROR)" "$OUT/pytest_chunk.txt" | head -8
    fi
    for m in ${CHUNK_MODELS:-qwen3.6-35b-a3b qwen3.6-27b}; do
        limit=$(left); [ "$limit" -gt 240 ] && limit=240
        timeout "$limit" python3 scripts/gpu_chunk_latency.py "random:$m" --chunks "${CHUNKS:-1024,2048,4096,8192}" \
            --profile "${CHUNK_PROFILE:-1024,8192}" 2>>"$OUT/chunk_latency.err" | tee -a "$OUT/chunk_latency.jsonl" | cut -c1-1500
    done
    # the warm-up's summary (its compiles) and any compile it missed (ninfer/engine/compile_watch.py)
    grep -E "warmed up|while serving" "$OUT/chunk_latency.err" | cut -c1-400 | head -20
    ;;
spec-profile)
    # where a speculative round's device time goes (SPEC_MODEL: the gpu-deep preset's shape, random
    # weights, so no training first; SPEC_HEAD=N: drafts over the shortlist's N tokens, as spec-head's
    # 27B runs): plain decode steps, then rounds of SPEC_K drafts, per kernel kind;
    # first the round's bookkeeping kernels and the device rounds on CUDA (SPEC_TESTS=0: not)
    if [ "${SPEC_TESTS:-1}" = 1 ]; then
        # a process a file, side by side: compiling is most of their time and it is CPU-bound (one
        # process for all four ran past 270 s in session 34 without a summary)
        for t in spec_rounds_kernels spec_gpu decode_attention_kernel gated_delta_decode; do
            timeout 240 python3 -m pytest -q -rf --tb=short -m gpu "tests/test_$t.py" > "/tmp/pytest_$t.txt" 2>&1 &
        done
        wait
        for t in spec_rounds_kernels spec_gpu decode_attention_kernel gated_delta_decode; do
            echo "pytest $t: $(tail -1 "/tmp/pytest_$t.txt")"
            grep -E "^(FAILED|ERROR)" "/tmp/pytest_$t.txt" | head -4
        done | tee "$OUT/pytest_rounds.txt"
    fi
    # SPEC_SKINNY=1: the shape's projections on the few-row kernel where it beats cuBLAS (rows of a
    # decode step and of a verify step; table written in place, a copy in $OUT), before the profiles
    if [ "${SPEC_SKINNY:-0}" = 1 ]; then
        timeout 200 python3 scripts/gpu_skinny_sweep.py --parts linear --linear-models "${SPEC_MODEL:-train-gpu-deep}" \
            --rows 1,4,8 --write --out-dir "$OUT" > "$OUT/spec_skinny_sweep.jsonl" 2>&1
        grep '"linear"' "$OUT/spec_skinny_sweep.jsonl" | cut -c1-260
    fi
    # plain steps, rounds, then rounds with verify attention in the decode kernel (the peer of the
    # default four launches a layer)
    for run in 0 "${SPEC_K:-3}" "${SPEC_K:-3}f"; do
        k=${run%f}
        limit=$(left); [ "$limit" -gt 150 ] && limit=150
        env $([ "$run" != "$k" ] && echo NINFER_FUSED_VERIFY=1) timeout "$limit" python3 scripts/gpu_step_profile.py \
            "random:${SPEC_MODEL:-train-gpu-deep}" --concurrency "${SPEC_C:-1}" --steps 30 --top 40 \
            $([ "$k" = 0 ] || echo --spec mtp --draft-tokens "$k" ${SPEC_HEAD:+--lm-head-draft "$SPEC_HEAD"}) 2>&1 \
            | tee "$OUT/profile_spec_k$run.jsonl" | grep "^{" | cut -c1-1200
    done
    # last, with what is left (session 34's sweep of every case, run before the profiles, took them
    # down with it): verify attention alone, one row a sequence against four, per launch shape, at
    # the bench's max context; or the Gated DeltaNet verify op's launch shapes beside one token's decode
    limit=$(left); [ "$limit" -gt 200 ] && limit=200
    if [ "${SPEC_SWEEP:-attention}" = none ]; then
        true  # the profiles alone
    elif [ "${SPEC_SWEEP:-attention}" = attention ]; then
        timeout "$limit" python3 scripts/gpu_verify_attention_sweep.py --shapes train-gpu-deep,qwen3.6-27b \
            --cases 1x400,4x400,4x4096 --max-context 3072 > "$OUT/verify_attention.jsonl" 2>&1
        grep -v '"splits"' "$OUT/verify_attention.jsonl" | cut -c1-300
    else
        timeout "$limit" python3 scripts/gpu_gdn_decode_check.py --out "$OUT/gdn_small.jsonl" \
            --shapes train-gpu-deep,qwen3.6-27b --cases "decode b=1,verify" 2>&1 | tail -40
    fi
    ;;
serve27)
    # #18's startup goal: ninfer-serve on the 27B shape with a cold Triton cache (a fresh machine's),
    # then restarted on the cache that start left (SERVE_RESTART=0: not); one streamed request each.
    # SERVE_ARGS: more ninfer-serve flags (e.g. "--spec mtp --draft-tokens 3 --kv-dtype fp8": the
    # headline profile's extra graph sets and warm-up rounds)
    for cache in cold warm; do
        [ "$cache" = warm ] && [ "${SERVE_RESTART:-1}" = 0 ] && break
        [ "$cache" = cold ] && rm -rf /tmp/triton-cold
        limit=$(left); [ "$limit" -gt 240 ] && limit=240
        TRITON_CACHE_DIR=/tmp/triton-cold timeout "$limit" python3 scripts/gpu_serve_speed.py random:qwen3.6-27b \
            --requests 1 --max-tokens 128 --log "$OUT/serve_$cache.log" ${SERVE_ARGS:+-- $SERVE_ARGS} \
            | sed "s/^{/{\"triton_cache\": \"$cache\", \"serve_args\": \"${SERVE_ARGS:-}\", /" \
            | tee -a "$OUT/serve27.jsonl"
        grep -E "warmed up|captured|ready|while serving" "$OUT/serve_$cache.log" | cut -c1-300 | head -8
    done
    ;;
fla-tune)
    # fla's chunked Gated DeltaNet kernels autotuned at the engine's call shapes (FLA_SHAPES), the
    # results merged into kernels/triton/fla_configs/<card>.json (a copy in $OUT/fla_configs/),
    # which the engine pins at startup: a cold start then compiles one config a kernel, not every
    # candidate (session 40, H100: 96 -> 54 s). Run serve27 after it
    limit=$(left); [ "$limit" -gt 300 ] && limit=300
    timeout "$limit" python3 scripts/gpu_fla_tune.py \
        --shapes "${FLA_SHAPES:-qwen3.6-27b,qwen3.6-35b-a3b,train-gpu-deep}" --out "$OUT" 2>>"$OUT/fla_tune.err" \
        | tee "$OUT/fla_tune.jsonl" | cut -c1-300
    ;;
quant35)
    # #22 on the 35B-A3B: each of WEIGHT_FORMATS (FP8 block, int4 GPTQ, bf16) built once, then decode
    # at c=1 and 8 and one 8k prefill. The quantized layouts are written a decoder layer at a time
    # (ninfer/model/random_weights.py), so the build's peak is the quantized model plus one layer
    for fmt in ${WEIGHT_FORMATS:-@fp8-block @gptq @bf16}; do
        bench "${BENCH_S:-170}" "random:qwen3.6-35b-a3b${fmt%@bf16}" --dtype bf16 --only bandwidth,decode,prefill \
            --concurrency 1,8 --decode-prompt-len 512 --decode-output-len 64 --prefill-lens 8192 --prefill-chunk 8192 \
            --no-transformers
    done
    ;;
prefill-quant)
    # #22's prefill goal: the table's prefill rows (our tiles against the cuBLAS routes), then 8k prefills
    timeout "$(( ${TUNE_S:-150} + 60 ))" python3 scripts/gpu_quant_gemm_sweep.py --parts tune \
        --budget-s "${TUNE_S:-150}" --warm "${TUNE_WARM:-12}" --jobs "${TUNE_JOBS:-fp8:8192,int4:8192,fp8:1024,int4:1024}" --write \
        --out-dir "$OUT" > "$OUT/quant_tune.jsonl" 2> "$OUT/quant_tune.err"
    tail -3 "$OUT/quant_tune.err"; grep best_us "$OUT/quant_tune.jsonl" | cut -c1-200
    for fmt in ${WEIGHT_FORMATS:-@fp8-block @gptq @bf16}; do
        bench "${BENCH_S:-120}" "random:qwen3.6-27b${fmt%@bf16}" --dtype bf16 --only prefill \
            --prefill-lens 8192 --prefill-chunk 8192 --no-transformers
    done
    ;;
kv-sweep)
    # decode attention launch shapes per KV format at long contexts (table written in place, a copy in $OUT)
    timeout "$(( ${SWEEP_S:-300} + 60 ))" python3 scripts/gpu_kv_decode_sweep.py --budget-s "${SWEEP_S:-300}" \
        --formats "${SWEEP_FORMATS:-bfloat16,fp8}" \
        --cases "${SWEEP_CASES:-1x32768,1x131072,8x32768}" ${SWEEP_ARGS:-} --write --out-dir "$OUT" \
        > "$OUT/kv_sweep.jsonl" \
        2> "$OUT/kv_sweep.err"; grep winner "$OUT/kv_sweep.jsonl"; tail -3 "$OUT/kv_sweep.err"
    ;;
profile27)
    # the headline profile served on the 27B shape: fp8 KV, MTP k=3 over the LM-head shortlist
    ninfer-serve random:qwen3.6-27b --profile configs/qwen27b-fp8-mtp.yaml --port 8080 \
        > "$OUT/serve.log" 2>&1 &
    server=$!
    for _ in $(seq 1 90); do curl -sf localhost:8080/health >/dev/null && break; sleep 2; done
    for n in 1 2; do
        curl -s localhost:8080/v1/chat/completions -H 'content-type: application/json' \
            -d '{"model": "random:qwen3.6-27b", "messages": [{"role": "user", "content": "hello there"}],
                 "max_tokens": 128, "ignore_eos": true}' | python3 -c "import json, sys; d = json.load(sys.stdin)
print(json.dumps({'usage': d.get('usage'), 'timings': d.get('timings'), 'error': d.get('error')}))" \
            | tee -a "$OUT/profile27.jsonl"
    done
    kill -TERM $server; wait $server; tail -20 "$OUT/serve.log"
    ;;
kvab)
    # whole steps decide between decode shapes the kernel sweep ranks within a few percent
    step8() { bench 150 random:qwen3.6-27b --dtype bf16 --kv-dtype "$1" --only decode --concurrency 8 \
        --decode-prompt-len 131072 --decode-output-len 128 --synthetic-context --no-transformers; }
    table=kernels/triton/decode_attention_configs/NVIDIA_H200.json
    cp "$table" /tmp/decode_table.json
    step8 bf16
    step8 fp8
    for shape in ${KV_AB:-}; do
        python3 - "$table" "$shape" <<'PY'
import json, sys
path, shape = sys.argv[1], sys.argv[2].split("/")
table = json.load(open(path))
table["fp8,D=256"]["8"] = dict(zip(("splits", "block_n", "num_warps", "num_stages"), map(int, shape)))
json.dump(table, open(path, "w"), indent=1)
PY
        echo "{\"kv_ab_shape\": \"$shape\"}" | tee -a "$OUT/bench.jsonl"
        step8 fp8
    done
    cp /tmp/decode_table.json "$table"
    ;;
kvprof)
    # where a 27B decode step at 8 x 128k goes per KV format (synthetic contexts, per kernel kind)
    for kv in ${KV_FORMATS:-bf16 fp8}; do
        timeout 200 python3 scripts/gpu_step_profile.py random:qwen3.6-27b --concurrency 8 --prompt-len 131072 \
            --synthetic-context --kv-dtype "$kv" --steps 10 --top 30 2>&1 | tee "$OUT/profile_kv_$kv.jsonl" | tail -2
    done
    ;;
acc)
    # the KV and weight formats' accuracy through the CUDA kernels, on a model trained here
    timeout 240 ninfer-train /tmp/trained --device cuda --preset "${TRAIN_PRESET:-default}" -q > "$OUT/train.json"
    tail -c 600 "$OUT/train.json"
    write_heldout /tmp/trained
    timeout 150 python3 scripts/kv_accuracy.py /tmp/trained --heldout /tmp/trained/heldout.txt --device cuda \
        --dtype bf16 > "$OUT/kv_accuracy.jsonl" 2> "$OUT/kv_accuracy.err"; cut -c1-400 "$OUT/kv_accuracy.jsonl"
    if [ -n "${ACC_WEIGHTS:-}" ]; then
        timeout 150 python3 scripts/weight_accuracy.py /tmp/trained --heldout /tmp/trained/heldout.txt \
            --device cuda --dtype bf16 > "$OUT/weight_accuracy.jsonl" 2> "$OUT/weight_accuracy.err"
        cut -c1-400 "$OUT/weight_accuracy.jsonl"
    fi
    ;;
weight-tests)
    # the quantized-weight GPU tests alone, with room to finish
    timeout "${TESTS_S:-300}" python3 -m pytest -q -rf --tb=short -m gpu tests/test_quant_kernels.py \
        tests/test_weight_formats_gpu.py > "$OUT/pytest_quant.txt" 2>&1; tail -3 "$OUT/pytest_quant.txt"
    ;;
profile-quant)
    # PROFILE_MODEL's step (the 27B) at c=1 per WEIGHT_FORMATS under the profiler, kernel kind by
    # kind: session 24's int4 GEMMs summed to 7.3 ms alone against 8.3 for FP8, yet its step took
    # 10.20 ms to FP8's 9.89; session 29's 35B-A3B ran FP8 6% slower than bf16 on 40% fewer bytes
    model=${PROFILE_MODEL:-qwen3.6-27b}
    for fmt in ${WEIGHT_FORMATS:-@gptq @fp8-block @bf16}; do
        limit=$(left); [ "$limit" -gt 180 ] && limit=180
        timeout "$limit" python3 scripts/gpu_step_profile.py "random:$model${fmt%@bf16}" --concurrency 1 \
            --steps 20 --top 30 2>&1 | tee "$OUT/profile_${model}_${fmt#@}.jsonl" | cut -c1-1500 | tail -3
    done
    ;;
probe)
    timeout 170 python3 scripts/gpu_step_profile.py random:qwen3.6-35b-a3b --concurrency 1,8 --steps 20 \
        --top 30 2>&1 | tee "$OUT/profile_35b.jsonl" | tail -4
    timeout 170 python3 scripts/gpu_step_profile.py random:qwen3.6-27b --concurrency 1,8 --steps 20 \
        --top 30 2>&1 | tee "$OUT/profile_27b.jsonl" | tail -4
    timeout 200 python3 scripts/gpu_prefix_reuse_check.py --dtype fp32 2>&1 | tee "$OUT/prefix_reuse.txt" | tail -24
    ;;
esac
done
tail -5 "$OUT/bench.err" 2>/dev/null
true
