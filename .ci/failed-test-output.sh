#!/usr/bin/env bash
# Prints, once more, the output of every test that the last ctest run in build directory $1 did not pass, read from
# its Testing/Temporary/LastTest.log. ctest's --output-on-failure prints a failure where it happens, in the middle
# of a long log, and CI keeps only the log's tail: this puts the failures at the end, where they are read.
set -euo pipefail
dir=$1
failed=$dir/Testing/Temporary/LastTestsFailed.log
log=$dir/Testing/Temporary/LastTest.log
[ -f "$failed" ] && [ -f "$log" ] || exit 0
echo "ci: the output of the tests that failed in $dir (from $log):"
# LastTestsFailed.log: "<number>:<name>" per line; LastTest.log: a block per test from "<i>/<n> Testing: <name>"
# to its "time elapsed" line.
awk -v list="$failed" '
  BEGIN { while ((getline l < list) > 0) { sub(/^[0-9]+:/, "", l); want[l] = 1 } }
  /^[0-9]+\/[0-9]+ Testing: / { name = $0; sub(/^[0-9]+\/[0-9]+ Testing: /, "", name); on = (name in want) }
  on { print }
  on && / time elapsed: / { on = 0; print "" }' "$log"
