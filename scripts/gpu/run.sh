#!/bin/bash
# The GPU check, run on a lent GPU machine from the repository root, after
# scripts/gpu/prepare.sh here (the device tool carries .gpu/ with the checkout):
#   set -o pipefail; bash scripts/gpu/run.sh 2>&1 | tee $OUT/log.txt
# 1. installs .gpu/whl into /tmp/site (pip --no-index --no-deps --target) and puts an `mpic`
#    launcher on PATH; prints nvidia-smi and versions;
# 2. writes the 7B-shaped LLaVA, benchmarks it (`mpic bench offline`, bf16, flex attention,
#    images 1,8,16, full / full-reuse / mpic-32 / auto, 3 repeats), then the same for Qwen2-VL;
# 3. runs the gpu-marked tests from .gpu/proj (kernels, then engine/hf, then the rest).
# STAGES (default "llava qwen tests") picks and orders the stages; two more, for a second call:
#   ab       Qwen2-VL 7B, images 1,8, full / mpic-32 / auto under three configurations, each in
#            its own process: flex with the compiled layer step (the default), flex with
#            MPIC_COMPILE_LAYERS=0, sdpa_runs;
#   profile  scripts/gpu/host_profile.py: where the host time of one mpic-32 prefill goes.
# Everything fits BUDGET seconds (default 480) from the start: each step runs under `timeout`
# capped by what is left, and is skipped, with a message, when too little is left.
# Results in $OUT (at most 8 files: what the device tool brings back): summary.txt (the tables,
# recompile counts, test results), steps.tar.gz (each step's full output, <step>.out, refreshed
# after every step), llava7b.json/.png, qwen2vl7b.json/.png (and ab-*.json with the ab stage).
# Overrides: IMAGES (1,8,16), REPEATS (3), RESERVE_LLAVA (seconds kept for Qwen2-VL and the tests
# when LLaVA's bench starts, 200), TESTS=0 (no tests): a short second call.
# DRY=1: the same on this CPU machine (no wheel install; PY_DRY, default .venv/bin/python; tiny
# models, cpu float32, images 1,2, 1 repeat; the gpu tests skip without CUDA): about 2 minutes.
set -u -o pipefail
cd "$(dirname "$0")/../.." || exit 2
ROOT=$(pwd)
G=$ROOT/.gpu
PKG_DIRS="mpic cli deployments linker kernels storage presses retriever engine benchmarks"

source_hash() {  # the package sources and pyproject.toml (prepare.sh records it in MANIFEST)
  find $PKG_DIRS pyproject.toml -type f \( -name '*.py' -o -name '*.yaml' -o -name '*.json' \
    -o -name '*.toml' \) -not -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z |
    xargs -0 sha1sum | sha1sum | cut -c1-12
}
if [ "${1:-}" = "--source-hash" ]; then source_hash; exit 0; fi

: "${OUT:?set OUT to the results folder}"
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET=${BUDGET:-480}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export COLUMNS=260  # rich tables at full width in a pipe
el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
SUM=$OUT/summary.txt
STAGES=${STAGES:-llava qwen tests}
say() { echo "$@" | tee -a "$SUM"; }
FAILED=0
NOISE='Warning|warnings\.warn|\[__recompiles\]'

if [ -n "${DRY:-}" ]; then
  MODE="DRY (cpu)" SIZE=tiny DEV=cpu DT=float32 IMAGES=1,2 REPEATS=1
  PY=${PY_DRY:-.venv/bin/python}
  case $PY in /*) ;; */*) PY=$ROOT/$PY ;; esac  # absolute, symlinks kept (a venv's python)
  W=$(mktemp -d /tmp/mpic-gpu.XXXXXX)
  trap 'rm -rf "$W"' EXIT
  AB_IMAGES=1,2
else
  MODE="GPU" SIZE=7b DEV=cuda DT=bfloat16 IMAGES=${IMAGES:-1,8,16} REPEATS=${REPEATS:-3}
  PY=$(command -v "${PY:-python3}") || { echo "no python3"; exit 3; }  # absolute: a shebang
  W=/tmp/mpic-gpu; rm -rf "$W"; mkdir -p "$W"
  AB_IMAGES=1,8
fi
STEPS=$W/steps  # each step's full output, archived into $OUT/steps.tar.gz after every step
mkdir -p "$STEPS"
: > "$SUM"
say "mpic GPU check, $MODE, budget $BUDGET s, $(date -u +%FT%TZ)"
[ -f "$G/MANIFEST" ] && say "$(sed 's/^/  /' "$G/MANIFEST")"
want=$(awk '/^source-hash/ {print $2}' "$G/MANIFEST" 2>/dev/null)
have=$(source_hash)
if [ "$want" != "$have" ]; then
  say "WARNING: the checkout (source-hash $have) is not what .gpu was built from (${want:-none}):" \
    "re-run scripts/gpu/prepare.sh"
fi

if [ -z "${DRY:-}" ]; then
  echo "=== install .gpu/whl into /tmp/site"
  rm -rf /tmp/site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$G"/whl/*.whl 2>&1 | grep -v -e 'WARNING: Target directory' -e "as the 'root' user" || true
  [ -d /tmp/site/mpic ] || { echo "wheel install failed"; exit 3; }
  export PYTHONPATH=/tmp/site
  nvidia-smi
fi
mkdir -p "$W/bin"
printf '#!%s\nimport sys\nfrom mpic.cli import main\nsys.argv[0] = "mpic"\nsys.exit(main())\n' \
  "$PY" > "$W/bin/mpic"
chmod +x "$W/bin/mpic"
export PATH=$W/bin:$PATH
cd "$W" || exit 2  # not the repository root: `import mpic` must find the installed package
vers=$("$PY" - 2>&1 <<'EOF'
import importlib.metadata as md
import sys

import torch
import transformers

import mpic

cuda = torch.cuda.is_available()
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (cuda {torch.version.cuda}), "
      f"transformers {transformers.__version__}")
try:
    import triton
    print(f"triton {triton.__version__}")
except ImportError:
    print("triton: absent")
print("device:", torch.cuda.get_device_name(0) if cuda else "cpu")
print(", ".join(f"{n} {md.version(n)}" for n in ("pydantic", "pydantic-core", "typing-extensions")))
print("mpic from", mpic.__file__)
EOF
) || { echo "$vers"; echo "the project does not import"; exit 3; }
say "$vers"

TOPOPS=()
help=$(mpic bench offline --help 2>&1)  # (grep -q on a pipe could cut it off: SIGPIPE)
if grep -q -- --top-ops <<< "$help"; then TOPOPS=(--top-ops 15)
else say "note: this mpic bench offline has no --top-ops: left out"; fi
if ! "$PY" -c "import matplotlib" 2>/dev/null; then say "note: no matplotlib: no plots"; fi

# step NAME NEED CAP CMD...: CMD under `timeout` (signal $SIG, default TERM) for min(CAP, left)
# seconds, skipped when that is under NEED; full output in $STEPS/NAME.out (and the archive),
# filtered on stdout.
step() {
  local name=$1 need=$2 cap=$3 l rc t
  shift 3
  l=$(left)
  [ "$cap" -gt "$l" ] && cap=$l
  if [ "$cap" -lt "$need" ]; then
    say "=== SKIP $name: $l s of the budget left, needs $need s"
    return 99
  fi
  echo "=== $name (t=$(el) s, timeout ${cap} s)"
  t=$(date +%s)
  timeout -k 15 -s "${SIG:-TERM}" "$cap" "$@" 2>&1 | tee "$STEPS/$name.out" |
    grep --line-buffered -vE "$NOISE"
  rc=${PIPESTATUS[0]}
  tar -czf "$OUT/steps.tar.gz" -C "$STEPS" .
  local why=""
  [ "$rc" = 124 ] && why=" (TIMEOUT)"
  say "=== $name: rc $rc$why after $(( $(date +%s) - t )) s (t=$(el) s)"
  [ "$rc" = 0 ] || FAILED=1
  return "$rc"
}

bench() {  # bench TAG FAMILY RESERVE: write the model, benchmark it, leave RESERVE s for the rest
  local tag=$1 family=$2 reserve=$3 plot=()
  "$PY" -c "import matplotlib" 2>/dev/null && plot=(--plot "$OUT/$tag.png")
  step "make-$tag" 40 150 mpic model make-tiny --family "$family" --size "$SIZE" \
    --out "$W/$tag" || return
  step "bench-$tag" 60 $(( $(left) - reserve )) env TORCH_LOGS=recompiles \
    mpic bench offline --model "$W/$tag" --engine reference --device "$DEV" --dtype "$DT" \
    --attention flex --images "$IMAGES" --policies full,full-reuse,mpic-32,auto \
    --repeats "$REPEATS" --threads 0 "${TOPOPS[@]}" --json "$OUT/$tag.json" "${plot[@]}"
  local rc=$? f=$STEPS/bench-$tag.out
  rm -rf "${W:?}/$tag"  # a 7B folder is ~15 GB
  [ "$rc" = 99 ] && return
  {
    echo
    sed -n '/MPIC offline benchmark/,/^└/p' "$f" | grep -q . &&
      sed -n '/MPIC offline benchmark/,/^└/p' "$f" || echo "(no table: rc $rc)"
    # Compiled FlexAttention must stay bounded: dynamo's recompiles (TORCH_LOGS), limit-hit
    # messages (dynamo's, and kernels/flex.py's on an eager fall), the rows' eager_falls.
    echo "$tag: dynamo recompiles $(grep -c 'Recompiling function' "$f")" \
      "(FlexAttention's $(grep -c 'Recompiling function [^ ]*flex' "$f")), recompile-limit" \
      "messages $(grep -ciE "hit (config\.(recompile|cache_size)_limit|dynamo's recompile limit)" "$f")" \
      "$(cd "$W" && "$PY" - "$OUT/$tag.json" 2>/dev/null <<'EOF'
import json
import sys

rows = json.load(open(sys.argv[1]))["results"]
falls = [r["eager_falls"] for r in rows if r.get("eager_falls") is not None]
graphs = [r["compiled_graphs"] for r in rows if r.get("compiled_graphs") is not None]
if falls or graphs:
    print(f"; rows: eager falls {sum(falls)}, compiled graphs {max(graphs, default='-')}")
else:
    print("; no eager_falls in the rows")
EOF
)"
  } | tee -a "$SUM"
}

stage_llava() { bench llava7b llava "${RESERVE_LLAVA:-200}"; }  # Qwen2-VL and some tests to come
stage_qwen() { bench qwen2vl7b qwen2-vl 70; }  # the kernel tests, at least

stage_tests() {  # the gpu-marked tests, against the installed wheel, in priority order
  PROJ=$G/proj
  if [ -d "$PROJ/tests" ] && [ "${TESTS:-1}" = 1 ]; then
    cd "$PROJ" || exit 2
    # the fused corrected attention and the CUDA reference runner lead their groups
    mapfile -t files < <(grep -rlE --include='test_*.py' 'pytest\.mark\.gpu' tests | LC_ALL=C sort |
      awk '/test_correction|test_reference_runner_gpu/ {print; next} {rest[n++] = $0}
           END {for (i = 0; i < n; i++) print rest[i]}')
    kernels=() hf=() rest=()
    for f in "${files[@]}"; do
      case $f in tests/kernels/*) kernels+=("$f") ;; tests/engine/hf/*) hf+=("$f") ;;
        *) rest+=("$f") ;; esac
    done
    run_tests() {  # run_tests NAME RESERVE FILE...: leave RESERVE s for later groups if possible
      local name=$1 cap=$(( $(left) - $2 ))
      shift 2
      [ $# -gt 0 ] || return
      [ "$cap" -lt 30 ] && cap=$(left)
      # SIGINT at the timeout: pytest stops and still prints what failed so far
      SIG=INT step "$name" 30 "$cap" "$PY" -m pytest -q -p no:cacheprovider \
        -m gpu -rfE --continue-on-collection-errors "$@"
      [ $? = 99 ] && return  # skipped
      { echo "$name ($*):"; grep -E '^(FAILED|ERROR) ' "$STEPS/$name.out" | head -20
        tail -n 1 "$STEPS/$name.out"; } | tee -a "$SUM"
    }
    echo >> "$SUM"
    run_tests tests-kernels 60 "${kernels[@]}"
    run_tests tests-engine-hf 20 "${hf[@]}"
    run_tests tests-rest 0 "${rest[@]}"
    cd "$W" || true
  else
    say "=== SKIP tests: no .gpu/proj (run scripts/gpu/prepare.sh)"
  fi
}

ab_model() {  # the Qwen2-VL model of the ab and profile stages (written once)
  [ -d "$W/ab" ] || step make-ab 40 150 mpic model make-tiny --family qwen2-vl --size "$SIZE" \
    --out "$W/ab"
}

stage_ab() {  # one process per configuration: the compiled layer step's and the backend's worth
  ab_model || return
  local attention mode name
  for attention in flex:compiled flex:eager sdpa_runs:compiled; do
    mode=${attention#*:} attention=${attention%:*} name=ab-${attention}-${mode}
    step "$name" 40 $(( $(left) - 40 )) env $([ "$mode" = eager ] && echo MPIC_COMPILE_LAYERS=0) \
      mpic bench offline --model "$W/ab" --engine reference --device "$DEV" --dtype "$DT" \
      --attention "$attention" --images "$AB_IMAGES" --policies full,mpic-32,auto \
      --repeats "$REPEATS" --threads 0 --json "$OUT/$name.json"
    { echo; echo "$name:"; sed -n '/MPIC offline benchmark/,/^└/p' "$STEPS/$name.out"; } |
      tee -a "$SUM"
  done
}

stage_profile() {  # where the host time of one mpic-32 prefill goes (cProfile)
  ab_model || return
  step host-profile 40 120 "$PY" "$ROOT/scripts/gpu/host_profile.py" "$W/ab" --device "$DEV" \
    --dtype "$DT"
  { echo; echo "host-profile:"; head -n 40 "$STEPS/host-profile.out"; } | tee -a "$SUM"
}

for stage in $STAGES; do
  case $stage in
    llava | qwen | tests | ab | profile) "stage_$stage" ;;
    *) say "=== unknown stage $stage (llava, qwen, tests, ab, profile)"; FAILED=1 ;;
  esac
done
rm -rf "${W:?}/ab"

say ""
say "done in $(el) s of $BUDGET s; $([ "$FAILED" = 0 ] && echo 'every step passed' || echo 'some step FAILED or timed out')"
exit "$FAILED"
