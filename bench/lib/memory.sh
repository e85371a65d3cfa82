# Sourced by the benchmarks: `warm_memory BYTES` before a timed command.
#
# Why: on this VM (a Firecracker guest with virtio-balloon free page reporting) memory
# that sat free for a few seconds is handed back to the host, and the next process to
# allocate it pays the host's fault for every page: touching 2 GiB of such memory took
# 3.5-5.8 s of system time here, against 1.1 s right after the same 2 GiB was touched and
# freed. Whichever timed command first writes a large file after a pause (pull after push,
# say) was billed seconds that belong to the hypervisor, not to the tool: the "first pull
# is slower" mystery (bench/results/BENCHMARKS-diary-2026-11-29-to-12-01.md, "What the
# 'first pull is slower' was"). So before each timed command, on both sides alike,
# BYTES of memory are touched and freed again; the command then finds backed free pages
# (they stay so for a few seconds). SNAPCTL_BENCH_WARM=0 turns it off, to see the effect.
warm_memory() {
  [ "${SNAPCTL_BENCH_WARM:-1}" = 1 ] || return 0
  python3 - "$1" <<'PY'
import sys
n = int(sys.argv[1])
avail = 0
for line in open("/proc/meminfo"):
    if line.startswith("MemAvailable:"):
        avail = int(line.split()[1]) * 1024
# Never push the machine into reclaim of more than half of what is available.
n = max(0, min(n, avail // 2))
b = bytearray(n)
b[::4096] = b"\x01" * len(range(0, n, 4096))
del b
PY
}

# `to_bytes 2GiB` -> 2147483648 (IEC suffixes as the benchmarks' options use them).
to_bytes() { case "$1" in *[0-9]) echo "$1" ;; *) numfmt --from=iec-i "${1%B}" ;; esac; }
