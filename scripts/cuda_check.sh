#!/usr/bin/env bash
# The checks that need a GPU, as one short script (CI has none): the CUDA tests, the server on CUDA, static vs
# continuous on CUDA with the simulator, and a 1/8/32-stream sweep. Each stage has its own time limit and the
# script goes on after a failed stage; the exit status is that of the last failure.
#
#   bash scripts/cuda_check.sh [OUT_DIR]
#
# Needs: a CUDA GPU, python3 with torch (CUDA build) and kvserve's dependencies. Where the embedded model's
# package is missing (a machine that receives only this repo), set KVSERVE_SHAPE_DIR to a directory made by
# `python -m kvserve.loadtest randmodel --shape-of smollm2 --shape-only DIR`: SmolLM2's config and tokenizer; the
# weights are then random (same shapes, same step cost, text is noise). Wheels in $KVSERVE_WHEELS are installed
# to /tmp/site first (for a machine without a package index). KVSERVE_DEVICE=cpu runs the same stages on a CPU
# (to try the script without a GPU); KVSERVE_CHECK_PORT moves the server off port 18431.
set -u
OUT=${1:-${OUT:-loadtest/out/cuda}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEVICE=${KVSERVE_DEVICE:-cuda}  # cpu: try this script on a machine without a GPU
PORT=${KVSERVE_CHECK_PORT:-18431}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
stage() { echo; echo "=== $1 ($(date -u +%H:%M:%S))"; }
fail() { echo "!!! stage failed: $1 (exit $2)"; status=$2; }

if [ -n "${KVSERVE_WHEELS:-}" ]; then
  stage "install wheels from $KVSERVE_WHEELS"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$KVSERVE_WHEELS"/*.whl || fail wheels $?
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

stage "machine"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
else
  echo "nvidia-smi: not installed"
fi
lscpu | grep -E "Model name|^CPU\(s\)"
echo "SIMD: $(grep -o -w -E 'avx2|fma|f16c|avx512[a-z_0-9]*|amx[a-z_0-9]*|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())" || { fail python $?; exit "$status"; }
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  fail "torch sees no CUDA device (set KVSERVE_DEVICE=cpu to try this script on a CPU)" 1
  exit "$status"
fi

stage "tests/test_cuda.py on $DEVICE"
# the CPU side of these tests runs the PyTorch reference: no C++ build needed here
KVSERVE_TEST_DEVICE=$DEVICE KVSERVE_NATIVE_KERNELS=0 timeout 420 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -25
rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || fail "CUDA tests" "$rc"

# the C++ CPU kernels on this machine's CPU, one file at a time (the tests that need the embedded model's
# weights are left out)
stage "C++ CPU kernels: build and test on this machine's CPU"
timeout 240 "$PY" -m kvserve.native --build || fail "kernel build" $?
for file in test_decode_ops test_quant test_fastpath test_sampling; do
  timeout 200 "$PY" -X faulthandler -m pytest -q -p no:cacheprovider "tests/$file.py" -k "not smollm2" 2>&1 \
    | grep -v -E '^  File "/opt/|^Extension modules' | tail -40
  rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || fail "CPU kernel tests: $file" "$rc"
done

MODEL=smollm2
if [ -n "${KVSERVE_SHAPE_DIR:-}" ]; then
  stage "random-weight model with the shape of $KVSERVE_SHAPE_DIR"
  MODEL=/tmp/kvserve-random-model
  "$PY" -m kvserve.loadtest randmodel --from "$KVSERVE_SHAPE_DIR" "$MODEL" || { fail randmodel $?; exit "$status"; }
fi

stage "where a decode step's time goes on $DEVICE"
timeout 180 "$PY" -m kvserve.loadtest profile --model "$MODEL" --device "$DEVICE" --batch 1,8,32 --steps 5 --no-write \
  2>&1 | grep -v USDT
rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || fail profile "$rc"

stage "server on $DEVICE: one completion, one streamed chat, one bad request"
"$PY" -m kvserve.server.cli serve --model "$MODEL" --device "$DEVICE" --host 127.0.0.1 --port "$PORT" >"$OUT/serve.log" 2>&1 &
SERVER=$!
healthy=no
for _ in $(seq 240); do curl -sf "127.0.0.1:$PORT/health" >/dev/null && { healthy=yes; break; }; sleep 0.5; done
[ "$healthy" = yes ] || { fail "server never answered /health (log: $OUT/serve.log)" 1; tail -20 "$OUT/serve.log"; }
curl -s "127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}' || fail completion $?
echo
stream=$(curl -sN "127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": true}')
echo "$stream" | tail -4
grep -q '^data: \[DONE\]' <<<"$stream" || fail "streamed chat did not end with [DONE]" 1
code=$(curl -s -o /dev/null -w '%{http_code}' "127.0.0.1:$PORT/v1/completions" \
  -H 'Content-Type: application/json' -d '{"prompt": "x", "max_tokens": -1}')
echo "bad request -> HTTP $code"; [ "$code" = 400 ] || fail "bad request answered $code, not 400" 1

stage "1 / 8 / 32 streams, 128-token outputs (--dtype auto: bfloat16 on CUDA, float32 on most CPUs)"
timeout 300 "$PY" -m kvserve.loadtest run --url "http://127.0.0.1:$PORT" --workload fixed --max-tokens 128 --count 64 \
  --duration 8 --concurrency 1,8,32 --label cuda-streams --out "$OUT" --no-progress || fail streams $?
kill $SERVER; wait $SERVER 2>/dev/null
tail -5 "$OUT/serve.log"

stage "static vs continuous on $DEVICE (seed64, 8 slots), measured and simulated"
cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
timeout 240 "$PY" -m kvserve.loadtest compare --model "$MODEL" --device "$DEVICE" --section "compare-$DEVICE" --out "$OUT" \
  --benchmarks "$OUT/BENCHMARKS.md" --no-progress || fail compare $?

stage "done"
exit "$status"
