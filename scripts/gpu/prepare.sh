#!/bin/bash
# Prepare .gpu/ (ignored by git) for one run of scripts/gpu/run.sh on a lent GPU machine.
# Run here, from the repository root, with network to PyPI:  bash scripts/gpu/prepare.sh
#
#   .gpu/whl   the project's wheel (built from a clean copy of the working tree, uncommitted
#              edits included) and cp312 manylinux wheels of the packages the GPU machine lacks
#              (pydantic and its set, blake3, dill, a newer typing-extensions); it has no index.
#   .gpu/proj  tests/ and pyproject.toml, so the tests run outside the source tree against the
#              installed wheel.
#   .gpu/MANIFEST  what was built (commit, dirty files, source hash that run.sh re-checks).
# Re-run after every source change: run.sh warns when the checkout differs from the wheel.
set -euo pipefail
[ -f pyproject.toml ] && [ -d scripts/gpu ] || { echo "run from the repository root" >&2; exit 2; }
PY=${PY:-.venv/bin/python}
G=.gpu
# The packages the GPU machine lacks (typing-extensions: its own is too old for pydantic 2.x).
# Pinned to this venv's versions (the ones the tests pass with); pydantic-core comes as pydantic
# pins it (pip resolves the dependencies, all within this list).
PKGS="pydantic pydantic-core pydantic-settings annotated-types typing-inspection python-dotenv
  blake3 dill typing-extensions"

rm -rf "$G/whl" "$G/proj" "$G/MANIFEST"
mkdir -p "$G/whl" "$G/proj"

# Tracked and untracked-but-not-ignored files (what the device tool copies), deleted ones left out.
tree_files() {
  git ls-files -z -co --exclude-standard -- "$@" |
    while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done
}
copy_tree() {  # copy_tree DEST PATHSPEC...
  local dest=$1; shift
  tree_files "$@" | tar --null -T - -cf - | tar -xf - -C "$dest"
}

quiet() { grep -v -e 'is ignored: it is neither a file nor a directory' || true; }  # pip.conf noise

echo "== project wheel"
src=$(mktemp -d /tmp/mpic-wheel-src.XXXXXX)
trap 'rm -rf "$src"' EXIT
copy_tree "$src" .
"$PY" -m pip wheel --no-deps -q -w "$G/whl" "$src" 2>&1 | quiet

echo "== dependency wheels (cp312, manylinux x86_64)"
pins=$("$PY" - $PKGS <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}" if name != "pydantic-core" else name)
    except PackageNotFoundError:
        print(name)
EOF
)
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$G/whl" $pins 2>&1 | quiet

# pydantic pins pydantic-core exactly: check the pair, and that nothing else came along.
"$PY" - "$G/whl" $PKGS <<'EOF'
import re
import sys
import zipfile
from pathlib import Path

whl, wanted = Path(sys.argv[1]), {n.replace("-", "_").lower() for n in sys.argv[2:]}
wheels = {p.name.split("-")[0].lower(): p for p in whl.glob("*.whl")}
extra = set(wheels) - wanted - {"mpic_serve"}
missing = wanted - set(wheels)
with zipfile.ZipFile(wheels["pydantic"]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    pin = re.search(r"^Requires-Dist: pydantic-core==([^\s;]+)", z.read(meta).decode(), re.M)
core = wheels["pydantic_core"].name.split("-")[1]
print(f"pydantic {wheels['pydantic'].name.split('-')[1]} pins pydantic-core "
      f"{pin.group(1) if pin else '?'}; downloaded {core}")
if missing or extra or not pin or pin.group(1) != core:
    sys.exit(f"wheel set wrong: missing {sorted(missing)}, extra {sorted(extra)}")
EOF

echo "== tests (run outside the source tree)"
copy_tree "$G/proj" tests pyproject.toml

{
  echo "built $(date -u +%FT%TZ) from $(git rev-parse --short HEAD)"
  echo "dirty: $(git status --porcelain -- . ':!.gpu' | wc -l) files"
  echo "source-hash $(bash scripts/gpu/run.sh --source-hash)"
} > "$G/MANIFEST"
cat "$G/MANIFEST"
ls -l "$G/whl" | awk 'NR > 1 {printf "  %8.1f KiB  %s\n", $5 / 1024, $9}'
total=$(du -sb "$G" | cut -f1)
awk -v b="$total" 'BEGIN {printf "total .gpu: %.1f MiB (the device tool carries at most 64 MiB)\n", b / 1048576}'
[ "$total" -lt $((48 * 1048576)) ] || { echo "too large to carry" >&2; exit 1; }
cat <<'EOF'

Now one device call (run tool), from the repository root, carry [".gpu"], timeout_s ~590:
  set -o pipefail; bash scripts/gpu/run.sh 2>&1 | tee $OUT/log.txt
A second call at once after it (the machine stays warm 30 s), if device time is left:
  set -o pipefail; STAGES="ab profile" BUDGET=280 bash scripts/gpu/run.sh 2>&1 | tee $OUT/log.txt
Dry run here first (tiny models on the CPU, ~2 min):
  mkdir -p /tmp/gpudry; DRY=1 OUT=/tmp/gpudry bash scripts/gpu/run.sh 2>&1 | tee /tmp/gpudry/log.txt
EOF
