#!/usr/bin/env bash
# The package as a user installs it: build hftc's wheel, install it into a fresh venv that
# already holds torch (the CPU build pinned in the Makefile, installed first so pip never
# resolves torch itself: any other spec pulls GBs of CUDA; HFTC_CHECK_WHEEL_SITE=DIR links the
# packages of the site-packages DIR in instead), and check that the install kept
# that torch, that `hftc --help` answers without torch, and that `hftc bench` runs outside
# the source checkout.  Usage: scripts/check_wheel.sh [PYTHON]  (default python3)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${1:-python3}
torch_spec=$(sed -n 's/^TORCH *:= *//p' "$root/Makefile")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$python" -m pip wheel -q --no-deps -w "$work/dist" "$root"
"$python" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip install -q --disable-pip-version-check)
if [ -n "${HFTC_CHECK_WHEEL_SITE:-}" ]; then
    # The torch a user already has, from another environment's site-packages (CI: the
    # project's .venv), hard-linked in: unpacking the torch wheel again takes minutes.
    # hftc's own editable install stays behind, so the wheel is what gets imported.
    site=$("$work/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    for entry in "$HFTC_CHECK_WHEEL_SITE"/*; do
        case $(basename "$entry") in
            hftc*|__editable__*hftc*) continue ;;
        esac
        [ -e "$site/$(basename "$entry")" ] && continue  # the venv's own pip, setuptools
        cp -al "$entry" "$site/" 2>/dev/null || cp -a "$entry" "$site/"
    done
else
    "${pip[@]}" "$torch_spec"
fi
before=$("$work/venv/bin/python" -c "from importlib.metadata import version; print(version('torch'))")
"${pip[@]}" "$work"/dist/hftc-*.whl
after=$("$work/venv/bin/python" -c "from importlib.metadata import version; print(version('torch'))")
[ "$before" = "$after" ] || { echo "check_wheel: installing hftc replaced torch $before by $after" >&2; exit 1; }

cd "$work"  # away from the checkout: everything below must come from the installed package
"$work/venv/bin/python" - <<'PY'
import os, subprocess, sys, time
start = time.perf_counter()
subprocess.run([os.path.join(os.path.dirname(sys.executable), "hftc"), "--help"], check=True,
               capture_output=True)
help_s = time.perf_counter() - start
code = "import sys, hftc.__main__ as m; m.build_parser(); print('torch' in sys.modules)"
assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                      check=True).stdout.strip() == "False", "the CLI's parser imported torch"
print(f"check_wheel: hftc --help {help_s:.2f} s")
PY
PATH="$work/venv/bin:$PATH" hftc bench --workloads mlp --sizes 2 --contenders serial,hftc \
    --rounds 1 --compile-sizes '' --max-n '' --out "$work/results/mlp.json" >"$work/bench.log"
[ -s "$work/results/mlp.json" ] || { cat "$work/bench.log"; exit 1; }
grep "N=2" "$work/bench.log" | head -1
echo "check_wheel: ok (torch $after kept)"
