#!/usr/bin/env bash
# Apply deadpool-megatron's hook patches to a Megatron-LM checkout at a supported release tag.
#
#   scripts/apply_megatron_patch.sh MEGATRON_LM_DIR
#
# Checks the checkout's release (megatron/core/package_info.py, and the git tag when it is a git
# checkout), checks that every patch of the series applies before applying any, applies them,
# and builds Megatron-LM's C++ dataset helper for this Python (its Makefile asks
# `python3-config`, which can name another interpreter). Nothing is changed when a check fails.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${1:-}
if [ -z "$dir" ] || [ ! -f "$dir/megatron/core/package_info.py" ] || [ ! -f "$dir/pretrain_gpt.py" ]; then
    echo "usage: $0 MEGATRON_LM_DIR   (a Megatron-LM checkout: it must hold pretrain_gpt.py and megatron/core)" >&2
    echo "got: '${dir}'" >&2
    exit 2
fi
python=${PYTHON:-python}
version=$(cd "$dir" && "$python" - <<'PY'
import importlib.util
spec = importlib.util.spec_from_file_location("info", "megatron/core/package_info.py")
info = importlib.util.module_from_spec(spec)
spec.loader.exec_module(info)
print(f"{info.MAJOR}.{info.MINOR}.{info.PATCH}{info.PRE_RELEASE}")
PY
)
# A series is named by its release tag; one whose tag's package reports another version
# (core_v0.19.0 says 0.19.1) names that version in its package_version file.
tag="core_v$version"
series="$here/patches/megatron-lm-$tag"
for candidate in "$here"/patches/megatron-lm-*; do
    if [ -f "$candidate/package_version" ] && [ "$(cat "$candidate/package_version")" = "$version" ]; then
        series=$candidate
        tag=${candidate##*/megatron-lm-}
    fi
done
if [ ! -d "$series" ]; then
    supported=$(cd "$here/patches" && ls -d megatron-lm-* | sed 's/^megatron-lm-//' | tr '\n' ' ')
    echo "error: $dir is Megatron-LM $tag; patches exist for: $supported" >&2
    echo "check out a supported tag first, e.g. git -C $dir checkout core_v0.16.1" >&2
    exit 1
fi
if git -C "$dir" rev-parse --git-dir >/dev/null 2>&1; then
    at=$(git -C "$dir" describe --tags --exact-match 2>/dev/null || echo "")
    if [ "$at" != "$tag" ]; then
        echo "warning: $dir is not at tag $tag (git describe: '${at:-no tag}'); trying anyway" >&2
    fi
fi

cd "$dir"
failed=0
for patch in "$series"/*.patch; do
    if git apply --reverse --check "$patch" 2>/dev/null; then
        echo "already applied: $(basename "$patch")"
        continue
    fi
    if ! out=$(git apply --check --verbose "$patch" 2>&1); then
        echo "does not apply: $(basename "$patch")" >&2
        echo "$out" | grep -E "^error|^Checking|patch failed" | sed 's/^/    /' >&2
        failed=1
    fi
done
if [ "$failed" = 1 ]; then
    echo "nothing was changed: the checkout differs from Megatron-LM $tag where the hooks go" \
         "(local edits?). 'git -C $dir status' shows what changed." >&2
    exit 1
fi
for patch in "$series"/*.patch; do
    if ! git apply --reverse --check "$patch" 2>/dev/null; then
        git apply "$patch"
        echo "applied: $(basename "$patch")"
    fi
done

# Megatron-LM's dataset index helper, built for the Python that will run it.
suffix=$("$python" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
helper="megatron/core/datasets/helpers_cpp$suffix"
if [ ! -f "$helper" ]; then
    if includes=$("$python" -m pybind11 --includes 2>/dev/null); then
        # shellcheck disable=SC2086
        g++ -O3 -Wall -shared -std=c++17 -fPIC $includes megatron/core/datasets/helpers.cpp -o "$helper"
        echo "built: $helper"
    else
        echo "note: pybind11 is missing, so Megatron-LM's dataset helper was not built" \
             "(pip install pybind11, then run this again)" >&2
    fi
fi
# Rank 0 runs the helper's Makefile at start-up, which asks `python3-config` for the suffix; a
# pyenv shim there obeys Megatron-LM's own .python-version, which may name another Python.
if [ -f .python-version ] && command -v pyenv >/dev/null; then
    mine=$("$python" -c "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')")
    if [ "$(cut -d. -f1,2 .python-version)" != "$mine" ]; then
        echo "note: $dir/.python-version asks pyenv for Python $(cat .python-version), this is" \
             "$mine: run the job with PYENV_VERSION set to yours (or python3 first on PATH)" >&2
    fi
fi
missing=$("$python" - <<'PY'
import importlib.util
needed = ("six", "regex", "pydantic", "pybind11", "triton", "deadpool_megatron")
print(" ".join(m for m in needed if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
    echo "note: Megatron-LM's pretrain_gpt.py imports modules this Python lacks: $missing" >&2
    echo "      (pip install them; deadpool_megatron: pip install -e $here)" >&2
fi
if grep -qs "^from typing import .*override" megatron/training/models/*.py \
        && ! "$python" -c "from typing import override" 2>/dev/null; then
    echo "note: Megatron-LM $tag imports typing.override, which needs Python 3.12 or newer;" \
         "this is $("$python" -c 'import platform; print(platform.python_version())')" \
         "(the project's tests put typing_extensions' backport in place: tests/py311)" >&2
fi
echo "Megatron-LM $tag in $dir is patched: run its pretrain_gpt.py under deadpool-launch with --deadpool"
