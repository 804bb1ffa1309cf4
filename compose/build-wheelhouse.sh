#!/usr/bin/env bash
# Fill compose/wheels/ with the project's wheel and the wheels of its runtime dependencies and of its
# routers extra (vllm-router and sglang-router run in the router's container; not the dev or
# analysis extras), for the image's Python (CPython 3.11, glibc 2.36, x86_64 = Debian
# bookworm amd64), so that `docker build` installs with `pip install --no-index` and needs no network.
#
# Usage: compose/build-wheelhouse.sh [--clean]
#   --clean   empty compose/wheels/ first (otherwise wheels already there are reused, and when they
#             already satisfy every requirement no index is contacted at all)
#
# Environment (all optional):
#   PYTHON          host Python that runs pip (.venv/bin/python, else python3.11, else python3);
#                   the project wheel is pure Python and the dependencies are fetched for the target
#                   below with pip's --platform/--python-version, so any host Python >= 3.11 works
#   TARGET_PYTHON   the image's Python version              (3.11)
#   TARGET_ARCH     the image's machine                     (x86_64)
#   TARGET_GLIBC    the image's glibc, newest manylinux tag (2.36)
#   WHEELHOUSE      output directory                        (compose/wheels)
#   NICE            niceness of the heavy steps             (10)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
WHEELHOUSE=${WHEELHOUSE:-$repo/compose/wheels}
TARGET_PYTHON=${TARGET_PYTHON:-3.11}
TARGET_ARCH=${TARGET_ARCH:-x86_64}
TARGET_GLIBC=${TARGET_GLIBC:-2.36}
NICE=${NICE:-10}

clean=0
for arg in "$@"; do
    case "$arg" in
        --clean) clean=1 ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build-wheelhouse: unknown argument: $arg (try --help)" >&2; exit 2 ;;
    esac
done

log() { printf 'build-wheelhouse: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

if [ -z "${PYTHON:-}" ]; then
    if [ -x "$repo/.venv/bin/python" ]; then PYTHON=$repo/.venv/bin/python
    elif command -v python3.11 >/dev/null; then PYTHON=python3.11
    else PYTHON=python3; fi
fi
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
    || die "$PYTHON is missing or older than 3.11 (set PYTHON=...)"
"$PYTHON" -m pip --version >/dev/null 2>&1 || die "$PYTHON has no pip"
host_py=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$host_py" = "$TARGET_PYTHON" ] || log "note: host Python is $host_py, wheels are fetched for $TARGET_PYTHON"

t_start=$EPOCHREALTIME
elapsed() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

mkdir -p "$WHEELHOUSE"
if [ "$clean" = 1 ]; then rm -rf "$WHEELHOUSE"/*.whl "$WHEELHOUSE/build-backend"; fi
rm -f "$WHEELHOUSE"/prfaas_testbed-*.whl

# 1. The project's wheel, built from a clean copy of its sources: an in-tree build would leave
#    build/ and *.egg-info behind, and a stale build/lib can put deleted modules into the wheel. The
#    hot modules' compiled build (testbed.compiled) is the host's, not the image's: left out.
src=$(mktemp -d "${TMPDIR:-/tmp}/prfaas-wheel.XXXXXX")
trap 'rm -rf "$src"' EXIT
tar -C "$repo" --exclude=__pycache__ --exclude='*.pyc' --exclude='*.so' --exclude=_compiled.stamp \
    -cf - pyproject.toml README.md testbed \
    $(cd "$repo" && ls -d LICENSE* 2>/dev/null || true) | tar -C "$src" -xf -
# The build backend (pyproject's build-system.requires) is kept in wheels/build-backend/, so a
# rebuild after a source change needs no index either.
backend=$WHEELHOUSE/build-backend
build_wheel() {
    nice -n "$NICE" "$PYTHON" -m pip wheel -q --no-deps --no-index --find-links "$backend" -w "$WHEELHOUSE" "$src"
}
if build_wheel 2>/dev/null; then
    log "pip wheel the project (build backend from $backend)"
else
    mapfile -t backend_reqs < <("$PYTHON" -c 'import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]))' "$repo/pyproject.toml")
    log "pip wheel the project (fetching its build backend: ${backend_reqs[*]})"
    "$PYTHON" -m pip download -q --only-binary=:all: -d "$backend" "${backend_reqs[@]}" \
        || die "downloading the build backend failed"
    build_wheel || die "building the project's wheel failed"
fi
project_whl=$(ls "$WHEELHOUSE"/prfaas_testbed-*.whl)
# With the routers extra: `--router vllm-router | sglang-router` runs the real router in the image.
wanted="$project_whl[routers]"

# 2. Its runtime dependencies, as binary wheels for the target (manylinux_2_17 .. manylinux_<glibc>).
platforms=()
glibc_minor=${TARGET_GLIBC#2.}
for ((m = glibc_minor; m >= 17; m--)); do platforms+=(--platform "manylinux_2_${m}_${TARGET_ARCH}"); done
platforms+=(--platform "manylinux2014_${TARGET_ARCH}")
target=(--only-binary=:all: "${platforms[@]}" --python-version "$TARGET_PYTHON"
        --implementation cp --abi "cp${TARGET_PYTHON/./}")
if "$PYTHON" -m pip download -q --no-index --find-links "$WHEELHOUSE" "${target[@]}" \
        -d "$WHEELHOUSE" "$wanted" >/dev/null 2>&1; then
    log "dependencies: every one already in the wheelhouse (no index contacted)"
else
    log "dependencies: pip download from the index"
    nice -n "$NICE" "$PYTHON" -m pip download -q --find-links "$WHEELHOUSE" "${target[@]}" \
        -d "$WHEELHOUSE" "$wanted" || die "downloading the dependencies failed"
fi

n=$(ls "$WHEELHOUSE"/*.whl | wc -l)
log "$n wheels, $(du -sh "$WHEELHOUSE" | cut -f1) in $WHEELHOUSE; took $(elapsed "$t_start") s"
