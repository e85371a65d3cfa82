"""bench/mount-gvisor.sh's steps that time things or read the kernel's trace.

    python3 gvisor.py COMMAND JSON-ARGS      prints one JSON object on stdout

Commands (JSON-ARGS: one object, fields below; `runsc`, `root` (its state root), `heap`
(the static workload), `mib` (its heap) in each that runs a sandbox; `mount_flags`, more
`snapctl mount` flags, in each that mounts):
  checkpoint  run the workload in a new sandbox until it has ticked `ticks` times, then
            checkpoint it into `image`: {bundle, ticks, image} -> {at, seed, sizes}
  chunks    the image's chunk table from the registry (no proxy): {registry, repo, tag}
            -> {chunk_size, files: {name: [stored bytes of each chunk, 0 for zero]},
            metadata_blobs: {config, index, outboard: bytes}}
  record    a restore from `image` (a local directory, its files evicted from the page cache
            first), every read of its files taken from the filemap tracepoints:
            {image, bundle, at, seed, trace_instance (a tracefs instance name)}
            -> {restore_s, reads: [[file, t_s, off, end, how]...]}
  first     the stand-in's ranges from a record: {recorded, chunks, first (bytes)}
  local     `snapctl pull` to work/pulled, then a restore from it: {snapctl, ref, work,
            bundle, at, seed} -> {pull_s, local_restore_s}
  mount     `snapctl mount` at mnt, then a restore from it: {snapctl, ref, work, mnt, bundle,
            at, seed} -> {mount_restore_s (from the mount's start), mount: its report}
  standin   `snapctl mount` at mnt, then the stand-in reader: {snapctl, ref, work, mnt,
            image, ranges_file (first's output)} -> {standin_s (from the mount's start)}
A restore is timed until the restored counter writes a tick past `at` with seed `seed`;
every mount gets a fresh chunk cache under work.
"""
import json
import os
import re
import subprocess
import sys
import time

TRACEFS = "/sys/kernel/tracing"
FILES = ("checkpoint.img", "pages_meta.img", "pages.img")


def runsc(a, *args, **kw):
    return subprocess.run([a["runsc"], "--platform=ptrace", "--network=none", "--root", a["root"], *args], stdin=subprocess.DEVNULL, **kw)


def bundle(a, d):
    """An OCI bundle in d running the workload, with d/out bind-mounted at /out."""
    os.makedirs(f"{d}/rootfs", exist_ok=True)
    os.makedirs(f"{d}/out", exist_ok=True)
    subprocess.run(["cp", a["heap"], f"{d}/rootfs/heap_counter"], check=True)
    subprocess.run([a["runsc"], "spec", "--", "/heap_counter", "/out/progress", str(a["mib"])], cwd=d, check=True)
    with open(f"{d}/config.json") as f:
        c = json.load(f)
    c["process"]["terminal"] = False
    c["root"]["readonly"] = True
    c["mounts"].append({"destination": "/out", "type": "bind", "source": f"{d}/out", "options": ["rbind", "rw"]})
    with open(f"{d}/config.json", "w") as f:
        json.dump(c, f)
    return f"{d}/out/progress"


def ticks(progress):
    try:
        text = open(progress).read()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        m = re.fullmatch(r"count=(\d+) seed=(\w+) check=(\w+) pid=\d+", line)
        if m:
            out.append((int(m[1]), m[2], m[3]))
    return out


def wait_ticks(progress, pred, within, what):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        t = ticks(progress)
        if t and pred(t):
            return time.monotonic(), t
        time.sleep(0.002)
    sys.exit(f"gvisor.py: {what}: no such tick within {within} s; ticks: {ticks(progress)[-3:]}")


def restore(a, image, d, sid, t0=None):
    """runsc restore of the checkpoint in `image` as `sid` (bundle d, made by `bundle`):
    seconds from t0 (default: now) until the counter continued, or {"error"} with runsc's
    log."""
    progress, log = f"{d}/out/progress", f"{d}/runsc.log"
    t0 = time.monotonic() if t0 is None else t0
    with open(log, "w") as f:
        r = runsc(a, "restore", "-detach", "--image-path", image, "--bundle", d, sid, stdout=f, stderr=f)
    cmd_s = time.monotonic() - t0
    if r.returncode != 0:
        return {"error": f"runsc restore exited {r.returncode}: {open(log).read()[-4000:]}"}
    try:
        seen, t = wait_ticks(progress, lambda t: t[-1][0] > a["at"], 600, "restore")
    except SystemExit as e:
        return {"error": f"{e}; runsc's log: {open(log).read()[-4000:]}"}
    bad = [c for c in t if c[1] != a["seed"] or c[2] != "ok"]
    if bad:
        return {"error": f"restored counter is not the checkpointed one or its heap differs: {bad[:3]}"}
    return {"restore_s": seen - t0, "restore_cmd_s": cmd_s, "first_count": t[0][0]}


def delete(a, sid):
    runsc(a, "kill", sid, "KILL", capture_output=True)
    runsc(a, "delete", "-force", sid, capture_output=True)


def cmd_checkpoint(a):
    progress = bundle(a, a["bundle"])
    sid = f"mg-run-{os.getpid()}"
    try:
        # Output to a file, not a pipe: the detached sandbox inherits it and keeps it open.
        log = f"{a['bundle']}/runsc.log"
        with open(log, "w") as f:
            r = runsc(a, "run", "-detach", "--bundle", a["bundle"], sid, stdout=f, stderr=f)
        if r.returncode != 0:
            sys.exit(f"gvisor.py: runsc run: {open(log).read()}")
        t0 = time.monotonic()
        wait_ticks(progress, lambda t: t[-1][0] >= a["ticks"], 900, "first run")
        ticked = time.monotonic() - t0
        os.makedirs(a["image"], exist_ok=True)
        r = runsc(a, "checkpoint", "--compression=none", "--exclude-committed-zero-pages", "--image-path", a["image"], sid, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"gvisor.py: runsc checkpoint: {r.stderr}")
    finally:
        delete(a, sid)
    last = ticks(progress)[-1]
    sizes = {n: os.path.getsize(f"{a['image']}/{n}") for n in sorted(os.listdir(a["image"]))}
    return {"at": last[0], "seed": last[1], "sizes": sizes, "run_to_ticks_s": ticked}


def cmd_chunks(a):
    import urllib.request

    base = f"http://{a['registry']}/v2/{a['repo']}"

    def get(path, accept=None):
        req = urllib.request.Request(base + path, headers={"Accept": accept} if accept else {})
        return urllib.request.urlopen(req).read()

    m = json.loads(get(f"/manifests/{a['tag']}", "application/vnd.oci.image.manifest.v1+json"))
    config = json.loads(get(f"/blobs/{m['config']['digest']}"))
    ix = get(f"/blobs/{config['index']['digest']}")
    nf = int.from_bytes(ix[16:20], "little")
    npk = int.from_bytes(ix[20:24], "little")
    rec0 = 64 + 32 * nf + 40 * npk
    files, seen = {}, set()
    for f, fc in enumerate(config["files"]):
        e = 64 + 32 * f
        first, count = int.from_bytes(ix[e + 8 : e + 16], "little"), int.from_bytes(ix[e + 16 : e + 24], "little")
        sizes = []
        for i in range(first, first + count):
            r = rec0 + 64 * i
            kind = ix[r + 12]
            key = (ix[r + 8 : r + 12], ix[r + 16 : r + 24])
            # A chunk stored once for several records (deduplicated) is fetched once.
            sizes.append(int.from_bytes(ix[r + 24 : r + 28], "little") if kind == 1 and key not in seen else 0)
            seen.add(key)
        files[fc["name"]] = sizes
    kinds = {"application/vnd.snapctl.snapshot.index.v1": "index", "application/vnd.snapctl.snapshot.outboard.v1": "outboard"}
    meta = {"config": m["config"]["size"]}
    for layer in m["layers"]:
        if layer["mediaType"] in kinds:
            meta[kinds[layer["mediaType"]]] = meta.get(kinds[layer["mediaType"]], 0) + layer["size"]
    return {"chunk_size": config["chunkSize"], "files": files, "metadata_blobs": meta}


def tracefs_write(path, value):
    with open(path, "w") as f:
        f.write(value)


def cmd_record(a):
    image = a["image"]
    st = {n: os.stat(f"{image}/{n}") for n in FILES}
    dev = next(iter(st.values())).st_dev
    kdev = (os.major(dev) << 20) | os.minor(dev)
    by_ino = {s.st_ino: n for n, s in st.items()}
    os.sync()
    for n in FILES:
        fd = os.open(f"{image}/{n}", os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    if not os.path.isdir(f"{TRACEFS}/instances"):
        sys.exit(f"gvisor.py: no tracefs at {TRACEFS}")
    inst = f"{TRACEFS}/instances/{a['trace_instance']}"
    os.mkdir(inst)
    try:
        tracefs_write(f"{inst}/trace_clock", "mono")
        tracefs_write(f"{inst}/buffer_size_kb", "65536")
        filt = f"s_dev == {kdev} && (" + " || ".join(f"i_ino == {i}" for i in by_ino) + ")"
        for ev in ("mm_filemap_get_pages", "mm_filemap_fault"):
            tracefs_write(f"{inst}/events/filemap/{ev}/filter", filt)
            tracefs_write(f"{inst}/events/filemap/{ev}/enable", "1")
        tracefs_write(f"{inst}/tracing_on", "1")
        sid = f"mg-record-{os.getpid()}"
        bundle(a, a["bundle"])
        t0 = time.monotonic()
        try:
            r = restore(a, image, a["bundle"], sid, t0)
        finally:
            tracefs_write(f"{inst}/tracing_on", "0")
            delete(a, sid)
        with open(f"{inst}/trace") as f:
            text = f.read()
        for ev in ("mm_filemap_get_pages", "mm_filemap_fault"):
            tracefs_write(f"{inst}/events/filemap/{ev}/enable", "0")
    finally:
        os.rmdir(inst)
    if "error" in r:
        sys.exit(f"gvisor.py: the recorded restore failed: {r['error']}")
    reads = []
    pat = re.compile(r"\s(\d+\.\d+): mm_filemap_(get_pages|fault): dev=\d+:\d+ ino=([0-9a-f]+) ofs=(\d+)(?:-(\d+))?")
    for line in text.splitlines():
        m = pat.search(line)
        if not m:
            continue
        name = by_ino.get(int(m[3], 16))
        off = int(m[4])
        end = int(m[5]) + 1 if m[5] else off + 4096
        reads.append([name, float(m[1]) - t0, off, end, m[2]])
    lost = re.search(r"entries-in-buffer/entries-written: (\d+)/(\d+)", text)
    return {**r, "reads": reads, "events_kept_written": [int(lost[1]), int(lost[2])] if lost else None}


def pieces(reads, name):
    """One file's reads in the order the reader took their pages: [t_s, off, end, read_end],
    read_end (where the read asked to stop) only on the first piece of a read, else None. The get_pages tracepoint fires each time a read takes
    its next batch of pages from the page cache, with the read's next page and its last
    (`end` stays the read's end), so a read's pieces run from one event's offset to its next
    event's; reads running at once (runsc reads pages.img from several threads) interleave,
    each piece at its own time. A fault (an mmap) is one page."""
    out, last_of = [], {}
    for f, t, off, end, how in reads:
        if f != name:
            continue
        if how != "get_pages":
            out.append([t, off, off + 4096, off + 4096])
            continue
        k = last_of.get(end)
        cont = k is not None and out[k][1] < off < end
        if cont:
            out[k][2] = off
        out.append([t, off, end, None if cont else end])
        last_of[end] = len(out) - 1
    return out


def union_bytes(ps):
    pages = set()
    for _, off, end, _ in ps:
        pages.update(range(off // 4096, (end + 4095) // 4096))
    return len(pages) * 4096


def cmd_first(a):
    """The stand-in's ranges: pages.img's first `first` bytes in the order the recorded
    restore took them (each page once), neighbours merged; the stored bytes the stand-in
    needs; and a summary of what the recorded restore read."""
    rec = json.load(open(a["recorded"]))
    chunks = json.load(open(a["chunks"]))
    seen, ranges, total = set(), [], 0
    for _, off, end, _ in pieces(rec["reads"], "pages.img"):
        for p in range(off // 4096, (end + 4095) // 4096):
            if total >= a["first"]:
                break
            if p in seen:
                continue
            seen.add(p)
            total += 4096
            if ranges and ranges[-1][0] + ranges[-1][1] == p * 4096:
                ranges[-1][1] += 4096
            else:
                ranges.append([p * 4096, 4096])
    cs = chunks["chunk_size"]
    under = {c for off, ln in ranges for c in range(off // cs, (off + ln - 1) // cs + 1)}
    stored = sum(chunks["files"]["pages.img"][c] for c in under)
    meta = sum(sum(chunks["files"][n]) for n in ("checkpoint.img", "pages_meta.img"))
    summary = {}
    for name in FILES:
        ps = pieces(rec["reads"], name)
        if not ps:
            continue
        reads = [(o, r) for _, o, _, r in ps if r is not None]
        summary[name] = {
            "reads": len(reads),
            "first_s": ps[0][0],
            "last_s": ps[-1][0],
            "bytes": union_bytes(ps),
            "largest": max(r - o for o, r in reads),
            "faults": sum(1 for f, *_, how in rec["reads"] if f == name and how == "fault"),
            "first_reads": [[o, r - o] for o, r in reads[:8]],
            "first_pieces": [[round(t, 4), o, e - o] for t, o, e, _ in ps[:12]],
        }
    return {"ranges": ranges, "ranges_bytes": total, "ranges_stored_bytes": stored, "meta_stored_bytes": meta, "chunks_under_ranges": len(under), "summary": summary, "restore_s": rec["restore_s"], "events_kept_written": rec["events_kept_written"]}


def mount_start(a, cache, log):
    t0 = time.monotonic()
    out = open(f"{log}.json", "w")
    cmd = [a["snapctl"], "mount", a["ref"], a["mnt"], "--cache", cache, "--json", *a.get("mount_flags", [])]
    p = subprocess.Popen(cmd, stdout=out, stderr=open(log, "w"))
    while "shown in" not in open(log).read():
        if p.poll() is not None or time.monotonic() - t0 > 120:
            sys.exit(f"gvisor.py: snapctl mount failed: {open(log).read()}")
        time.sleep(0.002)
    return t0, time.monotonic() - t0, p


def mount_end(a, p, log):
    r = subprocess.run([a["snapctl"], "umount", "--wait", a["mnt"]], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        sys.exit(f"gvisor.py: snapctl umount: {r.stderr}")
    p.wait(timeout=300)
    report = json.loads(open(f"{log}.json").read().strip() or "null")
    return {k: report[k] for k in ("bytes_read", "fetched_chunks", "bytes_fetched", "cache_hits", "read_failures", "filled_chunks")} if report else {}


def cmd_local(a):
    w = a["work"]
    t0 = time.monotonic()
    r = subprocess.run([a["snapctl"], "pull", a["ref"], f"{w}/pulled", "--cache", f"{w}/cache-p"], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"gvisor.py: snapctl pull: {r.stderr}")
    pull_s = time.monotonic() - t0
    sid = f"mg-local-{os.getpid()}"
    bundle(a, a["bundle"])
    try:
        res = restore(a, f"{w}/pulled", a["bundle"], sid)
    finally:
        delete(a, sid)
    if "error" in res:
        sys.exit(f"gvisor.py: restore from the pulled directory: {res['error']}")
    return {"pull_s": pull_s, "local_restore_s": res["restore_s"], "local_restore_cmd_s": res["restore_cmd_s"]}


def cmd_mount(a):
    w, log = a["work"], f"{a['work']}/mount-restore.log"
    bundle(a, a["bundle"])
    t0, shown, p = mount_start(a, f"{w}/cache-m", log)
    sid = f"mg-mount-{os.getpid()}"
    try:
        res = restore(a, a["mnt"], a["bundle"], sid, t0)
    finally:
        delete(a, sid)
    rep = mount_end(a, p, log)
    if "error" in res:
        return {"mount_shown_s": shown, "mount_error": res["error"], "mount_log": open(log).read()[-4000:], "mount": rep}
    return {"mount_shown_s": shown, "mount_restore_s": res["restore_s"], "mount_restore_cmd_s": res["restore_cmd_s"], "mount": rep}


def read_all(path):
    n = 0
    with open(path, "rb", buffering=0) as f:
        while b := f.read(1 << 20):
            n += len(b)
    return n


def cmd_standin(a):
    w, log = a["work"], f"{a['work']}/mount-standin.log"
    ranges = json.load(open(a["ranges_file"]))["ranges"]
    t0, shown, p = mount_start(a, f"{w}/cache-s", log)
    meta = sum(read_all(f"{a['mnt']}/{n}") for n in ("checkpoint.img", "pages_meta.img"))
    t_meta = time.monotonic() - t0
    fd = os.open(f"{a['mnt']}/pages.img", os.O_RDONLY)
    got = []
    for off, ln in ranges:
        got.append(os.pread(fd, ln, off))
    done = time.monotonic() - t0
    os.close(fd)
    with open(f"{a['image']}/pages.img", "rb") as f:
        right = all((f.seek(off), f.read(ln))[1] == g for (off, ln), g in zip(ranges, got))
    rep = mount_end(a, p, log)
    return {"standin_shown_s": shown, "standin_meta_s": t_meta, "standin_s": done, "standin_bytes": meta + sum(map(len, got)), "standin_right": right, "standin_mount": rep}


if __name__ == "__main__":
    args = json.loads(sys.argv[2])
    print(json.dumps(globals()[f"cmd_{sys.argv[1]}"](args)))
