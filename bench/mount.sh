#!/usr/bin/env bash
# The host-mount benchmark: `snapctl mount` presenting one image to many test VMMs
# (tests/src/bin/fake_vmm --map-file: map the mounted vm.mem MAP_PRIVATE, read every page
# and check it against the original, write WRITE_PCT of its pages, hold, check again).
#
#   bash bench/mount.sh                  1 GiB image; N = 1 2 4 8 16 64; 3 runs of the read race
#   bash bench/mount.sh --quick          64 MiB, N = 1 2 4, 1 run: a smoke test, not a result
#   bash bench/mount.sh --warm-only      the warm cases only (1 GiB unless --size)
#
# Options: --size SIZE  --ns "1 2 4"  --lazy-ns "1 2"  --runs N  --clones N  --warm-only  --keep
# (--lazy-ns "" --clones 0 --runs 0: the flatten cases only)
#
# Measures (source: an OCI layout on local disk; fresh chunk cache per case):
#   flatten     N VMMs on one mount, sampled once every VMM has read all of its memory and
#               written its own pages: sum Rss / sum Pss over the VMMs (/proc/PID/smaps_rollup);
#               ideal N / (1 + w N), w the written share. Bytes the daemon fetched vs the
#               image's stored bytes (its pack blobs).
#   lazy        the same guests restored by `snapctl lazy` (one daemon per guest, --once,
#               warm cache), for --lazy-ns: their flatten.
#   clones      --clones clones of one base, each with its own WRITE_PCT of 4 KiB pages,
#               packed with --base and restored through DIR/.clone (base mapped, own pages
#               over it): flatten.
#   read race   every file read whole through a cold mount (fresh cache, the defaults) vs
#               `snapctl pull` of the image to a directory: median of --runs, ratio (from
#               `snapctl mount` to `snapctl umount` answered, and of the reads alone; the
#               daemon's exit, after it wrote its queued chunks to the cache, beside).
#   warm        a new mount over a warm chunk cache (completed by a mount's fill first),
#               --passthrough off: sequential read of vm.mem (GB/s, every read through the
#               daemon); then 4 KiB random reads (pread, one page cache miss each: a new
#               mount) p50/p99 µs.
#   passthrough a mount whose fill and whole-file copies are done (--prefetch all): vm.mem
#               read whole through the mount (FUSE passthrough) against a direct read of
#               its copy in the cache's mount-files/, alternating, the page cache dropped
#               before each (echo 3 > /proc/sys/vm/drop_caches): medians of 3 (GB/s) and
#               their ratio; then 4 KiB random reads through the mount and of the copy
#               (page cache dropped first, pread, POSIX_FADV_RANDOM) p50/p99 µs, and the
#               same again hot (the copy read whole first, so in the page cache).
#
# Output: JSON lines in bench/results/mount-DATE.jsonl and a summary on stdout. Needs root
# and /dev/fuse, python3. SNAPCTL / FAKE_VMM pick binaries (default target/debug: the dev
# profile is optimized).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SIZE=1GiB NS="1 2 4 8 16 64" LAZY_NS="1 2 4 8" RUNS=3 CLONES=8 KEEP=0 WRITE_PCT=1.7 WARM_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) SIZE=64MiB; NS="1 2 4"; LAZY_NS="1 2"; RUNS=1; CLONES=2 ;;
    --size) SIZE=$2; shift ;;
    --ns) NS=$2; shift ;;
    --lazy-ns) LAZY_NS=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --clones) CLONES=$2; shift ;;
    --keep) KEEP=1 ;;
    --warm-only) WARM_ONLY=1; NS=""; LAZY_NS=""; CLONES=0 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "mount.sh: unknown option $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
TARGET=${CARGO_TARGET_DIR:-$ROOT/target}
export SNAPCTL=${SNAPCTL:-$TARGET/debug/snapctl} FAKE_VMM=${FAKE_VMM:-$TARGET/debug/fake_vmm}
[ -x "$SNAPCTL" ] && [ -x "$FAKE_VMM" ] || { echo "mount.sh: build snapctl and fake_vmm first" >&2; exit 2; }
WORK=$(mktemp -d /var/tmp/snapctl-mount-bench.XXXXXX)
export WORK SIZE NS LAZY_NS RUNS CLONES WRITE_PCT WARM_ONLY
export OUT="$ROOT/bench/results/mount-$(date -u +%F).jsonl"
cleanup() {
  for d in "$WORK"/m-*; do mountpoint -q "$d" 2>/dev/null && "$SNAPCTL" umount --lazy "$d" >/dev/null 2>&1; done
  mountpoint -q "$WORK/host" 2>/dev/null && umount -l "$WORK/host"
  [ "$KEEP" = 1 ] || rm -rf "$WORK"
}
trap cleanup EXIT
python3 - <<'PY'
import glob, json, os, random, shutil, statistics, subprocess, time

W, SN, VMM, OUT = os.environ["WORK"], os.environ["SNAPCTL"], os.environ["FAKE_VMM"], os.environ["OUT"]
SIZE, RUNS, CLONES, PCT = os.environ["SIZE"], int(os.environ["RUNS"]), int(os.environ["CLONES"]), float(os.environ["WRITE_PCT"])
WARM_ONLY = os.environ["WARM_ONLY"] == "1"
NS = [int(x) for x in os.environ["NS"].split()]
LAZY_NS = [int(x) for x in os.environ["LAZY_NS"].split()]
ENV = dict(os.environ, SNAPCTL_MOUNT_HOST=f"{W}/host")
DATE = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def sh(*a):
    return subprocess.run(a, check=True, capture_output=True, text=True, env=ENV).stdout


def emit(rec):
    rec = {"bench": "mount", "date": DATE, "size": SIZE, **rec}
    with open(OUT, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(json.dumps(rec), flush=True)


def rollup(pid):
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            k, _, v = line.partition(":")
            if v.strip().endswith("kB"):
                out[k] = int(v.split()[0]) * 1024
    return out


class Mount:
    def __init__(self, ref, name, cache, extra=()):
        self.dir = f"{W}/m-{name}"
        os.makedirs(self.dir, exist_ok=True)
        self.log, self.out = f"{W}/{name}.log", f"{W}/{name}.json"
        args = [SN, "mount", ref, self.dir, "--json", "--cache", cache, *extra]
        self.p = subprocess.Popen(args, env=ENV, stdout=open(self.out, "w"), stderr=open(self.log, "w"))
        deadline = time.time() + 120
        while "shown in" not in open(self.log).read():
            if self.p.poll() is not None or time.time() > deadline:
                raise SystemExit(f"mount {ref}: {open(self.log).read()}")
            time.sleep(0.02)

    def umount(self, wait=True):
        sh(SN, "umount", "--wait", self.dir)
        self.unmounted = time.time()
        if not wait:  # the first mount runs the host mount: it ends with the last DIR
            return None
        self.p.wait(timeout=120)
        self.exited = time.time()
        return json.loads(open(self.out).read().strip() or "{}")


snap = f"{W}/snap"
t = time.time()
sh(SN, "sample", snap, "--size", SIZE, "--seed", "7")
sh(SN, "pack", snap, f"oci:{W}/layout:v1")
print(f"# sample + pack {SIZE}: {time.time() - t:.0f} s", flush=True)
REF = f"oci:{W}/layout:v1"
MEM = os.path.getsize(f"{snap}/vm.mem")
PAGES = MEM // 4096
WPAGES = round(PAGES * PCT / 100)


def stored_bytes():
    return sum(os.path.getsize(b) for b in glob.glob(f"{W}/layout/blobs/sha256/*") if os.path.getsize(b) > 65536)


STORED = stored_bytes()


def hold_and_sample(procs, ready, label):
    """Poll the guests until every one is ready(rollup); sum Rss and Pss then."""
    deadline = time.time() + 1800
    while True:
        rs = []
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"{label}: a guest ended before every guest was ready: {p.args} {p.returncode}")
            rs.append(rollup(p.pid))
        if all(ready(r) for r in rs):
            rss, pss = sum(r["Rss"] for r in rs), sum(r["Pss"] for r in rs)
            return rss, pss
        if time.time() > deadline:
            raise SystemExit(f"{label}: guests not ready")
        time.sleep(0.25)


def check_guests(procs, label):
    bad = 0
    for p in procs:
        out, err = p.communicate(timeout=1800)
        j = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        if p.returncode != 0 or j.get("mismatches", 1) != 0:
            bad += 1
            print(f"# {label}: guest failed ({p.returncode}): {err[-400:]}", flush=True)
    return bad


def mapped_guests(n, mem, truth, extra, write_pages):
    hold = 1000 * int(20 + 2 * n)
    return [
        subprocess.Popen(
            [VMM, "--map-file", mem, "--mem-file", truth, *extra, "--write-pages", str(write_pages), "--hold-ms", str(hold), "--json", "--seed", str(i)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(n)
    ]


def ready_mapped(r):
    return r.get("Rss", 0) >= 0.95 * MEM and r.get("Private_Dirty", 0) >= 0.9 * WPAGES * 4096


def ideal(n):
    return n / (1 + PCT / 100 * n)


# 1. flatten: N guests on one mounted vm.mem.
for n in NS:
    m = Mount(REF, f"f{n}", f"{W}/cache-f{n}", ["--prefetch", "none"])
    t = time.time()
    procs = mapped_guests(n, f"{m.dir}/vm.mem", f"{snap}/vm.mem", [], WPAGES)
    rss, pss = hold_and_sample(procs, ready_mapped, f"flatten n={n}")
    secs = time.time() - t
    bad = check_guests(procs, f"flatten n={n}")
    rep = m.umount()
    emit({"case": "flatten", "runtime": "mount", "n": n, "flatten": round(rss / pss, 2), "ideal": round(ideal(n), 2),
          "sum_rss": rss, "sum_pss": pss, "bytes_fetched": rep.get("bytes_fetched"), "stored_bytes": STORED,
          "fetched_over_stored": round(rep.get("bytes_fetched", 0) / STORED, 3), "fetched_chunks": rep.get("fetched_chunks"),
          "verify_failures": rep.get("verify_failures"), "guests_failed": bad, "seconds_to_all_ready": round(secs, 1)})
    if n != 1:
        shutil.rmtree(f"{W}/cache-f{n}", ignore_errors=True)

# 1b. the same guests through snapctl lazy (warm cache), one daemon per guest.
for n in LAZY_NS:
    daemons, guests = [], []
    for i in range(n):
        sock, go = f"{W}/lz{n}-{i}.sock", f"{W}/lz{n}-{i}.go"
        daemons.append(subprocess.Popen([SN, "lazy", REF, "--socket", sock, "--once", "--prefetch", "none", "--fill", "off", "--cache", f"{W}/cache-f1"],
                                        env=ENV, stdout=subprocess.DEVNULL, stderr=open(f"{W}/lz{n}-{i}.log", "w")))
        deadline = time.time() + 60
        while not os.path.exists(sock):
            assert time.time() < deadline and daemons[-1].poll() is None, open(f"{W}/lz{n}-{i}.log").read()
            time.sleep(0.02)
        guests.append(subprocess.Popen([VMM, "--socket", sock, "--mem-file", f"{snap}/vm.mem", "--touch", "all", "--then-wait-for", go,
                                        "--then-touch", "0", "--json", "--timeout", "1200", "--seed", str(i)],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    # Ready: every page touched (zero pages are the shared zero page, outside Rss).
    rss, pss = hold_and_sample(guests, lambda r: all(os.path.exists(f"{W}/lz{n}-{i}.go.waiting") for i in range(n)), f"lazy n={n}")
    for i in range(n):
        open(f"{W}/lz{n}-{i}.go", "w").close()
    bad = check_guests(guests, f"lazy n={n}")
    for d in daemons:
        d.wait(timeout=120)
    emit({"case": "flatten", "runtime": "lazy", "n": n, "flatten": round(rss / pss, 2), "ideal": round(ideal(n), 2),
          "sum_rss": rss, "sum_pss": pss, "guests_failed": bad})

# 2. clones of one base through the clone layout.
if CLONES:
    mounts, truths = [], []
    for i in range(CLONES):
        c = f"{W}/clone{i}"
        os.makedirs(c, exist_ok=True)
        subprocess.run(["cp", "--sparse=always", f"{snap}/vm.mem", f"{snap}/vm.state", c], check=True)
        rng = random.Random(100 + i)
        with open(f"{c}/vm.mem", "r+b") as f:
            for pg in rng.sample(range(PAGES), WPAGES):
                f.seek(pg * 4096)
                f.write(rng.randbytes(4096))
        sh(SN, "pack", c, f"oci:{W}/layout:c{i}", "--base", REF)
        mounts.append(Mount(f"oci:{W}/layout:c{i}", f"c{i}", f"{W}/cache-f1", ["--prefetch", "none"]))
        truths.append(f"{c}/vm.mem")
    procs = []
    for i, m in enumerate(mounts):
        cl = f"{m.dir}/.clone"
        procs += mapped_guests(1, f"{cl}/vm.mem.base", truths[i], ["--pages", f"{cl}/vm.mem.pages", "--page-map", f"{cl}/vm.mem.pagemap"], 0)
    ready = lambda r: r.get("Rss", 0) >= 0.95 * MEM and r.get("Private_Dirty", 0) >= 0.9 * WPAGES * 4096
    rss, pss = hold_and_sample(procs, ready, "clones")
    bad = check_guests(procs, "clones")
    for m in mounts:
        m.umount(wait=False)
    for m in mounts:
        m.p.wait(timeout=120)
    emit({"case": "clones", "n": CLONES, "flatten": round(rss / pss, 2), "ideal": round(ideal(CLONES), 2), "sum_rss": rss, "sum_pss": pss, "guests_failed": bad})


def read_all(d):
    total = 0
    for root, _, files in os.walk(d):
        for fn in files:
            with open(os.path.join(root, fn), "rb", buffering=0) as f:
                while b := f.read(1 << 20):
                    total += len(b)
    return total


# 4. every file whole through a cold mount vs snapctl pull.
if RUNS == 0 and not WARM_ONLY:
    raise SystemExit(0)
mt, rt, pt, xt = [], [], [], []
for r in range(0 if WARM_ONLY else RUNS):
    shutil.rmtree(f"{W}/cache-r", ignore_errors=True)
    t = time.time()
    m = Mount(REF, f"r{r}", f"{W}/cache-r", [])
    t2 = time.time()
    read_all(m.dir)
    rt.append(time.time() - t2)
    m.umount()
    mt.append(m.unmounted - t)
    # After `umount` answered, the daemon writes the chunks still queued for the cache.
    xt.append(m.exited - t)
    shutil.rmtree(f"{W}/cache-p", ignore_errors=True)
    shutil.rmtree(f"{W}/pulled", ignore_errors=True)
    t = time.time()
    sh(SN, "pull", REF, f"{W}/pulled", "--cache", f"{W}/cache-p")
    pt.append(time.time() - t)
if not WARM_ONLY:
    emit({"case": "read_all_cold", "mount_s": [round(x, 2) for x in mt], "read_s": [round(x, 2) for x in rt], "pull_s": [round(x, 2) for x in pt],
         "daemon_exit_s": [round(x, 2) for x in xt],
         "median_ratio": round(statistics.median(mt) / statistics.median(pt), 2), "median_ratio_reads_only": round(statistics.median(rt) / statistics.median(pt), 2)})

# 5. warm: chunk cache warm (a mount's fill completed it: the reads above skip the cache
# when its disk is behind), page cache of a new mount cold.
m = Mount(REF, "w0", f"{W}/cache-r", ["--passthrough", "off"])
deadline = time.time() + 600
while "fill done" not in open(m.log).read():
    assert time.time() < deadline and m.p.poll() is None, open(m.log).read()
    time.sleep(0.1)
m.umount()
m = Mount(REF, "w", f"{W}/cache-r", ["--prefetch", "none", "--passthrough", "off"])
t = time.time()
with open(f"{m.dir}/vm.mem", "rb", buffering=0) as f:
    n = 0
    while b := f.read(1 << 20):
        n += len(b)
seq = n / (time.time() - t) / 1e9
m.umount()
m = Mount(REF, "w2", f"{W}/cache-r", ["--prefetch", "none", "--passthrough", "off"])
fd = os.open(f"{m.dir}/vm.mem", os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
lat = []
rng = random.Random(5)
for pg in rng.sample(range(PAGES), min(4000, PAGES)):
    t = time.perf_counter_ns()
    os.pread(fd, 4096, pg * 4096)
    lat.append((time.perf_counter_ns() - t) / 1000)
os.close(fd)
rep = m.umount()
lat.sort()
emit({"case": "warm", "seq_gb_s": round(seq, 2), "rand4k_p50_us": round(lat[len(lat) // 2], 1), "rand4k_p99_us": round(lat[int(len(lat) * 0.99)], 1),
      "daemon_read_p99_us": rep.get("read_latency_us", {}).get("p99"), "passthrough_files": rep.get("passthrough_files"),
      "cache_slice_reads": rep.get("cache_slice_reads"), "fetched_chunks": rep.get("fetched_chunks")})


# 6. passthrough: the same warm cache, a mount that has copied vm.mem whole.
def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def seq_read(path):
    drop_caches()
    t = time.time()
    n = 0
    with open(path, "rb", buffering=0) as f:
        while b := f.read(1 << 20):
            n += len(b)
    assert n == MEM, (path, n)
    return n / (time.time() - t) / 1e9


def rand_reads(path, seed, drop=True):
    if drop:
        drop_caches()
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    lat = []
    for pg in random.Random(seed).sample(range(PAGES), min(4000, PAGES)):
        t = time.perf_counter_ns()
        os.pread(fd, 4096, pg * 4096)
        lat.append((time.perf_counter_ns() - t) / 1000)
    os.close(fd)
    lat.sort()
    return round(lat[len(lat) // 2], 1), round(lat[int(len(lat) * 0.99)], 1)


m = Mount(REF, "pt", f"{W}/cache-r", ["--prefetch", "all"])
deadline = time.time() + 600
while "vm.mem: complete: later opens are served by FUSE passthrough" not in open(m.log).read():
    assert time.time() < deadline and m.p.poll() is None, open(m.log).read()
    time.sleep(0.1)
copy = [c for c in glob.glob(f"{W}/cache-r/mount-files/*/*") if os.path.getsize(c) == MEM]
assert len(copy) == 1, copy
mnt, direct = [], []
for r in range(3):
    mnt.append(seq_read(f"{m.dir}/vm.mem"))
    direct.append(seq_read(copy[0]))
mp50, mp99 = rand_reads(f"{m.dir}/vm.mem", 6)
dp50, dp99 = rand_reads(copy[0], 6)
# Hot: the copy in the page cache (read whole once), as a file a restored guest keeps reading.
with open(copy[0], "rb", buffering=0) as f:
    while f.read(1 << 20):
        pass
hp50, hp99 = rand_reads(f"{m.dir}/vm.mem", 7, drop=False)
hdp50, hdp99 = rand_reads(copy[0], 7, drop=False)
rep = m.umount()
emit({"case": "warm_passthrough", "seq_gb_s": [round(x, 2) for x in mnt], "copy_seq_gb_s": [round(x, 2) for x in direct],
      "median_seq_gb_s": round(statistics.median(mnt), 2), "median_copy_seq_gb_s": round(statistics.median(direct), 2),
      "seq_ratio": round(statistics.median(mnt) / statistics.median(direct), 3),
      "rand4k_p50_us": mp50, "rand4k_p99_us": mp99, "copy_rand4k_p50_us": dp50, "copy_rand4k_p99_us": dp99,
      "hot_rand4k_p50_us": hp50, "hot_rand4k_p99_us": hp99, "hot_copy_rand4k_p50_us": hdp50, "hot_copy_rand4k_p99_us": hdp99,
      "passthrough_files": rep.get("passthrough_files"), "daemon_reads": rep.get("reads"), "passthrough_refused": rep.get("passthrough_refused")})
PY
