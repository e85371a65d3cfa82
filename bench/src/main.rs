//! `snapctl-bench`: the small helpers `bench/format.sh` needs that are awkward in bash.
//!
//! ```text
//! snapctl-bench summary TIMINGS.tsv     markdown tables: median, min–max, ratio vs peer
//! snapctl-bench nonzero FILE...         bytes in 4 KiB pages that are not all zero
//! snapctl-bench pwrite FILE CHUNK PIECE THREADS
//!                                       write 1 GiB as unpack does, time it (see below)
//! ```
//!
//! `TIMINGS.tsv` has one line per timed run, tab-separated, no header:
//! `table  cache  row  peer  run  wall_s  user_s  sys_s  max_rss_kib`.
//! Rows of one (table, cache) are printed in the order they first appear; `peer` names
//! the row of the same table the ratio is taken against (`-` for none).
//!
//! Exit codes: 0 ok, 2 bad input.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::process::ExitCode;

use anyhow::{bail, Context};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("snapctl-bench: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("summary") if args.len() == 2 => summary(&args[1]),
        Some("nonzero") if args.len() >= 2 => {
            let mut total = 0u64;
            for path in &args[1..] {
                total += nonzero_bytes(path).with_context(|| format!("reading {path}"))?;
            }
            println!("{total}");
            Ok(())
        }
        Some("pwrite") if args.len() == 5 => {
            let n = |i: usize| args[i].parse::<usize>().with_context(|| format!("{:?}: not a number", args[i]));
            let secs = pwrite(&args[1], n(2)?, n(3)?, n(4)?)?;
            println!("{secs:.3}");
            Ok(())
        }
        _ => bail!("usage: snapctl-bench summary TIMINGS.tsv | nonzero FILE... | pwrite FILE CHUNK PIECE THREADS"),
    }
}

/// Bytes of `path` that lie in 4 KiB pages holding at least one non-zero byte: what a
/// zero map at page granularity would have to store. Holes read as zeros, so this is
/// independent of how the file is laid out on disk.
fn nonzero_bytes(path: &str) -> anyhow::Result<u64> {
    const PAGE: usize = 4096;
    let mut f = File::open(path)?;
    let mut buf = vec![0u8; 8 << 20];
    let mut total = 0u64;
    loop {
        // Fill the buffer completely (short reads happen), so pages never straddle reads.
        let mut n = 0;
        while n < buf.len() {
            let k = f.read(&mut buf[n..])?;
            if k == 0 {
                break;
            }
            n += k;
        }
        if n == 0 {
            return Ok(total);
        }
        total += buf[..n].chunks(PAGE).filter(|p| p.iter().any(|&b| b != 0)).map(|p| p.len() as u64).sum::<u64>();
        if n < buf.len() {
            return Ok(total);
        }
    }
}

/// Write 1 GiB of non-zero bytes into a fresh sparse `path` the way `snapctl unpack`
/// does: `threads` threads take `chunk`-sized chunks in turn and `pwrite` each one, as
/// `piece`-sized writes, at its offset; then one fsync. Returns wall seconds.
///
/// This isolates the kernel's buffered-write cost from hashing and reading. On the
/// benchmark VM, 1 MiB writes were several times slower than 256 KiB ones.
// `is_multiple_of` is newer (1.87) than the workspace's rust-version (1.85).
#[allow(clippy::manual_is_multiple_of)]
fn pwrite(path: &str, chunk: usize, piece: usize, threads: usize) -> anyhow::Result<f64> {
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    const TOTAL: usize = 1 << 30;
    if chunk == 0 || piece == 0 || threads == 0 || chunk % piece != 0 {
        bail!("CHUNK, PIECE and THREADS must be positive, with PIECE dividing CHUNK");
    }
    let f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).open(path)?;
    f.set_len(TOTAL as u64)?;
    let next = AtomicUsize::new(0);
    let t0 = std::time::Instant::now();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (f, next) = (&f, &next);
                s.spawn(move || -> std::io::Result<()> {
                    let mut buf = vec![(t as u8) | 1; chunk];
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i * chunk >= TOTAL {
                            return Ok(());
                        }
                        buf[0] = (i as u8) | 1;
                        for (k, p) in buf.chunks(piece).enumerate() {
                            f.write_all_at(p, (i * chunk + k * piece) as u64)?;
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().expect("writer thread panicked")?;
        }
        Ok(())
    })?;
    f.sync_all()?;
    Ok(t0.elapsed().as_secs_f64())
}

/// One timed run.
struct Sample {
    wall: f64,
    cpu: f64,
    rss_kib: u64,
}

#[derive(Default)]
struct Row {
    peer: String,
    samples: Vec<Sample>,
}

/// A summary table's key: (table, cache state).
type TableKey = (String, String);

fn summary(path: &str) -> anyhow::Result<()> {
    let f = File::open(path).with_context(|| format!("opening {path}"))?;
    // (table, cache) in first-seen order, then rows in first-seen order.
    let mut tables: Vec<(TableKey, Vec<(String, Row)>)> = Vec::new();
    for (no, line) in BufReader::new(f).lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let col: Vec<&str> = line.split('\t').collect();
        if col.len() != 9 {
            bail!("{path}:{}: expected 9 tab-separated fields, got {}", no + 1, col.len());
        }
        let num = |i: usize| col[i].parse::<f64>().with_context(|| format!("{path}:{}: field {} = {:?}", no + 1, i + 1, col[i]));
        let s = Sample { wall: num(5)?, cpu: num(6)? + num(7)?, rss_kib: num(8)? as u64 };
        let key = (col[0].to_string(), col[1].to_string());
        let t = match tables.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                tables.push((key, Vec::new()));
                tables.len() - 1
            }
        };
        let rows = &mut tables[t].1;
        let r = match rows.iter().position(|(name, _)| name == col[2]) {
            Some(i) => i,
            None => {
                rows.push((col[2].to_string(), Row { peer: col[3].to_string(), ..Default::default() }));
                rows.len() - 1
            }
        };
        rows[r].1.samples.push(s);
    }
    for ((table, cache), rows) in &tables {
        let medians: BTreeMap<&str, f64> = rows.iter().map(|(n, r)| (n.as_str(), median(r.samples.iter().map(|s| s.wall).collect()))).collect();
        println!("#### {table} ({cache} cache)\n");
        println!("| command | runs | median s | min–max s | ratio vs peer | CPU (user+sys) s | max RSS MiB |");
        println!("|---|---:|---:|---:|---|---:|---:|");
        for (name, r) in rows {
            let walls: Vec<f64> = r.samples.iter().map(|s| s.wall).collect();
            let med = medians[name.as_str()];
            let lo = walls.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = walls.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let ratio = match medians.get(r.peer.as_str()) {
                Some(p) if r.peer != *name && *p > 0.0 => format!("{:.2}× {}", med / p, r.peer),
                _ => "—".to_string(),
            };
            let cpu = median(r.samples.iter().map(|s| s.cpu).collect());
            let rss = r.samples.iter().map(|s| s.rss_kib).max().unwrap_or(0) as f64 / 1024.0;
            println!("| {name} | {} | {med:.3} | {lo:.3}–{hi:.3} | {ratio} | {cpu:.2} | {rss:.0} |", walls.len());
        }
        println!();
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}
