#!/usr/bin/env bash
# Instructions per message, counted by valgrind's callgrind: a figure that
# does not move with the machine's load, so that a change of a few percent
# in the service's own CPU shows above the noise that msg/s and CPU time
# carry on a shared machine.
#
#   bash benches/instructions.sh [scenario ...]    (default: handwritten inbox_on inbox_default)
#
# Each scenario of benches/throughput.rs runs twice under callgrind, with
# 3,000 and 6,000 events; the difference, divided by 3,000, is what one
# more message costs this process (the service and the publisher that
# prefills its queue), setup excluded. Only user-space instructions are
# counted: the kernel's work for the system calls is not. Under valgrind the
# process runs some 50 times slower, so deliveries arrive in other groups
# than at full speed: compare figures of one run of this script, not with
# the bench's CPU times. Needs valgrind (Debian: apt-get install valgrind)
# and the servers the bench uses (DATABASE_URL, AMQP_URL).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "instructions: valgrind is not installed" >&2; exit 1; }
bench=$(cargo bench --bench throughput --no-run --message-format=json 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*throughput[^"]*\)".*/\1/p' | tail -1)
[ -x "$bench" ] || { echo "instructions: no bench executable" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
[ $# -gt 0 ] || set -- handwritten inbox_on inbox_default

collected() { # scenario count
    valgrind --tool=callgrind --callgrind-out-file="$out/cg" "$bench" --bench \
        --count "$2" --scenarios "$1" 2>&1 >/dev/null |
        sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}

for scenario in "$@"; do
    small=$(collected "$scenario" 3000)
    large=$(collected "$scenario" 6000)
    echo "instructions scenario=$scenario per_message=$(((large - small) / 3000))"
done
