//! `snapctl lazy --criu-workdir`: one `criu restore --lazy-pages`, every task it restores.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context as _;
use lazy::criu::{CriuDaemon, CriuReport};
use lazy::wake::Prepared;

use super::stop::on_terminate;
use crate::cmd::common;

/// What the flags say of a CRIU restore.
pub struct CriuFlags<'a> {
    /// The image, as the command line names it.
    pub image: &'a str,
    pub workdir: PathBuf,
    /// `--criu-prepare`.
    pub prepare: bool,
    pub metrics: Option<&'a str>,
    pub json: bool,
}

/// Serve the restore run in the work directory (first writing the dump there with
/// `--criu-prepare`, removed again when the daemon ends).
pub fn run(f: CriuFlags<'_>, prepared: Prepared, store: Option<Arc<dyn lazy::ChunkStore>>) -> anyhow::Result<ExitCode> {
    let image = &prepared.image;
    if image.config().kind != imgfmt::Kind::Criu {
        tracing::warn!("{} is a {} image, not criu", f.image, image.config().kind);
    }
    let woken = prepared.serve_criu(store, f.workdir.clone());
    let daemon = woken.daemon.clone();
    if let Some(addr) = f.metrics {
        let bound = daemon.serve_metrics(addr)?;
        tracing::info!("metrics on http://{bound}/metrics");
    }
    let written = if f.prepare { Some(write_dump(&daemon, &f.workdir)?) } else { None };
    let d2 = daemon.clone();
    on_terminate(move || {
        tracing::info!(
            "criu: stopping once the restore being served (if any) is done; signal again to exit now (its tasks would then read untouched memory as zeros)"
        );
        d2.drain();
    })?;
    let result = serve(f.json, &daemon);
    if let Some(p) = &written {
        daemon.remove_prepared(p);
    }
    result
}

/// `--criu-prepare`: write the dump, without its lazy pages, into `workdir`.
fn write_dump(daemon: &CriuDaemon, workdir: &std::path::Path) -> anyhow::Result<lazy::criu::Prepared> {
    let t0 = std::time::Instant::now();
    std::fs::create_dir_all(workdir).with_context(|| format!("creating {}", workdir.display()))?;
    let p = daemon.prepare_workdir().with_context(|| format!("preparing {} for criu restore --lazy-pages", workdir.display()))?;
    tracing::info!(
        "criu: wrote {} files ({}) into {} in {:.2}s; {} of lazy pages left to serve",
        p.paths.len(),
        imgfmt::size::human(p.bytes_written),
        workdir.display(),
        t0.elapsed().as_secs_f64(),
        imgfmt::size::human(p.lazy_bytes_left)
    );
    Ok(p)
}

/// Serve the restore; the exit code from the tasks' reports.
fn serve(json: bool, daemon: &Arc<CriuDaemon>) -> anyhow::Result<ExitCode> {
    let (failed, errored) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let (f2, e2) = (failed.clone(), errored.clone());
    daemon.run(Arc::new(move |r: &CriuReport| {
        if r.conn.integrity_failed() {
            f2.store(true, Ordering::Relaxed);
        }
        if r.error.is_some() {
            e2.store(true, Ordering::Relaxed);
        }
        tracing::info!("criu: {}", r.summary());
        if json {
            // A page server keeps serving when its report reader has gone: a guest
            // still faulting must not lose its handler over a closed pipe.
            let _ = common::print_json_line(r);
        }
    }))?;
    Ok(common::code(if errored.load(Ordering::Relaxed) {
        common::EXIT_ERROR
    } else if failed.load(Ordering::Relaxed) {
        common::EXIT_FAILED
    } else {
        common::EXIT_OK
    }))
}
