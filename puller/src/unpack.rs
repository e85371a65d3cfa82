//! `unpack`: materialise an image's files, every chunk verified before it is written,
//! zero chunks left as holes, each file appearing under its name only when complete and
//! synced.
//!
//! Every name is resolved beneath the destination through [`imgfmt::file::Dir`]: a
//! symlink planted there (a subdirectory, a temp or final name) is refused or replaced,
//! never written through, and files get `mode & 0o775` (spec/format.md §5).

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Instant;

use imgfmt::file::{split_name, Dir};
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
        self.kind().is_integrity()
    }

    /// What a caller can do about this error (a source's error keeps its kind).
    pub fn kind(&self) -> imgfmt::ErrorKind {
        match self {
            UnpackError::Verify(e) => e.kind(),
            UnpackError::Format(e) => e.kind(),
            UnpackError::Io { .. } | UnpackError::Cache(_) => imgfmt::ErrorKind::Io,
            UnpackError::Exists(_) => imgfmt::ErrorKind::Refused,
        }
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

/// Removes the temporary file (a name in a directory) unless the unpack of that file
/// completed.
pub(crate) struct TempGuard(pub(crate) Option<(Arc<Dir>, OsString)>);
impl Drop for TempGuard {
    fn drop(&mut self) {
        if let Some((dir, name)) = self.0.take() {
            let _ = dir.remove_file(&name);
        }
    }
}

/// The directories of an image's files beneath a destination, each opened once (a
/// symlink anywhere beneath the destination is refused, never followed).
pub struct DestDirs<'a> {
    root: Dir,
    dest: &'a Path,
    open: HashMap<PathBuf, Arc<Dir>>,
}

impl<'a> DestDirs<'a> {
    /// Create `dest` if missing (symlinks in `dest` itself are the caller's to choose)
    /// and open it.
    pub fn create(dest: &'a Path) -> Result<Self, UnpackError> {
        let root = Dir::create_all(dest).map_err(|source| UnpackError::Io { path: dest.to_path_buf(), source })?;
        Ok(DestDirs { root, dest, open: HashMap::new() })
    }

    /// The directory holding the image file `name`, and the file's last component;
    /// `create`: make missing directories, else `None` when one is missing.
    pub fn dir_of(&mut self, name: &str, create: bool) -> Result<Option<(Arc<Dir>, OsString)>, UnpackError> {
        // Names were checked when the config was decoded: relative, no traversal.
        let (rel, base) = split_name(name);
        if let Some(d) = self.open.get(rel) {
            return Ok(Some((d.clone(), base.to_os_string())));
        }
        let res = if create { self.root.create_dir_all(rel) } else { self.root.open_dir(rel) };
        match res {
            Ok(d) => {
                let d = Arc::new(d);
                self.open.insert(rel.to_path_buf(), d.clone());
                Ok(Some((d, base.to_os_string())))
            }
            Err(e) if !create && e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(UnpackError::Io { path: self.dest.join(rel), source }),
        }
    }

    /// Whether anything (a file, a symlink, a directory) is under the image file `name`.
    pub fn exists(&mut self, name: &str) -> Result<bool, UnpackError> {
        let Some((dir, base)) = self.dir_of(name, false)? else { return Ok(false) };
        dir.entry(&base).map(|e| e.is_some()).map_err(|source| UnpackError::Io { path: dir.display_path(&base), source })
    }
}

/// A temp name for `base` in its directory: `.<base>.snapctl-partial-<pid>-<seq>-<nanos>`.
pub(crate) fn partial_name(dir: &Dir, base: &OsString) -> (String, OsString) {
    let prefix = format!(".{}.snapctl-partial", base.to_string_lossy());
    let tmp = imgfmt::layout::tempname(dir.path(), &prefix);
    (prefix, tmp.file_name().expect("temp name").to_os_string())
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
    let mut dirs = DestDirs::create(dest)?;
    if !opts.overwrite {
        for f in &image.files {
            if dirs.exists(&f.name)? {
                return Err(UnpackError::Exists(dest.join(&f.name)));
            }
        }
    }
    let shift = image.chunk_shift();
    let mut report = UnpackReport { files: image.files.len(), ..Default::default() };
    for (fi, f) in image.files.iter().enumerate() {
        let (dir, base) = dirs.dir_of(&f.name, true)?.expect("created");
        let final_path = dir.display_path(&base);
        let (_, tmp_name) = partial_name(&dir, &base);
        let tmp = dir.display_path(&tmp_name);
        // Created, never opened through whatever is under the name; 0600 until complete.
        let file = dir.create_new(&tmp_name, 0o600).map_err(io(&tmp))?;
        let mut guard = TempGuard(Some((dir.clone(), tmp_name.clone())));
        // A sparse file of the final size: zero chunks are never written.
        file.set_len(f.size).map_err(io(&tmp))?;

        // Workers take turns writing the file (see pull's `write_at`: the kernel serialises
        // buffered writes to one inode anyway, and its waiters spin: one unpack of 2 GiB
        // took 5.4 s with 8.3 s of system time, the next ones 1.2 s).
        let turn = Mutex::new(());
        let written = AtomicU64::new(0);
        let zeros = AtomicU64::new(0);
        imgfmt::work::try_for_each_index(
            f.chunks.len(),
            opts.threads,
            || (),
            |_, ci| {
                let c = &f.chunks[ci];
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
                    // copies were several times slower (BENCHMARKS.md, "Machine and method").
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
                res
            },
        )?;
        file.set_permissions(fs::Permissions::from_mode(imgfmt::config::applied_mode(f.mode))).map_err(io(&tmp))?;
        file.sync_all().map_err(io(&tmp))?;
        drop(file);
        // Without --overwrite, a name that appeared since the check is not replaced.
        dir.rename(&tmp_name, &base, opts.overwrite).map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => UnpackError::Exists(final_path.clone()),
            _ => UnpackError::Io { path: final_path.clone(), source: e },
        })?;
        guard.0 = None;
        dir.sync().map_err(io(dir.path()))?;
        report.logical_bytes += f.size;
        report.bytes_written += written.into_inner();
        report.zero_chunks += zeros.into_inner();
    }
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}
