#!/usr/bin/env bash
# Run levers9's test suite against several torch releases, one venv per release.
#
#   usage: compat_tests/torch_range.sh VERSION... [-- PYTEST_ARGS...]
#   e.g.   compat_tests/torch_range.sh 2.8.0 2.15.0 -- -x -k test_detect
#
# Each release gets (or reuses) a venv in $LEVERS9_TORCH_RANGE_DIR/torch-VERSION (default
# ${XDG_CACHE_HOME:-~/.cache}/levers9-torch-range), with that torch and `pip install -e '<repo>[test,ray]'`;
# then `python -m pytest -q` runs in the repo with it. Prints one summary line per release and exits
# non-zero if any release failed. Releases other than the CPU build download as CUDA builds (3-7 GB each).
# Where a pip constraint caps torch (e.g. /etc/xdg/pip/constraints.txt), run with PIP_CONFIG_FILE=/dev/null.
set -euo pipefail

repo=${LEVERS9_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}  # the checkout this script lives in
root=${LEVERS9_TORCH_RANGE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/levers9-torch-range}
python=${PYTHON:-python3}

versions=()
while (($#)) && [[ $1 != -- ]]; do versions+=("$1"); shift; done
(($#)) && shift  # the --
((${#versions[@]})) || { echo "usage: $0 VERSION... [-- PYTEST_ARGS...]  (e.g. $0 2.8.0 2.15.0)" >&2; exit 2; }

mkdir -p "$root"
summary=()
status=0
for ver in "${versions[@]}"; do
    venv=$root/torch-$ver
    log=$root/torch-$ver.log
    echo "== torch $ver: venv $venv, log $log"
    if ! { [[ -x $venv/bin/python ]] || "$python" -m venv "$venv"; } >"$log" 2>&1 \
        || ! "$venv/bin/python" -m pip install -q "torch==$ver" -e "$repo[test,ray]" >>"$log" 2>&1; then
        summary+=("torch $ver: INSTALL FAILED (see $log)"); status=1; continue
    fi
    got=$("$venv/bin/python" -c 'import torch; print(torch.__version__)' 2>>"$log") || got="(torch import failed)"
    rc=0
    (cd "$repo" && "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@") 2>&1 | tee -a "$log" || rc=$?
    last=$(grep -E '(passed|failed|error|no tests ran|deselected)' "$log" | tail -n 1 || true)
    summary+=("torch $ver ($got): exit $rc: ${last:-no pytest summary, see $log}")
    ((rc == 0)) || status=1
done
printf '%s\n' "${summary[@]}"
exit "$status"
