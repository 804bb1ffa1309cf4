#!/bin/sh
# The netem tier, run inside the user-mode-linux guest by run_uml.sh (a kernel with sch_netem):
# the shaping tests, `testbed linkcheck` on every shipped profile against its bars, and a short
# netns replay whose run.json must say the WAN was shaped by netem. Exit status: 0 when all pass.
# PYTHON is the venv's interpreter; LINKCHECK_ARGS adds flags to linkcheck_all.py (--strict).
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
out=build/netem
rc=0
t0=$(date +%s)
step() { echo "netem tier: $1 ($(( $(date +%s) - t0 ))s)"; }

step "pytest: the shaping tests under netem"
# No plugin autoload: these tests need none, and importing them all costs the guest half a minute.
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PYTHON" -m pytest -q -m netns -p no:cacheprovider --durations=5 \
    tests/netem/test_netem_kernel.py \
    "tests/test_netns.py::test_netem_probe_matches_the_kernel" \
    "tests/test_netns.py::test_htb_rate64_and_runtime_change" \
    || { echo "netem tier: FAILED pytest"; rc=1; }

# The guest's one slow CPU carries about 100 Mbit/s through the WAN namespace: 50 Mbit/s on the
# wire leaves the link, not the CPU, as the bottleneck (speedup 1: the profiles' own delays).
step "linkcheck under netem on netem_profiles/*.yaml"
# shellcheck disable=SC2086
"$PYTHON" tests/netem/linkcheck_all.py --json-out "$out/linkcheck.json" $LINKCHECK_ARGS \
    || { echo "netem tier: FAILED linkcheck"; rc=1; }

# One instance per role: the guest starts service processes one CPU-second after another, and
# each must answer /health within 60 s of the first.
step "replay paper-prfaas (1 PrfaaS prefill, 1 P + 1 D), 20 requests, netns backend"
rm -rf "$out/replay"
# Exit 3 is the testbed marking the run invalid (the guest's one CPU kept no time): its records and
# run.json are written all the same, and the shaping method is what this step checks.
replay_rc=0
"$PYTHON" -m testbed replay --scenario paper-prfaas --set workload.requests=20 --backend netns \
        --set clusters.0.prefill=1 --set clusters.1.prefill=1 --set clusters.1.decode=1 \
        --set workload.output_tokens=64 --set serving.stream_interval=8 \
        --out "$out/replay" || replay_rc=$?
if [ "$replay_rc" = 0 ] || [ "$replay_rc" = 3 ]; then
    "$PYTHON" - "$out/replay" <<'PY' || { echo "netem tier: FAILED replay shaping"; rc=1; }
import json, pathlib, sys
runs = sorted(pathlib.Path(sys.argv[1]).rglob("run.json"))
methods = {str(p): json.loads(p.read_text()).get("shaping", {}).get("method") for p in runs}
print(f"run.json shaping.method: {methods}")
sys.exit(0 if methods and set(methods.values()) == {"netem"} else 1)
PY
else
    echo "netem tier: FAILED replay (exit $replay_rc)"; rc=1
fi
step "done, exit $rc"
exit $rc
