#!/usr/bin/env bash
# The multi-process tests, run again and again while CPU hogs keep every core busy; prints how many runs failed.
#
#   tests/stress.sh [RUNS] [PYTEST ARGS...]      e.g.  tests/stress.sh 5      tests/stress.sh 3 -m slow
#
# RUNS (default 5) runs of tests/distributed and every other test that starts processes (gloo groups of the
# harness, Lightning's ddp_spawn, a recipe under FSDP), one after the other, each with `pytest -x`; extra
# arguments go to pytest (without `-m`, the tests marked slow are left out, as in `python -m pytest`).
# Environment: HOGS (busy processes, default: one per core), PARALLEL (pytest runs at once in each round,
# default 1; 2 also races two test processes for ports), PYTHON (default .venv/bin/python).
# Logs go to a temporary folder, which is printed; the exit code is the number of failed runs (at most 255).
set -uo pipefail
cd "$(dirname "$0")/.."

RUNS=${1:-5}
shift $(($# > 0 ? 1 : 0))
PYTHON=${PYTHON:-.venv/bin/python}
HOGS=${HOGS:-$(nproc)}
PARALLEL=${PARALLEL:-1}
TESTS=(
    tests/distributed
    tests/measurement/test_rank_groups.py
    tests/measurement/test_sharded_halves.py
    tests/integration/test_spawn_results.py
    tests/integration/test_progress_bar.py
    tests/integration/test_batchnorm_and_swa.py
    tests/integration/test_batch_size_schedule.py
    tests/integration/test_stream_packages.py
    tests/recipes/test_recipes_fsdp.py
)
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/simigrad-stress.XXXXXX")

hogs=()
stop_hogs() {
    for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${hogs[@]}"; do wait "$pid" 2>/dev/null; done
}
trap stop_hogs EXIT
trap 'exit 130' INT TERM
for _ in $(seq "$HOGS"); do
    yes >/dev/null &
    hogs+=($!)
done

load() { cut -d' ' -f1-3 /proc/loadavg; }
echo "stress: $RUNS run(s) x $PARALLEL of ${TESTS[*]} $*"
echo "stress: $HOGS CPU hog(s) on $(nproc) core(s); logs in $LOGS"
failed=0
started=$SECONDS
for run in $(seq "$RUNS"); do
    begin=$SECONDS
    pids=()
    for copy in $(seq "$PARALLEL"); do
        log="$LOGS/run$run.$copy.log"
        "$PYTHON" -m pytest -q -x -p no:cacheprovider "${TESTS[@]}" "$@" >"$log" 2>&1 &
        pids+=($!)
    done
    for copy in $(seq "$PARALLEL"); do
        log="$LOGS/run$run.$copy.log"
        if wait "${pids[$((copy - 1))]}"; then
            verdict=passed
        else
            verdict=FAILED
            failed=$((failed + 1))
        fi
        echo "run $run.$copy: $verdict in $((SECONDS - begin)) s, load average $(load): $(tail -n 1 "$log")"
        grep -E "^(FAILED|ERROR) " "$log" | sed 's/^/    /'
    done
done
total=$((RUNS * PARALLEL))
echo "stress: $failed of $total run(s) failed in $((SECONDS - started)) s; load average at the end $(load)"
exit $((failed > 255 ? 255 : failed))
