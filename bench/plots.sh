#!/usr/bin/env bash
# The plots of BENCHMARKS.md, drawn from the raw runs in bench/results/ (nothing is
# measured here): python3 (standard library) takes medians of the JSON lines, gnuplot
# (Debian's gnuplot-nox, installed by `scripts/setup.sh --tests`) draws SVG into
# bench/plots/. Run it after a bench/wan.sh run that replaces the figures, and commit
# the SVG files with the results.
#
#   bash bench/plots.sh                       the current figures (below)
#   bash bench/plots.sh --capped FILE.jsonl --uncapped FILE.jsonl
#
# Plots:
#   restore-vs-rtt.svg   restore time against RTT, one panel per bandwidth cap: pull and
#                        each lazy pattern of bench/wan.sh (clustered, scattered, warm,
#                        replay, all), medians of the runs
#   fault-latency.svg    fault latency as a CDF at 20 ms RTT, 1 Gbit/s, for each lazy
#                        pattern: the guest's view (a vCPU's first touch of a missing data
#                        page) and the daemon's (fault read -> installed); the runs
#                        record quantiles (p50, p99), so each curve is drawn through
#                        those points, medians of the runs
set -euo pipefail
cd "$(dirname "$0")/.."

CAPPED=bench/results/wan-2026-12-01-issue16-table.jsonl
UNCAPPED=bench/results/wan-2026-12-01-issue16-uncapped.jsonl
while [ $# -gt 0 ]; do
  case "$1" in
    --capped) CAPPED=$2; shift 2 ;;
    --uncapped) UNCAPPED=$2; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
command -v gnuplot >/dev/null || { echo "gnuplot not found: bash scripts/setup.sh --tests (Debian's gnuplot-nox)" >&2; exit 2; }

OUT=bench/plots
mkdir -p "$OUT"
DATA=$(mktemp -d)
trap 'rm -rf "$DATA"' EXIT

# Medians per (cap, RTT, path) into gnuplot data blocks: one file per cap for the restore
# times, one for the latency quantiles.
python3 - "$CAPPED" "$UNCAPPED" "$DATA" <<'EOF'
import json, statistics, sys
capped, uncapped, out = sys.argv[1:4]
PATHS = ["pull", "clustered", "scattered", "warm", "replay", "all"]
runs = {}
def load(path, keep):
    for line in open(path):
        line = line.strip()
        if not line:
            continue
        r = json.loads(line)
        cap = str(r["rate"] or "none")
        if r.get("path") in PATHS and keep(cap):
            runs.setdefault((cap, r["rtt_ms"], r["path"]), []).append(r)
# The uncapped rows of the capped run still had an older prefetch bound: those come from
# the uncapped run (as in BENCHMARKS.md).
load(capped, lambda cap: cap != "none")
load(uncapped, lambda cap: cap == "none")
med = lambda rs, k: statistics.median(r[k] for r in rs if r.get(k) is not None)
for cap in ["none", "1gbit", "200mbit"]:
    rtts = sorted({rtt for (c, rtt, _) in runs if c == cap})
    with open(f"{out}/restore-{cap}.dat", "w") as f:
        f.write("rtt_ms " + " ".join(PATHS) + "\n")
        for rtt in rtts:
            cells = [f"{med(runs[(cap, rtt, p)], 'seconds'):.3f}" if (cap, rtt, p) in runs else "NaN" for p in PATHS]
            f.write(f"{rtt} " + " ".join(cells) + "\n")
with open(f"{out}/latency.dat", "w") as f:
    # One block per lazy pattern: (latency ms, fraction) points of the guest's and the
    # daemon's view at 20 ms, 1gbit.
    for p in PATHS[1:]:
        rs = runs.get(("1gbit", 20, p), [])
        if not rs:
            continue
        # The staircase the quantiles bound from below: at least half the faults by p50,
        # at least 99 % by p99.
        g50, g99 = med(rs, "touch_p50_us") / 1000, med(rs, "touch_p99_us") / 1000
        d50, d99 = med(rs, "fault_p50_us") / 1000, med(rs, "fault_p99_us") / 1000
        f.write(f"# {p}\n")
        for g, d, q in [(g50, d50, 0), (g50, d50, 0.5), (g99, d99, 0.5), (g99, d99, 0.99), (g99 * 4, d99 * 4, 0.99)]:
            f.write(f"{g:.4f} {d:.4f} {q}\n")
        f.write("\n\n")
EOF

LABELS='"snapctl pull" "lazy, clustered 5 %" "lazy, scattered 5 % (cold)" "scattered, warm chunk cache" "scattered, --prefetch trace (replay)" "scattered, --prefetch all"'

gnuplot <<EOF
set terminal svg size 1200,500 dynamic font "sans,11" background rgb "white"
set output "$OUT/restore-vs-rtt.svg"
set multiplot layout 1,3 title "Restore of a 2 GiB image (5 % of pages touched) against round-trip time: medians of 3 runs, bench/wan.sh 2026-12-01"
labels = '$LABELS'
set xlabel "RTT (ms)"
set ylabel "seconds (log)"
set logscale y
set grid ytics mytics xtics lc rgb "#dddddd"
set xtics (0, 2, 20, 50)
set xrange [-2:52]
set bmargin 9
set key at screen 0.5, 0.06 center horizontal maxrows 2 font ",10" width 2
do for [cap in "none 1gbit 200mbit"] {
  set title (cap eq "none" ? "no bandwidth cap" : cap eq "1gbit" ? "1 Gbit/s" : "200 Mbit/s")
  if (cap ne "none") { unset key }
  plot for [i=2:7] "$DATA/restore-".cap.".dat" using 1:i with linespoints lt (i-1) lw 2 pt 7 ps 0.6 title word(labels, i-1)
}
unset multiplot
EOF

gnuplot <<EOF
set terminal svg size 900,420 dynamic font "sans,11" background rgb "white"
set output "$OUT/fault-latency.svg"
set multiplot layout 1,2 title "Fault latency at 20 ms RTT, 1 Gbit/s (bench/wan.sh 2026-12-01, medians of 3 runs):\nthe CDF as the recorded quantiles bound it: at least 50 % of faults by p50, 99 % by p99"
names = "clustered scattered warm replay all"
labels = '"clustered 5 %" "scattered 5 % (cold)" "scattered, warm cache" "--prefetch trace (replay)" "--prefetch all"'
set logscale x
set xlabel "latency (ms, log)"
set ylabel "fraction of faults at or below"
set yrange [0:1.05]
set ytics (0, 0.5, 0.9, 0.99, 1)
set grid xtics ytics lc rgb "#dddddd"
set key top left font ",9"
set title "the guest: a vCPU's first touch of a missing data page"
plot for [i=0:4] "$DATA/latency.dat" index i using 1:3 with lines lt (i+2) lw 2 title word(labels, i+1)
unset key
set title "the daemon: fault read -> page installed (every kind)"
plot for [i=0:4] "$DATA/latency.dat" index i using 2:3 with lines lt (i+2) lw 2 title word(labels, i+1)
unset multiplot
EOF

echo "wrote $OUT/restore-vs-rtt.svg and $OUT/fault-latency.svg" >&2
