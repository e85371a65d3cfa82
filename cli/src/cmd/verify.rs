//! `snapctl verify`: prove an image (and optionally a directory) is the snapshot.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use verify::{AuditOptions, AuditReport};

use super::common::{self, open_image, IntegrityError};

/// Check an image: manifest, config, index, every chunk digest and every Merkle root,
/// across the whole parent chain and the base when present.
///
/// With --against DIR, also prove that DIR holds exactly the snapshot's files.
/// Each failure is printed on stderr naming the file, chunk and byte offset.
///
/// Exit codes: 0 verified, 1 integrity failure, 2 could not check.
#[derive(Debug, clap::Args)]
pub struct VerifyArgs {
    /// Image: oci:PATH[:TAG|@DIGEST] or HOST[:PORT]/REPO[:TAG|@DIGEST] (plain HTTP for loopback
    /// hosts or with SNAPCTL_PLAIN_HTTP=1; credentials from ~/.docker/config.json).
    pub image: String,
    /// Also prove this directory is exactly the snapshot (files, sizes, modes, bytes).
    #[arg(long, value_name = "DIR")]
    pub against: Option<PathBuf>,
    /// Also re-hash each pack blob with sha256 (covers bytes no chunk uses).
    #[arg(long)]
    pub blob_digests: bool,
    #[command(flatten)]
    pub registry: super::common::RegistryFlags,
    /// Print the report (failures included) as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub policy: super::policy::PolicyFlags,
}

pub fn run(a: VerifyArgs) -> anyhow::Result<ExitCode> {
    let t0 = Instant::now();
    let r: imgfmt::reference::Reference = a.image.parse()?;
    let mut o = common::open_parsed(&r, &a.image)?;
    let opts = AuditOptions { blob_digests: a.blob_digests, ..Default::default() };
    let image = match a.policy.gate(&r, &mut o, |o| Ok(open_image(o)))? {
        Ok(i) => i,
        Err(e) if e.downcast_ref::<IntegrityError>().is_some() => {
            // The metadata itself is wrong: report it like any other failure.
            let msg = e.to_string();
            if a.json {
                let j = serde_json::json!({"ok": false, "failures": [{"kind": "metadata", "message": msg}]});
                common::print_json(&j)?;
            }
            eprintln!("FAILED {}", common::printable(&msg));
            return Ok(common::code(common::EXIT_FAILED));
        }
        Err(e) => return Err(e),
    };
    let mut report: AuditReport = verify::audit(o.source.as_ref(), &image, &opts)?;
    let against = a.against.as_ref().map(|d| verify::audit_against(&image, d, &opts));
    if let Some(r) = &against {
        report.merge_failures(r);
    }
    let secs = t0.elapsed().as_secs_f64();
    for f in &report.failures {
        eprintln!("FAILED {}", common::printable(&f.to_string()));
    }
    if report.failures_unlisted > 0 {
        eprintln!("FAILED … and {} more failure(s) not listed", report.failures_unlisted);
    }
    if a.json {
        let j = serde_json::json!({
            "ok": report.ok(),
            "image": image.manifest_digest.to_string(),
            "root": image.config().root,
            "report": report,
            "against": against.as_ref().map(|r| serde_json::json!({"bytes_checked": r.stored_bytes_checked, "chunks_checked": r.stored_chunks_checked})),
            "seconds": secs,
        });
        common::print_json(&j)?;
    }
    if report.ok() {
        eprintln!(
            "verified {} ({}): {} stored chunks ({}), {} zero chunks, {}{} image(s){} in {:.2}s",
            a.image,
            common::printable(&image.config().root),
            report.stored_chunks_checked,
            imgfmt::size::human(report.stored_bytes_checked),
            report.zero_chunks,
            if report.outboard_entries_checked > 0 { format!("{} outboard entries, ", report.outboard_entries_checked) } else { String::new() },
            report.images.len(),
            if against.is_some() { ", directory matches" } else { "" },
            secs
        );
        Ok(common::code(common::EXIT_OK))
    } else {
        eprintln!("{}: {} integrity failure(s)", a.image, report.failure_count());
        Ok(common::code(common::EXIT_FAILED))
    }
}
