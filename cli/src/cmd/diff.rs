//! `snapctl diff`: which chunks of which files differ between two images.

use std::process::ExitCode;

use serde::Serialize;

use super::common::{self, open_image, open_ref, outln};

/// Compare two images chunk by chunk (by digest; nothing is downloaded).
///
/// Exit 0 when the contents are identical, 1 when they differ (like diff(1)).
#[derive(Debug, clap::Args)]
pub struct DiffArgs {
    pub a: String,
    pub b: String,
    #[command(flatten)]
    pub registry: super::common::RegistryFlags,
    /// Print JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct FileDiff {
    name: String,
    /// "changed", "added" (only in B) or "removed" (only in A).
    status: &'static str,
    size_a: Option<u64>,
    size_b: Option<u64>,
    /// Differing chunk numbers, as inclusive ranges.
    chunks: Vec<(u64, u64)>,
    changed_chunks: u64,
    changed_bytes: u64,
}

fn ranges(v: &[u64]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &c in v {
        match out.last_mut() {
            Some((_, e)) if *e + 1 == c => *e = c,
            _ => out.push((c, c)),
        }
    }
    out
}

pub fn run(a: DiffArgs) -> anyhow::Result<ExitCode> {
    let (oa, ob) = (open_ref(&a.a)?, open_ref(&a.b)?);
    let (ia, ib) = (open_image(&oa)?, open_image(&ob)?);
    if ia.config().hash != ib.config().hash || ia.config().chunk_size != ib.config().chunk_size {
        anyhow::bail!("images use different hashes or chunk sizes; chunk-level diff needs the same (compare roots instead)");
    }
    let mut diffs = Vec::new();
    for fa in &ia.files {
        match ib.file(&fa.name) {
            None => diffs.push(FileDiff {
                name: fa.name.clone(),
                status: "removed",
                size_a: Some(fa.size),
                size_b: None,
                chunks: vec![],
                changed_chunks: fa.chunks.len() as u64,
                changed_bytes: fa.size,
            }),
            Some((_, fb)) => {
                let n = fa.chunks.len().max(fb.chunks.len());
                let mut changed = Vec::new();
                let mut bytes = 0u64;
                for c in 0..n {
                    let (x, y) = (fa.chunks.get(c), fb.chunks.get(c));
                    let same = matches!((x, y), (Some(x), Some(y)) if x.digest == y.digest && x.len == y.len);
                    if !same {
                        changed.push(c as u64);
                        bytes += x.or(y).map(|c| c.len as u64).unwrap_or(0);
                    }
                }
                if !changed.is_empty() || fa.size != fb.size {
                    diffs.push(FileDiff {
                        name: fa.name.clone(),
                        status: "changed",
                        size_a: Some(fa.size),
                        size_b: Some(fb.size),
                        changed_chunks: changed.len() as u64,
                        chunks: ranges(&changed),
                        changed_bytes: bytes,
                    });
                }
            }
        }
    }
    for fb in &ib.files {
        if ia.file(&fb.name).is_none() {
            diffs.push(FileDiff {
                name: fb.name.clone(),
                status: "added",
                size_a: None,
                size_b: Some(fb.size),
                chunks: vec![],
                changed_chunks: fb.chunks.len() as u64,
                changed_bytes: fb.size,
            });
        }
    }
    if a.json {
        let j = serde_json::json!({"identical": diffs.is_empty(), "root_a": ia.config().root, "root_b": ib.config().root, "files": diffs});
        common::print_json(&j)?;
    } else {
        for d in &diffs {
            let list: Vec<String> = d.chunks.iter().map(|(s, e)| if s == e { s.to_string() } else { format!("{s}-{e}") }).collect();
            match d.status {
                "changed" => outln!(
                    "changed {}: {} chunk(s), {} [{}]",
                    common::printable(&d.name),
                    d.changed_chunks,
                    imgfmt::size::human(d.changed_bytes),
                    list.join(",")
                )?,
                s => outln!("{s} {}: {}", common::printable(&d.name), imgfmt::size::human(d.changed_bytes))?,
            }
        }
        if diffs.is_empty() {
            eprintln!("identical content ({})", common::printable(&ia.config().root));
        }
    }
    Ok(common::code(if diffs.is_empty() { common::EXIT_OK } else { common::EXIT_FAILED }))
}
