//! The host mount's namespace: inodes and directories made from the images it presents.
//!
//! ```text
//! /                                   root: one directory per image
//! └── sha256:<hex>/                   an image, named by its manifest digest
//!     ├── vm.state, vm.mem, sub/f.img   its files, as packed (directories from the names)
//!     └── .clone/                     an image with a base: for each memory file NAME
//!         ├── NAME.base                 the base's NAME
//!         ├── NAME.pages                the image's pages that differ from the base's
//!         └── NAME.pagemap              which pages those are (a bit per 4 KiB page)
//! ```
//!
//! A file is one inode whoever asks for it: its key is its content (hash, Merkle root,
//! size) and its mode, so the same memory file in two images, or a base's memory file
//! beside every clone of it, shares one inode and so one page cache. Each image that holds
//! a file is one of its providers; a file stays while one remains. Directories belong to
//! their image. Inode numbers are never reused.
//!
//! Nothing here does I/O: [`crate::fs`] answers the kernel from it, [`crate::read`] makes
//! the bytes.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::SystemTime;

use crate::Served;

pub type Ino = u64;
/// The root directory's inode (FUSE's `FUSE_ROOT_ID`).
pub const ROOT: Ino = 1;
/// The directory of an image with a base that holds the clone layout.
pub const CLONE_DIR: &str = ".clone";
/// Pages of the clone layout: the unit a clone owns.
pub const PAGE: u64 = 4096;

/// What a file's bytes are, relative to the image that provides it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Content {
    /// File `file` of the image.
    File { file: usize },
    /// File `file` of the image's base (`NAME.base`).
    BaseFile { file: usize },
    /// The image's file `file` where its 4 KiB pages differ from the base's file
    /// `base_file`, zeros elsewhere (`NAME.pages`).
    Pages { file: usize, base_file: usize },
    /// A bit per page of `Pages`: set where the page differs (`NAME.pagemap`).
    PageMap { file: usize, base_file: usize },
}

/// Attributes of a node, as `stat` shows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr {
    pub ino: Ino,
    pub dir: bool,
    pub size: u64,
    /// Permission bits (`mode & 0o775` as packed for files; 0o755 for directories).
    pub perm: u16,
    pub mtime: SystemTime,
}

/// What a file's bytes are, whichever image holds them: the image's hash name, then the
/// file's Merkle root as `files[].root` writes it (`algo:hex`); and its size. Files with
/// one content have the same bytes, whatever their mode.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ContentId {
    pub root: String,
    pub size: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    /// A file's content and mode: shared by every image holding it.
    Content { id: ContentId, mode: u32 },
    /// A view of one image (its clone layout).
    View { image: String, content: ContentKey },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum ContentKey {
    Pages(usize),
    PageMap(usize),
}

struct FileNode {
    key: Key,
    size: u64,
    perm: u16,
    mtime: SystemTime,
    providers: Vec<(Arc<Served>, Content)>,
    /// Open file handles (an mmap holds its file open until unmapped).
    open: u64,
}

struct DirNode {
    entries: BTreeMap<String, Ino>,
    mtime: SystemTime,
}

enum Node {
    Dir(DirNode),
    File(FileNode),
}

/// One image in the namespace.
struct Entry {
    served: Arc<Served>,
    dir: Ino,
    /// How many times it was added (each `snapctl mount` of it); it goes at zero.
    binds: u32,
    dirs: Vec<Ino>,
    files: Vec<Ino>,
}

/// Why an image cannot be presented.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum TreeError {
    /// {0}: the image has no files: nothing to mount
    NoFiles(String),
    /// {0}: {1:?} is both a file and a directory
    Clash(String, String),
}

/// Inodes and names of every image presented.
pub struct Tree {
    nodes: HashMap<Ino, Node>,
    by_key: HashMap<Key, Ino>,
    images: BTreeMap<String, Entry>,
    next: Ino,
}

impl Default for Tree {
    fn default() -> Self {
        let mut nodes = HashMap::new();
        nodes.insert(ROOT, Node::Dir(DirNode { entries: BTreeMap::new(), mtime: SystemTime::now() }));
        Tree { nodes, by_key: HashMap::new(), images: BTreeMap::new(), next: ROOT + 1 }
    }
}

/// A file to place: its path in the image, size, permission bits, content key and bytes.
struct Placed {
    path: String,
    size: u64,
    perm: u16,
    key: Key,
    content: Content,
}

impl Tree {
    /// Present `served` under its name (again: one more bind of it). Returns its directory,
    /// and whether it is new.
    pub fn add(&mut self, served: Arc<Served>) -> Result<(Ino, bool), TreeError> {
        if let Some(e) = self.images.get_mut(&served.name) {
            e.binds += 1;
            return Ok((e.dir, false));
        }
        let placed = placements(&served)?;
        let now = SystemTime::now();
        let dir = self.new_dir(now);
        let name = served.name.clone();
        self.images.insert(name.clone(), Entry { served: served.clone(), dir, binds: 1, dirs: vec![dir], files: Vec::new() });
        self.entries_mut(ROOT).insert(name.clone(), dir);
        for p in placed {
            if let Err(at) = self.place(&served, p, now) {
                // Undo what was placed: the image is not presented at all.
                self.remove(&name);
                return Err(TreeError::Clash(name, at));
            }
        }
        Ok((dir, true))
    }

    /// Place one file of image `served.name` (registered already); `Err(path)` where its
    /// path clashes with another.
    fn place(&mut self, served: &Arc<Served>, p: Placed, now: SystemTime) -> Result<(), String> {
        let mut entry = self.images.remove(&served.name).expect("registered");
        let res = (|| {
            let parent = self.dir_for(&mut entry, &p.path, now)?;
            let leaf = p.path.rsplit('/').next().expect("a name").to_string();
            if self.entries(parent).is_some_and(|e| e.contains_key(&leaf)) {
                return Err(p.path.clone());
            }
            let ino = self.file_node(served, p, now);
            entry.files.push(ino);
            self.entries_mut(parent).insert(leaf, ino);
            Ok(())
        })();
        self.images.insert(served.name.clone(), entry);
        res
    }

    /// One bind of image `name` fewer; at none it leaves the namespace and is returned
    /// (its open files keep their own reference to it).
    pub fn remove(&mut self, name: &str) -> Option<Arc<Served>> {
        let e = self.images.get_mut(name)?;
        e.binds -= 1;
        if e.binds > 0 {
            return None;
        }
        let e = self.images.remove(name).expect("present");
        self.entries_mut(ROOT).remove(name);
        for d in &e.dirs {
            self.nodes.remove(d);
        }
        for f in &e.files {
            let Some(Node::File(n)) = self.nodes.get_mut(f) else { continue };
            n.providers.retain(|(s, _)| !Arc::ptr_eq(s, &e.served));
            if n.providers.is_empty() {
                let key = n.key.clone();
                self.nodes.remove(f);
                self.by_key.remove(&key);
            }
        }
        Some(e.served)
    }

    /// The images presented, by name.
    pub fn images(&self) -> impl Iterator<Item = (&str, &Arc<Served>)> {
        self.images.iter().map(|(n, e)| (n.as_str(), &e.served))
    }

    pub fn image(&self, name: &str) -> Option<&Arc<Served>> {
        self.images.get(name).map(|e| &e.served)
    }

    /// Times image `name` was added and not yet removed.
    pub fn binds(&self, name: &str) -> u32 {
        self.images.get(name).map_or(0, |e| e.binds)
    }

    /// Open handles on the files of image `name` (a file shared with another image counts
    /// for both).
    pub fn open_files(&self, name: &str) -> u64 {
        let Some(e) = self.images.get(name) else { return 0 };
        e.files
            .iter()
            .filter_map(|f| match self.nodes.get(f) {
                Some(Node::File(n)) => Some(n.open),
                _ => None,
            })
            .sum()
    }

    pub fn lookup(&self, parent: Ino, name: &str) -> Option<Attr> {
        let ino = *self.entries(parent)?.get(name)?;
        self.attr(ino)
    }

    pub fn attr(&self, ino: Ino) -> Option<Attr> {
        Some(match self.nodes.get(&ino)? {
            Node::Dir(d) => Attr { ino, dir: true, size: 0, perm: 0o755, mtime: d.mtime },
            Node::File(f) => Attr { ino, dir: false, size: f.size, perm: f.perm, mtime: f.mtime },
        })
    }

    /// A directory's entries (not `.` and `..`), in name order.
    pub fn readdir(&self, ino: Ino) -> Option<Vec<(String, Attr)>> {
        let e = self.entries(ino)?;
        Some(e.iter().filter_map(|(n, i)| Some((n.clone(), self.attr(*i)?))).collect())
    }

    /// Who serves file `ino`'s bytes, and what they are there.
    pub fn provider(&self, ino: Ino) -> Option<(Arc<Served>, Content, u64)> {
        match self.nodes.get(&ino)? {
            Node::File(f) => f.providers.first().map(|(s, c)| (s.clone(), *c, f.size)),
            Node::Dir(_) => None,
        }
    }

    /// The content of file `ino`, if it is an image's file (not a view of the clone layout).
    pub fn content_id(&self, ino: Ino) -> Option<ContentId> {
        match self.nodes.get(&ino)? {
            Node::File(FileNode { key: Key::Content { id, .. }, .. }) => Some(id.clone()),
            _ => None,
        }
    }

    /// The files image `name` provides that are an image's file (its own, or its base's
    /// in the clone layout): their content and what they are in that image.
    pub fn contents_of(&self, name: &str) -> Vec<(ContentId, Content)> {
        let Some(e) = self.images.get(name) else { return Vec::new() };
        e.files
            .iter()
            .filter_map(|f| match self.nodes.get(f) {
                Some(Node::File(FileNode { key: Key::Content { id, .. }, providers, .. })) => {
                    providers.iter().find(|(s, _)| Arc::ptr_eq(s, &e.served)).map(|(_, c)| (id.clone(), *c))
                }
                _ => None,
            })
            .collect()
    }

    /// Whether a file with content `id` is presented (by any image, in any mode).
    pub fn holds(&self, id: &ContentId) -> bool {
        self.by_key.keys().any(|k| matches!(k, Key::Content { id: i, .. } if i == id))
    }

    /// Count an open (`delta` 1) or a release (-1) of file `ino`.
    pub fn opened(&mut self, ino: Ino, delta: i64) {
        if let Some(Node::File(f)) = self.nodes.get_mut(&ino) {
            f.open = f.open.saturating_add_signed(delta);
        }
    }

    fn entries(&self, ino: Ino) -> Option<&BTreeMap<String, Ino>> {
        match self.nodes.get(&ino)? {
            Node::Dir(d) => Some(&d.entries),
            Node::File(_) => None,
        }
    }

    fn entries_mut(&mut self, ino: Ino) -> &mut BTreeMap<String, Ino> {
        match self.nodes.get_mut(&ino) {
            Some(Node::Dir(d)) => &mut d.entries,
            _ => unreachable!("inode {ino} is a directory of the tree"),
        }
    }

    fn new_dir(&mut self, mtime: SystemTime) -> Ino {
        let ino = self.next;
        self.next += 1;
        self.nodes.insert(ino, Node::Dir(DirNode { entries: BTreeMap::new(), mtime }));
        ino
    }

    /// The directory `path`'s file goes into, made as needed; `Err(path so far)` where a
    /// file is in the way.
    fn dir_for(&mut self, entry: &mut Entry, path: &str, now: SystemTime) -> Result<Ino, String> {
        let mut dir = entry.dir;
        let parts: Vec<&str> = path.split('/').collect();
        for (i, part) in parts[..parts.len() - 1].iter().enumerate() {
            dir = match self.entries(dir).and_then(|e| e.get(*part)).copied() {
                Some(d) if self.entries(d).is_some() => d,
                Some(_) => return Err(parts[..=i].join("/")),
                None => {
                    let d = self.new_dir(now);
                    entry.dirs.push(d);
                    self.entries_mut(dir).insert(part.to_string(), d);
                    d
                }
            };
        }
        Ok(dir)
    }

    /// The inode of a placed file: the existing one with its key (one more provider), or new.
    fn file_node(&mut self, served: &Arc<Served>, p: Placed, now: SystemTime) -> Ino {
        if let Some(&ino) = self.by_key.get(&p.key) {
            if let Some(Node::File(n)) = self.nodes.get_mut(&ino) {
                n.providers.push((served.clone(), p.content));
                return ino;
            }
        }
        let ino = self.next;
        self.next += 1;
        self.by_key.insert(p.key.clone(), ino);
        let node = FileNode { key: p.key, size: p.size, perm: p.perm, mtime: now, providers: vec![(served.clone(), p.content)], open: 0 };
        self.nodes.insert(ino, Node::File(node));
        ino
    }
}

/// Permission bits as pull applies them: no set-id or sticky bits, no write for others.
fn perm(mode: u32) -> u16 {
    (mode & 0o775) as u16
}

/// Every file `served` presents, with its place, content and key.
fn placements(served: &Served) -> Result<Vec<Placed>, TreeError> {
    let image = served.chunks.image();
    if image.files.is_empty() {
        return Err(TreeError::NoFiles(served.reference.clone()));
    }
    let algo = image.config().hash;
    let content_key = |root: &str, size: u64, mode: u32| Key::Content { id: ContentId { root: format!("{}:{root}", algo.name()), size }, mode: mode & 0o775 };
    let mut out: Vec<Placed> = image
        .files
        .iter()
        .enumerate()
        .map(|(i, f)| Placed {
            path: f.name.clone(),
            size: f.size,
            perm: perm(f.mode),
            key: content_key(&image.config().files[i].root, f.size, f.mode),
            content: Content::File { file: i },
        })
        .collect();
    let Some(base) = &served.base else { return Ok(out) };
    if image.file(CLONE_DIR).is_some() || image.files.iter().any(|f| f.name.starts_with(&format!("{CLONE_DIR}/"))) {
        tracing::warn!("{}: the image has a file named {CLONE_DIR}: no clone layout", served.reference);
        return Ok(out);
    }
    let bimage = base.image();
    for (i, f) in image.files.iter().enumerate() {
        if !matches!(f.role, imgfmt::Role::Memory | imgfmt::Role::Pages) {
            continue;
        }
        let Some((b, bf)) = bimage.file(&f.name) else { continue };
        let view = |c: ContentKey| Key::View { image: served.name.clone(), content: c };
        let leaf = f.name.replace('/', "_");
        out.push(Placed {
            path: format!("{CLONE_DIR}/{leaf}.base"),
            size: bf.size,
            perm: perm(bf.mode),
            key: content_key(&bimage.config().files[b].root, bf.size, bf.mode),
            content: Content::BaseFile { file: b },
        });
        out.push(Placed {
            path: format!("{CLONE_DIR}/{leaf}.pages"),
            size: f.size,
            perm: perm(f.mode),
            key: view(ContentKey::Pages(i)),
            content: Content::Pages { file: i, base_file: b },
        });
        out.push(Placed {
            path: format!("{CLONE_DIR}/{leaf}.pagemap"),
            size: f.size.div_ceil(PAGE).div_ceil(8),
            perm: perm(f.mode),
            key: view(ContentKey::PageMap(i)),
            content: Content::PageMap { file: i, base_file: b },
        });
    }
    Ok(out)
}
