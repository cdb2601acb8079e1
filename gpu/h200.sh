#!/usr/bin/env bash
# The GPU session's one command (an H200 lent for minutes, no network): from the repository root,
#
#   bash gpu/h200.sh OUT [STEP ...]        STEP: setup bench memcheck catalog (default: all four, in this order)
#   bash gpu/h200.sh --wheelhouse DIR [PYVER ...]
#                                          HERE, where the registries are reachable: the wheels the GPU image
#                                          lacks, for CPython PYVER (default 3.10 3.11 3.12 3.13), manylinux x86_64
#
# OUT gets versions.txt, setup.log, h200.json / h200.md (python -m gpu.h200), memcheck.log, catalog/ (the
# conformance report of gpu.paged:paged_attention on CUDA tensors) + catalog.log, and steps.tsv / steps.md:
# each step's exit status, seconds and note. A failing step never stops the next one; the exit status is
# the first failing step's (0 when all passed).
#
# setup    a venv build/h200-venv with --system-site-packages (the image's torch and triton), the
#          catalog's requirements installed from the carried wheelhouse only (pip --no-index --find-links:
#          $H200_WHEELHOUSE, else build/h200-wheelhouse, else wheelhouse/), cmake / ninja from it only where
#          the image lacks them, then the C++ kernels built as ./pagecheck does (pip install
#          --no-build-isolation .; skipped when already built from the same sources). No venv module: pip
#          --target build/h200-site on PYTHONPATH instead. Whatever fails is recorded, and the next steps run
#          with what there is.
# bench    python -m gpu.h200 --out OUT --budget-s N: N fits the deadline (below) after the later steps' shares
# memcheck compute-sanitizer --tool memcheck around python -m gpu.h200 --memcheck-case (a few small decode and
#          prefill calls, checked), torch's caching allocator off so every tensor is its own allocation
#          (no compute-sanitizer found: the case alone, its results still checked)
# catalog  python -m conformance --impl gpu.paged:paged_attention --out OUT/catalog [-n W] with a timeout
#          (pytest-xdist's -n when importable; --continue-on-collection-errors when the kernels did not build:
#          the test modules that import impl/ cannot be collected then, the report says which)
#
# Time: everything ends within H200_DEADLINE_S (default 570 s, under the device's 600 s per command).
# Knobs (seconds): H200_BENCH_BUDGET_S (most for bench, default 420), H200_MEMCHECK_S (default 100),
# H200_CATALOG_S (share kept for the catalog, default 180; it then gets all that is left), H200_WORKERS
# (catalog workers, default 12). The wheelhouse: carry it (run's `carry: ["build/h200-wheelhouse"]`);
# H200_WHEELHOUSE_NUMPY=1 adds numpy (16 MiB a Python version) for an image without it.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 2

# What the image lacks for the catalog and the build (pyproject.toml: build-system.requires, the `test`
# extra; tests/test_gpu_h200.py checks these lists still name them). torch and triton are never carried.
MLX_REQS=("mlx[cpu]==0.32.4")
TEST_REQS=("pytest>=8" "hypothesis>=6.100" "pytest-xdist>=3" "pytest-benchmark>=4")
BUILD_REQS=("scikit-build-core>=0.10" "nanobind>=3.0.1,<4")
TOOL_REQS=("cmake>=3.25" "ninja")
NUMPY_REQS=("numpy>=1.26")
# pip download does not evaluate the target's markers: what pytest, hypothesis and scikit-build-core
# need on Python < 3.11 is named here
PY310_REQS=("exceptiongroup>=1" "tomli>=2" "typing-extensions>=4")

wheelhouse() {
  local dir=${1:?usage: bash gpu/h200.sh --wheelhouse DIR [PYVER ...]}
  shift
  local pys=("$@")
  [ ${#pys[@]} -gt 0 ] || pys=(3.10 3.11 3.12 3.13)
  local py=${PYTHON:-}
  [ -n "$py" ] || { [ -x .venv/bin/python ] && py=.venv/bin/python; } || py=python3
  mkdir -p "$dir"
  local reqs=("${MLX_REQS[@]}" "${TEST_REQS[@]}" "${BUILD_REQS[@]}" "${TOOL_REQS[@]}")
  [ "${H200_WHEELHOUSE_NUMPY:-0}" = 1 ] && reqs+=("${NUMPY_REQS[@]}")
  local v rc=0
  for v in "${pys[@]}"; do
    echo "h200 wheelhouse: CPython $v" >&2
    local more=()
    case "$v" in 3.10|310) more=("${PY310_REQS[@]}") ;; esac
    # mlx-cpu is manylinux_2_35: the image needs glibc >= 2.35 (setup records it when not)
    "$py" -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version "$v" \
      --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "${reqs[@]}" "${more[@]}" || {
      echo "h200 wheelhouse: CPython $v failed" >&2; rc=1; }
  done
  ls -1 "$dir"
  local bytes
  bytes=$(du -sb "$dir" | cut -f1)
  echo "h200 wheelhouse: $(ls -1 "$dir" | wc -l) wheels, $bytes bytes ($(( bytes / 1048576 )) MiB) in $dir"
  if [ "$bytes" -gt $((60 * 1048576)) ]; then
    echo "h200 wheelhouse: over 60 MiB: too big to carry (64 MiB for all carried paths)" >&2
    rc=1
  fi
  return $rc
}

if [ "${1:-}" = "--wheelhouse" ]; then
  shift
  wheelhouse "$@"
  exit $?
fi

OUT=${1:?usage: bash gpu/h200.sh OUT [setup|bench|memcheck|catalog ...] | --wheelhouse DIR [PYVER ...]}
shift
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=(setup bench memcheck catalog)
DEADLINE=${H200_DEADLINE_S:-570}
PY=${PYTHON:-python3}
VPY=$PY  # the interpreter of the later steps: the venv's once setup made it
VENV=build/h200-venv
SITE=build/h200-site
FIRST_FAIL=0
printf 'step\trc\tseconds\tnote\n' > "$OUT/steps.tsv"

wants() { local s; for s in "${STEPS[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
left() { echo $((DEADLINE - SECONDS)); }
record() {  # step rc seconds note
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$OUT/steps.tsv"
  echo "h200: step $1: rc=$2 (${3}s) $4"
  case "$2" in  # "skipped" / "absent" are recorded, not failures
    0|''|*[!0-9]*) ;;
    *) [ "$FIRST_FAIL" = 0 ] && FIRST_FAIL=$2 ;;
  esac
}
limited() {  # [-s SIGNAL] seconds command...: the command under timeout (where coreutils has it)
  local sig=TERM t
  if [ "$1" = -s ]; then sig=$2; shift 2; fi
  t=$1
  shift
  if command -v timeout >/dev/null; then timeout -s "$sig" -k 30 "$t" "$@"; else "$@"; fi
}

versions() {
  {
    echo "date: $(date -u +%FT%TZ)  host: $(hostname)  nproc: $(nproc 2>/dev/null)  repo: $root"
    echo "uname: $(uname -a)"
    echo "glibc: $(ldd --version 2>&1 | head -1)"
    echo "python: $($PY --version 2>&1) at $(command -v "$PY")"
    $PY - <<'EOF' 2>&1
import importlib
for name in ("torch", "triton", "numpy", "mlx.core", "pytest", "xdist", "hypothesis", "nanobind", "scikit_build_core"):
    try:
        m = importlib.import_module(name)
        print(f"{name}: {getattr(m, '__version__', '?')}")
    except Exception as e:
        print(f"{name}: absent ({type(e).__name__}: {e})")
try:
    import torch
    print("torch.version.cuda:", torch.version.cuda, " cuda available:", torch.cuda.is_available(),
          " device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
except Exception as e:
    print("torch cuda: ", e)
EOF
    echo "--- nvidia-smi"; nvidia-smi 2>&1 | head -20
    echo "--- nvcc: $(nvcc --version 2>&1 | tail -2 | tr '\n' ' ')"
    echo "--- compute-sanitizer: $(find_sanitizer)"
    echo "--- c++: $(c++ --version 2>&1 | head -1)   cmake: $(cmake --version 2>&1 | head -1)   ninja: $(ninja --version 2>&1)"
    echo "--- disk: $(df -h . 2>/dev/null | tail -1)"
  } 2>&1 | tee "$OUT/versions.txt"
}

find_sanitizer() {
  local c
  for c in "$(command -v compute-sanitizer 2>/dev/null)" "${CUDA_HOME:-/nonexistent}/bin/compute-sanitizer" \
           /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
           /opt/nvidia/nsight-compute/*/compute-sanitizer/compute-sanitizer; do
    [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
  done
  echo "absent"
  return 1
}

find_wheelhouse() {
  local d
  for d in "${H200_WHEELHOUSE:-}" build/h200-wheelhouse wheelhouse; do
    [ -n "$d" ] && [ -d "$d" ] && ls "$d"/*.whl >/dev/null 2>&1 && { echo "$d"; return 0; }
  done
  return 1
}

stamp_of_sources() {
  (find pyproject.toml CMakeLists.txt impl/csrc -type f ! -name '*.pyc' | LC_ALL=C sort | xargs cat; $VPY --version) \
    2>&1 | sha256sum | cut -d' ' -f1
}

setup() {  # prints notes to setup.log; returns non-zero when the kernels are not importable
  local wh notes=() mode=venv pipx=()
  wh=$(find_wheelhouse) || { wh=""; notes+=("no wheelhouse (build/h200-wheelhouse, wheelhouse/ or \$H200_WHEELHOUSE)"); }
  if { [ -x "$VENV/bin/python" ] || $PY -m venv --system-site-packages "$VENV"; } \
      && "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    VPY=$VENV/bin/python
    export PATH="$root/$VENV/bin:$PATH"
    if ! $VPY -c "import torch, triton" 2>/dev/null && $PY -c "import torch, triton" 2>/dev/null; then
      # $PY is itself a venv (or the like): --system-site-packages gave the base interpreter's, so the
      # image's site dirs go in by a .pth file
      $PY -c "import site, sys; print('\n'.join(p for p in sys.path if p.endswith('-packages')))" \
        > "$($VPY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_h200_image.pth"
      notes+=("the image's site dirs added by _h200_image.pth")
    fi
  else
    mode=target
    notes+=("no venv with pip ($PY -m venv failed): pip --target $SITE on PYTHONPATH")
    rm -rf "$VENV"
    mkdir -p "$SITE"
    export PYTHONPATH="$root/$SITE${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$root/$SITE/bin:$PATH"
    pipx=(--target "$SITE" --upgrade)
  fi
  $VPY -c "import torch, triton" || notes+=("torch/triton not importable from $VPY")
  pipi() {  # the wheelhouse only: never a registry
    [ -n "$wh" ] || return 1
    $VPY -m pip install -q --disable-pip-version-check --no-index --find-links "$wh" "${pipx[@]}" "$@"
  }
  have() { $VPY -c "import $1" >/dev/null 2>&1; }
  have pytest && have hypothesis && have xdist && have pytest_benchmark || pipi "${TEST_REQS[@]}" \
    || notes+=("test requirements: install failed")
  have mlx.core || pipi "${MLX_REQS[@]}" || notes+=("mlx[cpu]: install failed (glibc: $(ldd --version 2>&1 | head -1))")
  $VPY -c "import numpy, sys; sys.exit(tuple(map(int, numpy.__version__.split('.')[:2])) < (1, 26))" 2>/dev/null \
    || pipi "${NUMPY_REQS[@]}" || notes+=("numpy>=1.26 missing and not in the wheelhouse")
  have nanobind && have scikit_build_core || pipi "${BUILD_REQS[@]}" || notes+=("build requirements: install failed")
  if ! cmake --version 2>/dev/null | head -1 | awk '{split($3, v, "."); exit !(v[1] > 3 || (v[1] == 3 && v[2] >= 25))}'; then
    pipi "${TOOL_REQS[0]}" || notes+=("cmake >= 3.25: absent, and not installed from the wheelhouse")
  fi
  command -v ninja >/dev/null || pipi "${TOOL_REQS[1]}" || notes+=("ninja: absent (the build uses make)")
  local want
  want=$(stamp_of_sources)
  if have pagecheck_kernels && [ "$(cat build/h200-kernels.stamp 2>/dev/null)" = "$want" ]; then
    notes+=("kernels already built from these sources")
  elif [ "$mode" = venv ]; then
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) $VPY -m pip install -v --disable-pip-version-check --no-index \
      ${wh:+--find-links "$wh"} --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1 \
      && echo "$want" > build/h200-kernels.stamp || notes+=("kernel build failed (build.log)")
  else
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) $VPY -m pip install -v --disable-pip-version-check --no-index \
      ${wh:+--find-links "$wh"} --no-build-isolation --no-deps "${pipx[@]}" . > "$OUT/build.log" 2>&1 \
      && echo "$want" > build/h200-kernels.stamp || notes+=("kernel build failed (build.log)")
  fi
  have pagecheck_kernels || notes+=("pagecheck_kernels not importable: the catalog runs partially")
  SETUP_NOTE="$mode; wheelhouse ${wh:-none}; ${notes[*]:-ok}"
  have pagecheck_kernels && have mlx.core && have pytest
}

run_setup() {
  local t0=$SECONDS rc
  SETUP_NOTE=""
  if [ "$(left)" -lt 30 ]; then record setup skipped 0 "deadline"; return; fi
  setup > "$OUT/setup.log" 2>&1
  rc=$?
  { echo "--- after setup: $VPY"; $VPY -m pip list --disable-pip-version-check 2>/dev/null \
      | grep -i -E '^(torch|triton|numpy|mlx|mlx-cpu|pytest|pytest-xdist|hypothesis|nanobind|scikit-build-core|cmake|ninja|pagecheck) '; } \
    >> "$OUT/versions.txt" 2>&1
  record setup "$rc" $((SECONDS - t0)) "$SETUP_NOTE"
}

run_bench() {
  local t0=$SECONDS rest=0 budget rc
  wants memcheck && rest=$((rest + ${H200_MEMCHECK_S:-100}))
  wants catalog && rest=$((rest + ${H200_CATALOG_S:-180}))
  budget=$(( $(left) - rest - 45 ))
  [ "$budget" -lt 60 ] && budget=$(( $(left) - 45 ))  # the later steps give up their shares
  [ "$budget" -gt "${H200_BENCH_BUDGET_S:-420}" ] && budget=${H200_BENCH_BUDGET_S:-420}
  [ "$budget" -lt 10 ] && { record bench skipped 0 "deadline: $(left) s left"; return; }
  limited $((budget + 60)) $VPY -m gpu.h200 --out "$OUT" --budget-s "$budget" 2>&1 | tee "$OUT/bench.log"
  rc=${PIPESTATUS[0]}
  record bench "$rc" $((SECONDS - t0)) "budget ${budget} s; $(tail -1 "$OUT/bench.log" | cut -c1-200)"
}

run_memcheck() {
  local t0=$SECONDS cs t rc
  cs=$(find_sanitizer) || cs=""
  t=${H200_MEMCHECK_S:-100}
  wants catalog && [ $(( $(left) - 60 )) -lt "$t" ] && t=$(( $(left) - 60 ))
  ! wants catalog && [ $(( $(left) - 10 )) -lt "$t" ] && t=$(( $(left) - 10 ))
  [ "$t" -lt 20 ] && { record memcheck skipped 0 "deadline: $(left) s left"; return; }
  if [ -z "$cs" ]; then  # no sanitizer: the case's own checks (the score options on the GPU) still run
    limited "$t" $VPY -m gpu.h200 --memcheck-case > "$OUT/memcheck.log" 2>&1
    rc=$?
    tail -3 "$OUT/memcheck.log"
    record memcheck "$rc" $((SECONDS - t0)) "compute-sanitizer absent: the case ran without it (1: a wrong result)"
    return
  fi
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 limited "$t" "$cs" --tool memcheck --error-exitcode 3 --print-limit 50 \
    --target-processes all $VPY -m gpu.h200 --memcheck-case > "$OUT/memcheck.log" 2>&1
  rc=$?
  tail -5 "$OUT/memcheck.log"
  record memcheck "$rc" $((SECONDS - t0)) "$cs; rc 3: memcheck errors, 1: a wrong result, 124: timeout (${t} s); $(grep -m1 'ERROR SUMMARY' "$OUT/memcheck.log")"
}

run_catalog() {
  local t0=$SECONDS t rc args=() note=""
  t=$(( $(left) - 40 ))  # room for pytest's orderly stop (report written) after the SIGINT, and the kill after
  [ "$t" -gt "${H200_CATALOG_MAX_S:-400}" ] && t=${H200_CATALOG_MAX_S:-400}
  [ "$t" -lt 30 ] && { record catalog skipped 0 "deadline: $(left) s left"; return; }
  $VPY -c "import xdist" 2>/dev/null && args+=(-n "${H200_WORKERS:-12}") || note="no pytest-xdist: one process; "
  $VPY -c "import pagecheck_kernels" 2>/dev/null || { args+=(--continue-on-collection-errors); note+="kernels not built: partial; "; }
  # SIGINT at the timeout: pytest stops as on Ctrl-C and still writes the report of what ran
  limited -s INT "$t" $VPY -m conformance --impl gpu.paged:paged_attention --out "$OUT/catalog" "${args[@]}" \
    > "$OUT/catalog.log" 2>&1
  rc=$?
  tail -15 "$OUT/catalog.log"
  record catalog "$rc" $((SECONDS - t0)) "${note}timeout ${t} s (124: hit); $(grep -E -m1 '(passed|failed).* in ' "$OUT/catalog.log")"
}

echo "h200: steps ${STEPS[*]}; deadline ${DEADLINE} s; out $OUT"
versions
if ! wants setup; then  # what an earlier call's setup left on this machine
  if [ -x "$VENV/bin/python" ]; then
    VPY=$VENV/bin/python
    export PATH="$root/$VENV/bin:$PATH"
  elif [ -d "$SITE" ]; then
    export PYTHONPATH="$root/$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$root/$SITE/bin:$PATH"
  fi
fi
wants setup && run_setup
wants bench && run_bench
wants memcheck && run_memcheck
wants catalog && run_catalog
{
  echo "# gpu/h200.sh steps ($(date -u +%FT%TZ), ${SECONDS} s)"
  echo
  echo "| step | rc | s | note |"
  echo "|---|---|---|---|"
  tail -n +2 "$OUT/steps.tsv" | awk -F'\t' '{print "| " $1 " | " $2 " | " $3 " | " $4 " |"}'
} > "$OUT/steps.md"
cat "$OUT/steps.md"
exit "$FIRST_FAIL"
