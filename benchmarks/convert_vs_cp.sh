#!/bin/sh
# One timed run of `headfold convert` or `cp -r`, for farm-bench to pair (benchmarks/results/convert_vs_cp.json):
#
#   farm-bench -n 3 --timeout 600 --vs "sh benchmarks/convert_vs_cp.sh cp SRC /tmp/b/cp" \
#       -- sh benchmarks/convert_vs_cp.sh convert SRC /tmp/b/out
#
# The previous run's output is renamed into /tmp/b/trash, not deleted: `rm -rf` of a synced 4 GB tree
# takes ~3.7 s of journal waits here, which would sit inside both timings and pull the ratio towards 1.
# Every file under OUT's folder (which must hold only these outputs, not SRC) is then dropped from
# the page cache (clean after the last `sync`), so that no run pays for reclaiming the ones before it.
# headfold on PATH; empty /tmp/b/trash between farm-bench calls.
set -e
mode=$1 src=$2 out=$3
trash=$(dirname "$out")/trash
mkdir -p "$trash"
[ ! -e "$out" ] || mv "$out" "$trash/$$-$(date +%s%N)"
python3 -c '
import os, sys
for top in sys.argv[1:]:
    for root, _, files in os.walk(top):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
' "$(dirname "$out")"
case $mode in
    convert) headfold convert "$src" "$out" --kv-heads 4 -q ;;
    cp) cp -r "$src" "$out" ;;
    *) echo "mode is convert or cp, not $mode" >&2; exit 2 ;;
esac
sync
