//! `unpack`: materialise an image's files, every chunk verified before it is written,
//! zero chunks left as holes, each file appearing under its name only when complete and
//! synced.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use imgfmt::{BlobSource, FormatError, Image, StoredAt};
use serde::Serialize;

/// Largest single write.
pub(crate) const WRITE_PIECE: usize = 256 << 10;

/// Why an unpack or a pull failed.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum UnpackError {
    /// {path}: {source}
    Io { path: PathBuf, source: std::io::Error },
    /// {0}
    Verify(#[from] verify::VerifyError),
    /// {0}
    Format(#[from] FormatError),
    /// {0} already exists (pass --overwrite to replace it)
    Exists(PathBuf),
    /// {0}
    Cache(#[from] crate::cache::CacheError),
}

impl UnpackError {
    /// Whether the image's content failed verification (as opposed to an I/O problem).
    pub fn is_integrity(&self) -> bool {
        matches!(self, UnpackError::Verify(e) if !e.is_read_error())
    }
}

#[derive(Debug, Clone)]
pub struct UnpackOptions {
    pub threads: usize,
    /// Replace files that already exist under the destination.
    pub overwrite: bool,
}

impl Default for UnpackOptions {
    fn default() -> Self {
        UnpackOptions { threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2), overwrite: false }
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct UnpackReport {
    pub files: usize,
    pub logical_bytes: u64,
    /// Bytes written (zero chunks are holes and write nothing).
    pub bytes_written: u64,
    pub zero_chunks: u64,
    pub seconds: f64,
}

/// Removes the temporary file unless the unpack of that file completed.
pub(crate) struct TempGuard(pub(crate) Option<PathBuf>);
impl Drop for TempGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = fs::remove_file(p);
        }
    }
}

/// Unpack `image` (read from `src`) into `dest`.
pub fn unpack(
    src: &dyn BlobSource,
    image: &Image,
    dest: &Path,
    opts: &UnpackOptions,
    progress: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<UnpackReport, UnpackError> {
    let t0 = Instant::now();
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| UnpackError::Io { path: p, source }
    };
    fs::create_dir_all(dest).map_err(io(dest))?;
    if !opts.overwrite {
        for f in &image.files {
            let p = dest.join(&f.name);
            if p.symlink_metadata().is_ok() {
                return Err(UnpackError::Exists(p));
            }
        }
    }
    let shift = image.chunk_shift();
    let mut report = UnpackReport { files: image.files.len(), ..Default::default() };
    for (fi, f) in image.files.iter().enumerate() {
        // Names were checked when the config was decoded: relative, no traversal.
        let final_path = dest.join(&f.name);
        let dir = final_path.parent().expect("joined path has a parent").to_path_buf();
        fs::create_dir_all(&dir).map_err(io(&dir))?;
        let base = final_path.file_name().expect("file name").to_string_lossy().into_owned();
        let tmp = imgfmt::layout::tempname(&dir, &format!(".{base}.snapctl-partial"));
        let mut guard = TempGuard(Some(tmp.clone()));
        let file = OpenOptions::new().write(true).create_new(true).open(&tmp).map_err(io(&tmp))?;
        // A sparse file of the final size: zero chunks are never written.
        file.set_len(f.size).map_err(io(&tmp))?;

        // Workers take turns writing the file (see pull's `write_at`: the kernel serialises
        // buffered writes to one inode anyway, and its waiters spin: one unpack of 2 GiB
        // took 5.4 s with 8.3 s of system time, the next ones 1.2 s).
        let turn = Mutex::new(());
        let next = AtomicUsize::new(0);
        let written = AtomicU64::new(0);
        let zeros = AtomicU64::new(0);
        let failed = AtomicBool::new(false);
        let first_err: Mutex<Option<UnpackError>> = Mutex::new(None);
        std::thread::scope(|s| {
            for _ in 0..opts.threads.max(1) {
                s.spawn(|| loop {
                    if failed.load(Ordering::Relaxed) {
                        break;
                    }
                    let ci = next.fetch_add(1, Ordering::Relaxed);
                    let Some(c) = f.chunks.get(ci) else { break };
                    let res: Result<(), UnpackError> = (|| {
                        if let StoredAt::Zero = c.at {
                            // A hole: nothing to write, but the record must still be the
                            // digest of zeros (checked without building a zero buffer).
                            verify::check_zero_record(image, fi, ci as u64)?;
                            zeros.fetch_add(1, Ordering::Relaxed);
                            return Ok(());
                        }
                        let chunk = verify::read_chunk(src, image, fi, ci as u64)?;
                        // Pieces of at most 256 KiB: on this kind of VM, 1 MiB page-cache
                        // copies were several times slower (BENCHMARKS.md, "unpack").
                        let at = (ci as u64) << shift;
                        let _turn = turn.lock().unwrap_or_else(|p| p.into_inner());
                        for (k, piece) in chunk.as_bytes().chunks(WRITE_PIECE).enumerate() {
                            file.write_all_at(piece, at + (k * WRITE_PIECE) as u64).map_err(io(&tmp))?;
                        }
                        written.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                        Ok(())
                    })();
                    if let Some(p) = progress {
                        p(c.len as u64);
                    }
                    if let Err(e) = res {
                        failed.store(true, Ordering::Relaxed);
                        first_err.lock().expect("poisoned").get_or_insert(e);
                        break;
                    }
                });
            }
        });
        if let Some(e) = first_err.into_inner().expect("poisoned") {
            return Err(e);
        }
        file.set_permissions(fs::Permissions::from_mode(f.mode)).map_err(io(&tmp))?;
        file.sync_all().map_err(io(&tmp))?;
        drop(file);
        fs::rename(&tmp, &final_path).map_err(io(&final_path))?;
        guard.0 = None;
        File::open(&dir).and_then(|d| d.sync_all()).map_err(io(&dir))?;
        report.logical_bytes += f.size;
        report.bytes_written += written.into_inner();
        report.zero_chunks += zeros.into_inner();
    }
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}
