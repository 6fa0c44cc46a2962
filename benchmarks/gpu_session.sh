#!/usr/bin/env bash
# Everything owed to a GPU, as one prepared run (at most 9.5 minutes on an H200: the sum of the steps' limits):
# correctness of the decode kernels and of CUDA-graph decoding against the references, every benchmark that
# needs CUDA, then the model-op kernel tests (forward, then the backward kernels training runs, and the KD loss's
# TF32 and bf16 GEMMs and its KL kernels).
#   MRP_COMMIT=<short hash> bash benchmarks/gpu_session.sh OUT_DIR
# (the device gets a copy of the tree without .git: MRP_COMMIT, the commit that copy is, stamps the rows instead)
# A second call, when the session has device time left (at most 3 minutes: the training steps' limits), runs
# training on the GPU as a whole (compiled FlexAttention, bf16 autocast, the backward kernels; no issue's target):
#   bash benchmarks/gpu_session.sh OUT_DIR "training_tests training"
# Each step has its own time limit and log; a failing step does not stop the others. Results and logs
# are packed into OUT_DIR/gpu_results.tar.gz (unpack into benchmarks/results/ and commit what ran);
# benchmarks/targets.py then lists each issue target as met, missed or not measured.
set -uo pipefail
OUT="${1:?usage: bash benchmarks/gpu_session.sh OUT_DIR}"
RES="$OUT/results"
STEPS=" ${2:-decode_tests engine decode_kernels e2e lm_head model_op_tests} "  # the steps this call runs
mkdir -p "$RES"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$RES/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  | tee -a "$RES/gpu.txt"
echo "commit ${MRP_COMMIT:-unknown}" | tee -a "$RES/gpu.txt"

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  [[ "$STEPS" == *" $name "* ]] || return 0
  echo "=== $name (limit ${limit}s)"
  local start=$SECONDS
  timeout "$limit" "$@" >"$RES/$name.log" 2>&1
  local rc=$?
  tail -25 "$RES/$name.log"
  echo "=== $name rc=$rc in $((SECONDS - start))s" | tee -a "$RES/steps.txt"
}

# Kernel tests run on the GPU (tests/kernel_utils.py: DEV is cuda with the interpreter off); -v names each
# test in the log, so a step cut by its limit still shows what passed: CUDA-graph decoding first, the
# confidence tests (the most kernel variants to compile) last. The sm_90 compile test is CI's (CPU).
step decode_tests 135 python3 -m pytest -v -p no:cacheprovider tests/test_cuda_graphs.py tests/test_select.py \
  tests/test_verify.py tests/test_remask.py tests/test_settle.py tests/test_confidence.py
# bench_engine saves each row as measured: a run cut by its limit keeps them. The 1.7B shape only: the targets read
# its rows, and the 8B rows would run past the limit (about 3 minutes for both).
step engine 135 python3 benchmarks/bench_engine.py --models 1.7B --out "$RES"
# Graph-replayed timings of every op (the *_graph rows) came on top of the sweep. The eager per-forward
# costs of bench_model_steps are in the engine step's eager rows already: not run here.
# No torch.compile rows (two cold Inductor compiles; no target reads them, h200-baselines.md has its figures); the
# tile sweep runs after every N's default rows.
step decode_kernels 100 python3 benchmarks/bench_decode_kernels.py --sweep --no-compile --out "$RES"
# The modes the issues' targets name (static is always run first), six in all, each saved as it ends; the full
# table stays a CPU figure, and so do the authors' schedule, rows starting blocks together and the draft_vocab /
# draft_candidates modes (at the shipped model's 2048 ids the lm_head rows they save are no measurable time;
# bench_engine's estimate of draft_candidates=16 reads the CPU run's counts).
step e2e 70 python3 benchmarks/bench_e2e.py --device cuda --dtype bfloat16 --out "$RES" \
  --modes "speculative K=1 mrp" "speculative K=3 mrp" "dynamic tau=0.9" "direct K=2" "remask tau tau=0.7" \
  --skip draft_vocab draft_candidates "blocks together"
# First a draft step's pick among 16 listed tokens (candidate_confidence, seconds); then lm_head_confidence at every
# N its target names (1-128) and a verify round's 512, half the rows skipped (what a decoding step asks) vs all rows;
# last the tile sweep at the N it may miss (64-128 rows; the rows_major configs never ran on a GPU).
step lm_head 80 python3 benchmarks/bench_mrp_head.py --only candidates,lm_head --rows 1,4,16,64,128,512 \
  --hidden 2048,4096 --sweep --sweep-rows 64,128 --no-compile --out "$RES"
step model_op_tests 50 python3 -m pytest -v -p no:cacheprovider tests/test_lm_head_confidence.py \
  tests/test_candidate_confidence.py tests/test_norm_ops.py tests/test_cached_attention.py \
  tests/test_norm_ops_backward.py tests/test_kd_loss.py::test_cuda_precisions \
  tests/test_softmax_kl.py::test_kernel_at_a_real_vocabulary
# The second call's: training's CUDA tests (FlexAttention's loss and gradients against SDPA's, bf16-valued frozen
# projections kept in bf16), then a few steps of mrp-train mrp and backbone at the shipped model's shapes.
step training_tests 60 python3 -m pytest -v -p no:cacheprovider \
  tests/test_training_losses.py::test_flex_attention_gives_the_sdpa_loss \
  tests/test_training_loop.py::test_cuda_mrp_training_keeps_bf16_valued_projections_in_bf16_then_restores_them
step training 120 python3 benchmarks/bench_training.py --out "$RES"
# The issues' targets against what was measured (CPU only, seconds): also in results/targets.md.
python3 benchmarks/targets.py "$RES"
tar -czf "$OUT/gpu_results.tar.gz" -C "$OUT" results
cat "$RES/steps.txt" 2>/dev/null || echo "no step ran (this call selected:$STEPS)"
