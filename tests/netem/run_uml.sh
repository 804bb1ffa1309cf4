#!/usr/bin/env bash
# Boot a user-mode-linux guest (a real kernel with sch_netem, run as an ordinary process, no KVM)
# over the host's / read-only, with this checkout writable, run a command in it and exit with its
# status. Default command: tests/netem/tier.sh, the netem tier. The kernel is Debian's
# `user-mode-linux` where it runs on this host's CPU, else a newer one fetched into build/uml/
# (tests/netem/uml_kernel.py chooses and says why). Exit 77: no kernel can be had here.
#
#   tests/netem/run_uml.sh [COMMAND...]     NETEM_TIMEOUT=seconds (default 900), NETEM_MEM=1500M
#
# The command runs as the guest's root, in the checkout, with PYTHON set to this venv's python;
# the guest's console (and so the command's output) is shown and kept in build/netem/console.log.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out="$repo/build/netem"
python=${PYTHON:-$repo/.venv/bin/python}
timeout_s=${NETEM_TIMEOUT:-900}
command -v insmod >/dev/null || { echo "run_uml: insmod not found (apt-get install kmod)" >&2; exit 2; }
mkdir -p "$out"
# Sets uml, kver and mods (the booted kernel's module tree), or exits 77 with the reason.
choice=$("$python" "$repo/tests/netem/uml_kernel.py" "$repo/build/uml") || exit $?
eval "$choice"

rm -f "$out/status"
printf 'mods=%q\n' "$mods" > "$out/guest.env"   # read by guest_init.sh
{
    printf 'export PYTHON=%q\n' "$python"
    if [ $# -gt 0 ]; then printf '%q ' "$@"; echo; else echo 'sh tests/netem/tier.sh'; fi
} > "$out/guest.cmd"

# UML keeps its guest memory in a file under TMPDIR and its control sockets under uml_dir.
work=$(mktemp -d "$( [ -d /dev/shm ] && echo /dev/shm || echo /tmp)/netem-uml.XXXXXX")
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
echo "run_uml: booting linux.uml $kver (timeout ${timeout_s}s): $(tail -1 "$out/guest.cmd")"
# setsid: the guest's host processes form one group, killed together if the guest hangs.
TMPDIR=$work setsid "$uml" mem="${NETEM_MEM:-1500M}" root=/dev/root rootfstype=hostfs rootflags=/ ro quiet \
    uml_dir="$work" init="$repo/tests/netem/guest_init.sh" con0=fd:0,fd:1 con=null \
    < /dev/null > >(tee "$out/console.log") 2>&1 &
pid=$!
while kill -0 "$pid" 2>/dev/null; do
    if [ $(( $(date +%s) - start )) -ge "$timeout_s" ]; then
        echo "run_uml: guest still running after ${timeout_s}s: killed" >&2
        kill -KILL -- "-$pid" 2>/dev/null || true
        break
    fi
    sleep 1
done
wait "$pid" 2>/dev/null || true
sleep 0.2   # let tee flush the console log
if [ ! -s "$out/status" ]; then
    echo "run_uml: the guest wrote no exit status ($(( $(date +%s) - start ))s; console in $out/console.log)" >&2
    exit 1
fi
rc=$(cat "$out/status")
echo "run_uml: guest command exited $rc after $(( $(date +%s) - start ))s"
exit "$rc"
