//! `snapctl sample`: generate a Firecracker-style sample snapshot for demos, tests and
//! benchmarks (deterministic from a seed).

use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};

use super::common;

/// Write a sample snapshot: a sparse `vm.mem` and a `vm.state`.
///
/// Memory is laid out in 1 MiB blocks: by default half are never written (holes), a
/// quarter are random (incompressible), a quarter text-like; --zero-fraction and
/// --text-fraction change the mix. The same seed always gives the same bytes;
/// --mutate N changes N blocks pseudo-randomly (to make a "next" snapshot).
#[derive(Debug, clap::Args)]
pub struct SampleArgs {
    /// Directory to create.
    pub dir: PathBuf,
    /// Size of vm.mem.
    #[arg(long, default_value = "256MiB", value_parser = common::parse_size)]
    pub size: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Fraction of 1 MiB blocks left as holes.
    #[arg(long, default_value_t = 0.5)]
    pub zero_fraction: f64,
    /// Fraction of data blocks that are text-like rather than random.
    #[arg(long, default_value_t = 0.5)]
    pub text_fraction: f64,
    /// Rewrite this many data blocks with other content (seeded by --seed + 1).
    #[arg(long, default_value_t = 0)]
    pub mutate: u64,
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64: fast, deterministic, good enough for test data.
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

const WORDS: &[&str] = &["sandbox", "restore", "page", "fault", "chunk", "memory", "kernel", "verify", "snapshot", "guest", "\n"];

fn text_block(rng: &mut Rng, buf: &mut [u8]) {
    let mut i = 0;
    while i < buf.len() {
        let w = WORDS[(rng.next() % WORDS.len() as u64) as usize].as_bytes();
        let n = w.len().min(buf.len() - i);
        buf[i..i + n].copy_from_slice(&w[..n]);
        i += n;
        if i < buf.len() {
            buf[i] = b' ';
            i += 1;
        }
    }
}

pub fn run(a: SampleArgs) -> anyhow::Result<ExitCode> {
    if a.mutate > 0 {
        // A mutation changes a sample written before: nothing is created for it.
        if !a.dir.join("vm.mem").is_file() {
            bail!("{}: no sample to mutate (no vm.mem there; write one first: snapctl sample {})", a.dir.display(), a.dir.display());
        }
    } else if a.dir.exists() && fs::read_dir(&a.dir).with_context(|| format!("reading {}", a.dir.display()))?.next().is_some() {
        bail!("{} exists and is not empty", a.dir.display());
    }
    fs::create_dir_all(&a.dir).with_context(|| format!("creating {}", a.dir.display()))?;
    const BLOCK: u64 = 1 << 20;
    let mem_path = a.dir.join("vm.mem");
    let mut rng = Rng(a.seed);
    let blocks = a.size.div_ceil(BLOCK);
    let mut buf = vec![0u8; BLOCK as usize];
    if a.mutate == 0 {
        let f = File::create(&mem_path).with_context(|| format!("create {}", mem_path.display()))?;
        f.set_len(a.size)?;
        for b in 0..blocks {
            let len = (a.size - b * BLOCK).min(BLOCK) as usize;
            let zero = rng.unit() < a.zero_fraction;
            let text = rng.unit() < a.text_fraction;
            if zero {
                continue;
            }
            if text {
                text_block(&mut rng, &mut buf[..len]);
            } else {
                rng.fill(&mut buf[..len]);
            }
            f.write_all_at(&buf[..len], b * BLOCK)?;
        }
        f.sync_all()?;
        let mut st = File::create(a.dir.join("vm.state"))?;
        let mut state = vec![0u8; 24 * 1024 + 123];
        rng.fill(&mut state);
        st.write_all(&state)?;
        st.sync_all()?;
    } else {
        let f = fs::OpenOptions::new().write(true).open(&mem_path).with_context(|| format!("open {}", mem_path.display()))?;
        let mut m = Rng(a.seed.wrapping_add(0x5eed));
        for _ in 0..a.mutate {
            let b = m.next() % blocks;
            let len = (a.size - b * BLOCK).min(BLOCK) as usize;
            m.fill(&mut buf[..len]);
            f.write_all_at(&buf[..len], b * BLOCK)?;
        }
        f.sync_all()?;
    }
    eprintln!("wrote sample snapshot to {} (vm.mem {}, vm.state)", a.dir.display(), imgfmt::size::human(a.size));
    Ok(common::code(common::EXIT_OK))
}
