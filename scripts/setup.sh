#!/usr/bin/env bash
# Create .venv and install the package with the extras asked for (default: dev, the test tools),
# idempotently:  bash scripts/setup.sh [EXTRAS]   e.g.  bash scripts/setup.sh examples,cli,plot
#
# Fast when nothing changed: a stamp in .venv records which extras were installed for which
# pyproject.toml (its sha256); when it matches (or the dev extras, which include the others, were
# installed for it) and torch imports, pip is not run at all. When the package is installed for this
# pyproject.toml with other extras (the demo's, then the tests ask for dev), only the requirements
# those extras lack are installed (scripts/missing_requirements.py): the package and what is there
# stay as they are. Set PIPETRANSFORMER_REINSTALL=1 to install everything anyway.
#
# setuptools prints a banner on every editable install (a BuildBackendWarning, "Editable
# installation ... Please be careful with folders ..."): hidden unless PIPETRANSFORMER_HIDE_NOISE=0.
#
# CPU-only machine (no nvidia-smi): torch is pinned to the CPU build 2.13.0 first,
# so nothing later can pull a multi-GB CUDA build. PyPI's Linux torch wheels depend
# on the CUDA libraries, so when PyTorch's CPU index is reachable it is added (its
# 2.13.0+cpu wins); where it is not (a mirror or a local wheel directory provides
# torch, as on our CI machines) pip's own configuration decides. A machine with an NVIDIA GPU
# gets pip's default (CUDA) torch. Set PIPETRANSFORMER_TORCH to choose yourself
# (e.g. PIPETRANSFORMER_TORCH="torch==2.13.0"), or install into your own
# environment with `pip install -e ".[dev]"` and keep the torch you have.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-dev}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
STAMP=.venv/.pipetransformer-setup
HASH=$("$VPY" -c "import hashlib, sys; print(hashlib.sha256(open('pyproject.toml', 'rb').read()).hexdigest())")
if [ -z "${PIPETRANSFORMER_REINSTALL:-}" ] && [ -f "$STAMP" ] \
    && { grep -qx "$HASH $EXTRAS" "$STAMP" || grep -qx "$HASH dev" "$STAMP"; } \
    && "$VPY" -c "import torch, lightning" 2>/dev/null; then
    echo "setup: .venv is set up for this pyproject.toml [$EXTRAS]: pip not run"
    echo "       (PIPETRANSFORMER_REINSTALL=1 bash scripts/setup.sh to reinstall)"
    exit 0
fi
stamp() {  # Last, and only after a complete install: an older pyproject's lines are dropped.
    { grep -s "^$HASH " "$STAMP" || true; echo "$HASH $EXTRAS"; } | sort -u > "$STAMP.new"
    mv "$STAMP.new" "$STAMP"
}
if [ -z "${PIPETRANSFORMER_REINSTALL:-}" ] && grep -qs "^$HASH " "$STAMP" \
    && "$VPY" -c "import torch, lightning" 2>/dev/null \
    && missing=$("$VPY" scripts/missing_requirements.py "$EXTRAS"); then
    # The package is installed for this pyproject.toml with other extras: add what [$EXTRAS] lacks.
    if [ -n "$missing" ]; then
        echo "setup: .venv has the package; adding what [$EXTRAS] lacks:"
        echo "$missing" | tr '\n' ' ' | fold -s -w 72 | sed 's/^/       /'
        echo
        # shellcheck disable=SC2086  # one requirement per word (none holds a space)
        "$VPY" -m pip install -q $missing
    else
        echo "setup: .venv already has everything [$EXTRAS] needs: pip not run"
    fi
    stamp
    exit 0
fi
CPU_INDEX=https://download.pytorch.org/whl/cpu
"$VPY" -m pip install -q --upgrade pip
if ! "$VPY" -c "import torch" 2>/dev/null; then
    if [ -n "${PIPETRANSFORMER_TORCH:-}" ]; then
        spec="$PIPETRANSFORMER_TORCH"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        spec="torch"
    else
        spec="torch==2.13.0"
        if "$VPY" -c "import urllib.request; urllib.request.urlopen('$CPU_INDEX/torch/', timeout=10)" 2>/dev/null; then
            index_args="--extra-index-url $CPU_INDEX"
        fi
    fi
    echo "setup: installing $spec ${index_args:-}"
    # shellcheck disable=SC2086  # index_args is empty or two words
    "$VPY" -m pip install -q ${index_args:-} "$spec"
fi
if [ "${PIPETRANSFORMER_HIDE_NOISE:-1}" = 1 ]; then
    # The build backend runs in a subprocess that inherits this; only the banner's warning is ignored.
    PYTHONWARNINGS="ignore:Editable installation${PYTHONWARNINGS:+,$PYTHONWARNINGS}" "$VPY" -m pip install -q -e ".[$EXTRAS]"
else
    "$VPY" -m pip install -q -e ".[$EXTRAS]"
fi
"$VPY" -c "import torch, lightning; print(f'setup: torch {torch.__version__}, lightning {lightning.__version__}')"
stamp
