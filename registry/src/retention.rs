//! Retention: which tags and manifests a gc keeps, by rules shaped like zot's and Harbor's
//! keep rules, aware of how snapctl snapshots and their referrers hang together.
//!
//! ```text
//! gc scans the store ──► Inventory (per repository: tags, manifest links, referrer
//!                        entries, pull times; per digest: what a manifest lists)
//!                   ──► plan(): a Verdict per tag and per manifest (keep or delete, and
//!                        the rule that said so) ──► gc applies it, then marks and sweeps
//! ```
//!
//! Per repository, the first [`Policy`] whose `repositories` globs match applies (none:
//! the defaults below). Then, in this order:
//!
//! 1. **Tags.** Without `keep_tags` every tag is kept. With it, a tag is kept when one
//!    [`KeepTags`] entry keeps it: it matches the entry's `patterns` (anchored regexes;
//!    none = every tag) and, when the entry has rules, at least one of them holds
//!    (`pushed_within`, `pulled_within`, among the `most_recently_pushed_count` or
//!    `most_recently_pulled_count` tags the patterns match). Attachments are not judged
//!    by `keep_tags`: they follow their subject. An attachment is told by what its
//!    manifest is, not by its name alone ([`attached_subject`]): `sha256-<hex>.sig`
//!    (`.att`, `.sbom`, …: cosign's tag scheme) pointing at a cosign signature,
//!    attestation or SBOM, and `sha256-<hex>` pointing at an index of that subject's
//!    referrers (the OCI referrers fallback).
//! 2. **What kept manifests need.** A kept manifest keeps the manifests an index lists,
//!    the base of a snapctl snapshot (`base.manifest` in its config: `verify` audits it),
//!    its referrers (manifests whose `subject` it is) and the tags named after it.
//!    Parents are *not* kept as manifests: a layer's manifest lists every blob it reads
//!    (ancestors' configs, indexes, outboards and packs), and those blobs stay because
//!    the layer's manifest marks them; the parent's manifest is read by nothing.
//! 3. **Untagged manifests** (no tag at the start of the run) go when `delete_untagged`
//!    (default true) and they are older than `delay`; otherwise they are kept, with what
//!    they need (step 2). A manifest a running restore holds a lease on
//!    ([`crate::restore_lease`]) is kept as if tagged until the lease ends, and its delay
//!    counts from that end.
//! 4. **Referrers live and die with their subject.** A referrer of a kept manifest is kept
//!    (step 2); of a manifest deleted now, it goes now; of a subject that is not in the
//!    repository (deleted earlier, or never pushed), it goes when `delete_referrers`
//!    (default true) and it is older than `delay` (a referrer may be pushed before its
//!    subject). A referrer never keeps its subject alive: every lazy restore records a
//!    trace of the snapshot it restored, so otherwise a re-pushed `vm:latest` would keep
//!    every earlier snapshot that was ever restored.
//! 5. A manifest whose every tag was dropped by `keep_tags` goes, whatever its age.
//!
//! With no policy at all, nothing tagged, nothing a kept manifest needs and nothing younger
//! than `delay` is deleted. The plan is a plain [`Plan`] (serde) that `gc --dry-run --json`
//! prints and a viewer can render.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use imgfmt::OciDigest;
use serde::{Deserialize, Serialize};

/// The `[retention]` table of the configuration file (zot's `retention`, keys in
/// snake_case; zot's camelCase spellings are accepted too).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionConfig {
    /// Report what retention would delete, delete no tag or manifest (unreferenced blobs
    /// are still collected).
    #[serde(default, alias = "dryRun")]
    pub dry_run: bool,
    /// Untagged manifests and referrers whose subject is missing go only once older than
    /// this. `None`: gc's grace period.
    #[serde(default, deserialize_with = "crate::units::opt_duration")]
    pub delay: Option<Duration>,
    /// Checked in order; a repository takes the first whose `repositories` match.
    #[serde(default)]
    pub policies: Vec<Policy>,
}

/// One policy: which repositories, and how their tags and manifests are kept.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// Globs over repository names: `*` within one path component, `**` any number of
    /// components (`team/*`, `tmp/**`, `**`). Empty: every repository.
    #[serde(default)]
    pub repositories: Vec<String>,
    /// Delete referrers whose subject is not in the repository, once older than `delay`
    /// (default true).
    #[serde(default, alias = "deleteReferrers")]
    pub delete_referrers: Option<bool>,
    /// Delete manifests that had no tag at the start of the run, once older than `delay`
    /// (default true).
    #[serde(default, alias = "deleteUntagged")]
    pub delete_untagged: Option<bool>,
    /// Which tags to keep; absent or empty: every tag.
    #[serde(default, alias = "keepTags")]
    pub keep_tags: Option<Vec<KeepTags>>,
}

/// One `keep_tags` entry: `patterns` AND (any rule); no rule: every tag the patterns match.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeepTags {
    /// Regexes a whole tag must match (anchored); empty: every tag.
    #[serde(default)]
    pub patterns: Vec<String>,
    /// Keep the N tags (of those matched) most recently pushed.
    #[serde(default, alias = "mostRecentlyPushedCount")]
    pub most_recently_pushed_count: Option<usize>,
    /// Keep the N tags (of those matched) most recently pulled; never-pulled tags rank last.
    #[serde(default, alias = "mostRecentlyPulledCount")]
    pub most_recently_pulled_count: Option<usize>,
    /// Keep tags pushed within this long.
    #[serde(default, alias = "pushedWithin", deserialize_with = "crate::units::opt_duration")]
    pub pushed_within: Option<Duration>,
    /// Keep tags whose manifest was pulled within this long.
    #[serde(default, alias = "pulledWithin", deserialize_with = "crate::units::opt_duration")]
    pub pulled_within: Option<Duration>,
}

/// The longest `delay`, `pushed_within` or `pulled_within` accepted: ten years.
pub const MAX_DURATION: crate::units::Bound = crate::units::Bound { key: "[retention] delay", max: Duration::from_secs(3650 * 86_400), max_text: "3650d" };

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum RetentionError {
    /// retention policy {policy}: repositories glob {glob:?}: {reason}
    Glob {
        /// Index of the policy (0-based).
        policy: usize,
        /// The glob.
        glob: String,
        /// What is wrong.
        reason: String,
    },
    /// {0}
    Duration(#[from] crate::units::TooLong),
    /// retention policy {policy}, keep_tags entry {entry}: {rule} = 0 keeps no tag, and the policy has no `repositories`, so every tag of every repository would go ("0" does not mean "no limit": leave the rule out to keep every tag the patterns match; to delete tags everywhere on purpose, write repositories = ["**"])
    KeepsNothingEverywhere {
        /// Index of the policy (0-based).
        policy: usize,
        /// Index of the keep_tags entry (0-based).
        entry: usize,
        /// `most_recently_pushed_count` or `most_recently_pulled_count`.
        rule: &'static str,
    },
    /// retention policy {policy}, keep_tags entry {entry}: pattern {pattern:?}: {reason}
    Pattern {
        /// Index of the policy (0-based).
        policy: usize,
        /// Index of the keep_tags entry (0-based).
        entry: usize,
        /// The regex.
        pattern: String,
        /// What is wrong.
        reason: String,
    },
}

/// A [`RetentionConfig`] checked and compiled.
#[derive(Debug, Clone, Default)]
pub struct Retention {
    /// The configuration it was compiled from.
    pub config: RetentionConfig,
    patterns: Vec<Vec<Vec<regex::Regex>>>,
}

impl Retention {
    /// Check globs and compile patterns.
    pub fn new(config: RetentionConfig) -> Result<Retention, RetentionError> {
        MAX_DURATION.check(config.delay)?;
        let mut patterns = Vec::new();
        for (pi, p) in config.policies.iter().enumerate() {
            for g in &p.repositories {
                check_glob(g).map_err(|reason| RetentionError::Glob { policy: pi, glob: g.clone(), reason })?;
            }
            let mut per_entry = Vec::new();
            for (ei, e) in p.keep_tags.iter().flatten().enumerate() {
                for (rule, w) in [("pushed_within", e.pushed_within), ("pulled_within", e.pulled_within)] {
                    MAX_DURATION.check_as(format!("retention policy {pi}, keep_tags entry {ei}: {rule}"), w)?;
                }
                if let Some(rule) = e.zero_count().filter(|_| p.repositories.is_empty()) {
                    return Err(RetentionError::KeepsNothingEverywhere { policy: pi, entry: ei, rule });
                }
                let mut res = Vec::new();
                for pat in &e.patterns {
                    // Bounded compile: a pattern is configuration, but a huge one should fail
                    // cleanly rather than take the server's memory.
                    let re = regex::RegexBuilder::new(&format!("^(?:{pat})$")).size_limit(1 << 20).build().map_err(|e| RetentionError::Pattern {
                        policy: pi,
                        entry: ei,
                        pattern: pat.clone(),
                        reason: e.to_string(),
                    })?;
                    res.push(re);
                }
                per_entry.push(res);
            }
            patterns.push(per_entry);
        }
        Ok(Retention { config, patterns })
    }

    /// What an operator should hear before a run: the keep_tags rules that keep no tag
    /// (a count of 0), each named with the repositories it applies to.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (pi, p) in self.config.policies.iter().enumerate() {
            for (ei, e) in p.keep_tags.iter().flatten().enumerate() {
                if let Some(rule) = e.zero_count() {
                    out.push(format!(
                        "retention policy {pi} ({}), keep_tags entry {ei}: {rule} = 0 keeps no tag; every tag that entry judges goes",
                        p.repositories.join(", ")
                    ));
                }
            }
        }
        out
    }

    /// The index of the policy for `repo` (the first that matches), if any.
    pub fn policy_for(&self, repo: &str) -> Option<usize> {
        self.config.policies.iter().position(|p| p.repositories.is_empty() || p.repositories.iter().any(|g| glob_matches(g, repo)))
    }
}

impl KeepTags {
    /// The count rule that makes this entry keep no tag at all, when one does: a count of
    /// 0 and no other rule (`pushed_within`, `pulled_within`, another count) that could
    /// keep one.
    fn zero_count(&self) -> Option<&'static str> {
        let counts = [("most_recently_pushed_count", self.most_recently_pushed_count), ("most_recently_pulled_count", self.most_recently_pulled_count)];
        let keeps_some = self.pushed_within.is_some() || self.pulled_within.is_some() || counts.iter().any(|(_, n)| n.is_some_and(|n| n > 0));
        if keeps_some {
            return None;
        }
        counts.iter().find(|(_, n)| *n == Some(0)).map(|(rule, _)| *rule)
    }
}

fn check_glob(g: &str) -> Result<(), String> {
    if g.is_empty() {
        return Err("empty".into());
    }
    for seg in g.split('/') {
        if seg.is_empty() {
            return Err("empty path component".into());
        }
        if seg.contains("**") && seg != "**" {
            return Err("`**` must be a whole path component".into());
        }
    }
    Ok(())
}

/// Whether repository `name` matches `glob`: components separated by `/`; `**` matches any
/// number of components (none included), `*` any run of characters within one, `?` one.
/// Linear in the name for each star: a name chosen by whoever may push cannot make gc
/// backtrack (O(glob × name) at worst, both bounded).
pub fn glob_matches(glob: &str, name: &str) -> bool {
    let p: Vec<&str> = glob.split('/').collect();
    let s: Vec<&str> = name.split('/').collect();
    wildcard(&p, &s, |c| *c == "**", |c, n| wildcard(c.as_bytes(), n.as_bytes(), |b| *b == b'*', |a, b| a == b || *a == b'?'))
}

/// The classic two-pointer wildcard match: `star` elements of `p` match any run of `s`,
/// the others one element each (`one`). On a mismatch only the last star is widened: a
/// match that needs an earlier star to take more exists only if one taking more at the
/// last star does, so nothing is tried twice.
fn wildcard<P, S>(p: &[P], s: &[S], star: impl Fn(&P) -> bool, one: impl Fn(&P, &S) -> bool) -> bool {
    let (mut pi, mut si) = (0, 0);
    let mut last_star: Option<(usize, usize)> = None; // (star's index in p, where its run ends in s)
    while si < s.len() {
        if pi < p.len() && star(&p[pi]) {
            last_star = Some((pi, si));
            pi += 1;
        } else if pi < p.len() && one(&p[pi], &s[si]) {
            pi += 1;
            si += 1;
        } else if let Some((sp, end)) = last_star {
            last_star = Some((sp, end + 1));
            pi = sp + 1;
            si = end + 1;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(star)
}

/// The subject a tag is named after: `sha256-<hex>` (the OCI referrers fallback index)
/// or `sha256-<hex>.<suffix>` (cosign's `.sig`, `.att`, `.sbom`, and the like).
pub fn tag_subject(tag: &str) -> Option<OciDigest> {
    let (alg, rest) = tag.split_once('-')?;
    let hex = rest.split('.').next()?;
    if !matches!(alg, "sha256" | "sha512") {
        return None;
    }
    format!("{alg}:{hex}").parse().ok()
}

/// Layer media types of what cosign attaches under its tag scheme: a signature (simple
/// signing), an attestation (DSSE envelope), an SBOM (`cosign attach sbom`).
const COSIGN_LAYER_TYPES: &[&str] = &[
    "application/vnd.dev.cosign.simplesigning.v1+json",
    "application/vnd.dsse.envelope.v1+json",
    "text/spdx",
    "text/spdx+xml",
    "text/spdx+json",
    "application/vnd.cyclonedx",
    "application/vnd.cyclonedx+xml",
    "application/vnd.cyclonedx+json",
    "application/vnd.syft+json",
];

/// The subject tag `tag` (pointing at `target`) is attached to, when it is an attachment:
/// named after its subject ([`tag_subject`]) *and* pointing at what that name stands for.
/// `sha256-<hex>.<suffix>` must point at a manifest whose every layer is a cosign
/// signature, attestation or SBOM; `sha256-<hex>` at an image index whose every entry is
/// a referrer of that subject (the OCI referrers fallback). Any other tag, a CI's
/// content-hash tag `sha256-<hex>` on an image included, is an ordinary tag.
pub fn attached_subject(tag: &str, target: &OciDigest, inv: &Inventory) -> Option<OciDigest> {
    let subject = tag_subject(tag)?;
    let facts = inv.manifests.get(target)?;
    let is_attachment = if tag.contains('.') {
        !facts.layer_types.is_empty() && facts.layer_types.iter().all(|t| COSIGN_LAYER_TYPES.contains(&t.as_str()))
    } else {
        !facts.children.is_empty() && facts.children.iter().all(|c| inv.manifests.get(c).and_then(|m| m.subject.as_ref()) == Some(&subject))
    };
    is_attachment.then_some(subject)
}

/// What gc read from the store: everything retention decides on.
#[derive(Debug, Default, Clone)]
pub struct Inventory {
    /// By repository name.
    pub repos: BTreeMap<String, RepoFacts>,
    /// What each readable manifest lists, by digest (shared by all repositories).
    pub manifests: HashMap<OciDigest, ManifestFacts>,
}

/// One repository's tags, manifest links, referrer entries and pull times.
#[derive(Debug, Default, Clone)]
pub struct RepoFacts {
    /// Tag name → what it points at and when it was last written.
    pub tags: BTreeMap<String, TagFacts>,
    /// Manifests linked in the repository, with when the link was written (pushed).
    pub manifests: BTreeMap<OciDigest, SystemTime>,
    /// `_referrers` entries: (subject, referrer).
    pub referrer_entries: Vec<(OciDigest, OciDigest)>,
    /// When each manifest was last pulled (from `_pulled`).
    pub pulled: HashMap<OciDigest, SystemTime>,
    /// When each restore lease on a manifest ends (from `_leases/`, crate::restore_lease).
    pub leased: HashMap<OciDigest, SystemTime>,
}

/// A tag: its target and when it was last pushed.
#[derive(Debug, Clone)]
pub struct TagFacts {
    /// The manifest it points at.
    pub target: OciDigest,
    /// When the tag was last written (its object's mtime).
    pub pushed: SystemTime,
}

/// What a manifest lists, read from its JSON (and, for a snapctl snapshot, its config).
#[derive(Debug, Default, Clone)]
pub struct ManifestFacts {
    /// Length of the manifest itself.
    pub size: u64,
    /// `artifactType`, else `config.mediaType`.
    pub artifact_type: Option<String>,
    /// `config`, `layers` and `blobs` descriptors (foreign layers excluded).
    pub blobs: Vec<OciDigest>,
    /// The `mediaType` of each of `layers`.
    pub layer_types: Vec<String>,
    /// Manifests an index lists.
    pub children: Vec<OciDigest>,
    /// `subject`.
    pub subject: Option<OciDigest>,
    /// A snapctl snapshot's `base.manifest`.
    pub base: Option<OciDigest>,
}

/// Keep or delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Stays.
    Keep,
    /// Goes (or would, in a dry run).
    Delete,
}

/// Which `keep_tags` rule kept a tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeepBy {
    /// The entry has no rule: every tag its patterns match is kept.
    Patterns,
    /// `pushed_within`.
    PushedWithin,
    /// `pulled_within`.
    PulledWithin,
    /// `most_recently_pushed_count`.
    MostRecentlyPushedCount,
    /// `most_recently_pulled_count`.
    MostRecentlyPulledCount,
}

/// Why a tag or manifest is kept or deleted. Serialized with a `rule` field naming the
/// variant (`{"rule":"untagged","age_seconds":90000}`), flattened into its verdict: field
/// names differ from the verdict's own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "rule", rename_all = "snake_case")]
pub enum Rule {
    /// Keep: tagged with `tag`, which is kept (`entry`/`by`: the keep_tags entry and rule
    /// that kept it; absent: the policy keeps every tag).
    Tagged {
        /// The tag (`via_tag`: a tag verdict has a `tag` of its own).
        #[serde(rename = "via_tag")]
        tag: String,
        /// Index of the keep_tags entry that kept it.
        #[serde(skip_serializing_if = "Option::is_none", default)]
        entry: Option<usize>,
        /// The entry's rule that held.
        #[serde(skip_serializing_if = "Option::is_none", default)]
        by: Option<KeepBy>,
    },
    /// Keep: listed by kept index `index`.
    Child {
        /// The index.
        index: OciDigest,
    },
    /// Keep: the base of kept snapshot `of`.
    Base {
        /// The snapshot naming it as base.
        of: OciDigest,
    },
    /// Keep: refers to kept manifest `subject` (a referrer, or a tag named after it).
    Referrer {
        /// The subject (`of`).
        #[serde(rename = "of")]
        subject: OciDigest,
    },
    /// Keep: a running restore holds a lease on it (`Snapctl-Lease`) until `lease_until`.
    Leased {
        /// When the lease ends (unix seconds).
        #[serde(rename = "lease_until")]
        until: u64,
    },
    /// Keep: untagged, but younger than the delay (counted from the end of its last lease,
    /// if it had one).
    UntaggedWithinDelay {
        /// How old it is.
        age_seconds: u64,
    },
    /// Keep: untagged, and the policy says `delete_untagged = false`.
    KeepUntagged,
    /// Keep: its subject is missing, but it is younger than the delay.
    SubjectMissingWithinDelay {
        /// The missing subject.
        #[serde(rename = "missing_subject")]
        subject: OciDigest,
        /// How old it is.
        age_seconds: u64,
    },
    /// Keep: its subject is missing, and the policy says `delete_referrers = false`.
    KeepReferrers {
        /// The missing subject.
        #[serde(rename = "missing_subject")]
        subject: OciDigest,
    },
    /// Keep: a request relied on it while gc ran, or within the grace period before (a
    /// push in flight, spec/registry.md §4), or the tag changed since gc read it.
    InUse,
    /// Delete: no keep_tags entry keeps it (for a manifest: none of its tags).
    NotKept {
        /// Its tags (for a tag verdict, the tag itself).
        #[serde(rename = "dropped_tags")]
        tags: Vec<String>,
    },
    /// Delete: had no tag, and is older than the delay.
    Untagged {
        /// How old it is.
        age_seconds: u64,
    },
    /// Delete: its subject goes in this run, or is missing and it is older than the delay.
    SubjectGone {
        /// The subject.
        #[serde(rename = "gone_subject")]
        subject: OciDigest,
    },
}

impl Rule {
    /// The subject a `subject_gone` verdict names.
    pub fn gone_subject(&self) -> Option<&OciDigest> {
        match self {
            Rule::SubjectGone { subject } => Some(subject),
            _ => None,
        }
    }

    /// What the rule does.
    pub fn action(&self) -> Action {
        match self {
            Rule::NotKept { .. } | Rule::Untagged { .. } | Rule::SubjectGone { .. } => Action::Delete,
            _ => Action::Keep,
        }
    }
}

/// The verdict on one manifest of one repository.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestVerdict {
    /// The repository.
    pub repository: String,
    /// The manifest.
    pub digest: OciDigest,
    /// Keep or delete.
    pub action: Action,
    /// Why.
    #[serde(flatten)]
    pub rule: Rule,
    /// Index of the policy that applied (absent: none matched; defaults).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub policy: Option<usize>,
    /// Tags pointing at it when the run started.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub tags: Vec<String>,
    /// `artifactType` (else `config.mediaType`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub artifact_type: Option<String>,
    /// `subject`.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub subject: Option<OciDigest>,
    /// When it was pushed (unix seconds).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub pushed: Option<u64>,
    /// When it was last pulled (unix seconds).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub pulled: Option<u64>,
    /// For a deletion: bytes of blobs (the manifest included) that go with it and with no
    /// other deleted manifest.
    pub bytes: u64,
    /// For a deletion: bytes of blobs that go with it and other deleted manifests too,
    /// counted at the first of them in the plan's order (so that `bytes + shared_bytes`
    /// summed over the deletions is what they free).
    pub shared_bytes: u64,
}

/// The verdict on one tag.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TagVerdict {
    /// The repository.
    pub repository: String,
    /// The tag.
    pub tag: String,
    /// What it pointed at.
    pub target: OciDigest,
    /// Keep or delete.
    pub action: Action,
    /// Why.
    #[serde(flatten)]
    pub rule: Rule,
    /// Index of the policy that applied.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub policy: Option<usize>,
    /// When it was pushed (unix seconds).
    pub pushed: u64,
}

/// What retention decided: a verdict per tag and per linked manifest.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Whether tags and manifests were only reported (`dry_run`), not deleted.
    pub dry_run: bool,
    /// The time ages are measured from (unix seconds, the store's clock).
    pub now: u64,
    /// The delay in force, seconds.
    pub delay_seconds: u64,
    /// Every linked manifest, by repository then digest.
    pub manifests: Vec<ManifestVerdict>,
    /// Every tag, by repository then name.
    pub tags: Vec<TagVerdict>,
}

impl Plan {
    /// Manifests to delete.
    pub fn deleted_manifests(&self) -> impl Iterator<Item = &ManifestVerdict> {
        self.manifests.iter().filter(|v| v.action == Action::Delete)
    }
}

fn unix(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Decide, for every tag and linked manifest of `inv`, as of `now`, with `delay` for
/// untagged manifests and orphaned referrers. Pure: reads nothing, deletes nothing.
pub fn plan(retention: &Retention, inv: &Inventory, now: SystemTime, delay: Duration) -> Plan {
    let mut out = Plan { dry_run: retention.config.dry_run, now: unix(now), delay_seconds: delay.as_secs(), ..Plan::default() };
    for (name, repo) in &inv.repos {
        let policy = retention.policy_for(name);
        let (m, t) = plan_repo(retention, policy, name, repo, inv, now, delay);
        out.manifests.extend(m);
        out.tags.extend(t);
    }
    out
}

fn age(now: SystemTime, t: SystemTime) -> Duration {
    now.duration_since(t).unwrap_or_default()
}

/// Where the delay of manifest `d` (pushed at `pushed`) counts from: its push, or the end
/// of its last restore lease when that is later.
fn since(repo: &RepoFacts, d: &OciDigest, pushed: SystemTime) -> SystemTime {
    repo.leased.get(d).map_or(pushed, |end| pushed.max(*end))
}

/// Which keep_tags entry and rule keep each tag (`None`: not kept) of `tags`.
fn judge_tags(
    retention: &Retention,
    policy: usize,
    tags: &[(&String, &TagFacts)],
    pulled: &HashMap<OciDigest, SystemTime>,
    now: SystemTime,
) -> Vec<Option<(usize, KeepBy)>> {
    let entries = retention.config.policies[policy].keep_tags.as_deref().unwrap_or_default();
    let mut verdict: Vec<Option<(usize, KeepBy)>> = vec![None; tags.len()];
    for (ei, e) in entries.iter().enumerate() {
        let res = &retention.patterns[policy][ei];
        let matched: Vec<usize> = (0..tags.len()).filter(|&i| res.is_empty() || res.iter().any(|r| r.is_match(tags[i].0.as_str()))).collect();
        let has_rule =
            e.pushed_within.is_some() || e.pulled_within.is_some() || e.most_recently_pushed_count.is_some() || e.most_recently_pulled_count.is_some();
        let mut keep = |i: usize, by: KeepBy| {
            if verdict[i].is_none() {
                verdict[i] = Some((ei, by));
            }
        };
        if !has_rule {
            for &i in &matched {
                keep(i, KeepBy::Patterns);
            }
            continue;
        }
        let pulled_at = |i: usize| pulled.get(&tags[i].1.target).copied();
        for &i in &matched {
            if e.pushed_within.is_some_and(|w| age(now, tags[i].1.pushed) <= w) {
                keep(i, KeepBy::PushedWithin);
            }
            if e.pulled_within.is_some_and(|w| pulled_at(i).is_some_and(|p| age(now, p) <= w)) {
                keep(i, KeepBy::PulledWithin);
            }
        }
        if let Some(n) = e.most_recently_pushed_count {
            let mut by: Vec<usize> = matched.clone();
            by.sort_by(|&a, &b| tags[b].1.pushed.cmp(&tags[a].1.pushed).then(tags[a].0.cmp(tags[b].0)));
            for &i in by.iter().take(n) {
                keep(i, KeepBy::MostRecentlyPushedCount);
            }
        }
        if let Some(n) = e.most_recently_pulled_count {
            let mut by: Vec<(SystemTime, usize)> = matched.iter().filter_map(|&i| pulled_at(i).map(|p| (p, i))).collect();
            by.sort_by(|a, b| b.0.cmp(&a.0).then(tags[a.1].0.cmp(tags[b.1].0)));
            for &(_, i) in by.iter().take(n) {
                keep(i, KeepBy::MostRecentlyPulledCount);
            }
        }
    }
    verdict
}

/// A repository's tags: attachments (signatures, the referrers fallback), which follow
/// their subject, by subject; and the others, which keep_tags judges.
type SplitTags<'a> = (BTreeMap<&'a String, OciDigest>, Vec<(&'a String, &'a TagFacts)>);

fn split_attachments<'a>(repo: &'a RepoFacts, inv: &Inventory) -> SplitTags<'a> {
    let (mut attached, mut regular) = (BTreeMap::new(), Vec::new());
    for (t, f) in &repo.tags {
        match attached_subject(t, &f.target, inv) {
            Some(s) => drop(attached.insert(t, s)),
            None => regular.push((t, f)),
        }
    }
    (attached, regular)
}

/// What keeping manifest `d` (facts `f`) keeps on its own account, with the rule that
/// keeps each: an index its children (linked or not: their blobs are kept all the same), a
/// snapshot its base when `repo` links it. With [`referrer_kept_by`], the keep relations
/// between manifests: retention plans by them and gc honours them when it deletes.
pub(crate) fn kept_by_manifest<'a>(d: &'a OciDigest, f: &'a ManifestFacts, repo: &'a RepoFacts) -> impl Iterator<Item = (&'a OciDigest, Rule)> + 'a {
    let children = f.children.iter().map(move |c| (c, Rule::Child { index: d.clone() }));
    let base = f.base.iter().filter(move |b| repo.manifests.contains_key(*b)).map(move |b| (b, Rule::Base { of: d.clone() }));
    children.chain(base)
}

/// The manifest whose keeping keeps a referrer (facts `f`): its subject, with the rule.
pub(crate) fn referrer_kept_by(f: &ManifestFacts) -> Option<(&OciDigest, Rule)> {
    f.subject.as_ref().map(|s| (s, Rule::Referrer { subject: s.clone() }))
}

/// One repository seen for planning: its facts and what its tags and referrers point at.
struct RepoView<'a> {
    repo: &'a RepoFacts,
    inv: &'a Inventory,
    /// Attachment tags (signatures, the referrers fallback) → their subject.
    attached: BTreeMap<&'a String, OciDigest>,
    /// Subject → the attachment tags naming it.
    attached_to: HashMap<OciDigest, Vec<&'a String>>,
    /// Subject → its linked referrers, each with the rule its subject keeps it by.
    referrers_of: HashMap<&'a OciDigest, Vec<(&'a OciDigest, Rule)>>,
    /// Manifest → the tags naming it when the scan began.
    tagged_at_start: HashMap<&'a OciDigest, Vec<String>>,
}

impl<'a> RepoView<'a> {
    /// Index `repo`; also returns its regular tags, which keep_tags judges.
    fn new(repo: &'a RepoFacts, inv: &'a Inventory) -> (Self, Vec<(&'a String, &'a TagFacts)>) {
        let (attached, regular) = split_attachments(repo, inv);
        let mut attached_to: HashMap<OciDigest, Vec<&String>> = HashMap::new();
        for (t, s) in &attached {
            attached_to.entry(s.clone()).or_default().push(*t);
        }
        let mut referrers_of: HashMap<&OciDigest, Vec<(&OciDigest, Rule)>> = HashMap::new();
        for d in repo.manifests.keys() {
            if let Some((s, rule)) = inv.manifests.get(d).and_then(referrer_kept_by) {
                referrers_of.entry(s).or_default().push((d, rule));
            }
        }
        let mut tagged_at_start: HashMap<&OciDigest, Vec<String>> = HashMap::new();
        for (t, f) in &repo.tags {
            tagged_at_start.entry(&f.target).or_default().push(t.clone());
        }
        (RepoView { repo, inv, attached, attached_to, referrers_of, tagged_at_start }, regular)
    }
}

/// What a repository's plan keeps so far, and the kept manifests whose own keeps are not
/// yet followed.
#[derive(Default)]
struct Keeping {
    /// Tag → its rule (keep or delete), once decided.
    tag_rules: BTreeMap<String, Rule>,
    /// Kept manifest → the rule that keeps it.
    rules: HashMap<OciDigest, Rule>,
    /// Kept manifests whose keeps [`Keeping::close`] has yet to follow.
    work: Vec<OciDigest>,
}

impl Keeping {
    /// Keep `d` for `rule` unless already decided; tags may name unlinked manifests, whose
    /// blobs are kept all the same (gc marks from every kept tag's target).
    fn keep(&mut self, d: &OciDigest, rule: Rule) {
        if !self.rules.contains_key(d) {
            self.rules.insert(d.clone(), rule);
            self.work.push(d.clone());
        }
    }

    /// Decide each regular tag by the policy's keep_tags (every tag is kept when the
    /// policy judges none), and keep the targets of kept tags.
    fn judge_regular_tags(
        &mut self,
        retention: &Retention,
        policy: Option<usize>,
        judged: bool,
        view: &RepoView,
        regular: &[(&String, &TagFacts)],
        now: SystemTime,
    ) {
        let verdicts =
            if judged { judge_tags(retention, policy.expect("judged needs a policy"), regular, &view.repo.pulled, now) } else { vec![None; regular.len()] };
        for ((t, f), v) in regular.iter().zip(verdicts) {
            let rule = match (judged, v) {
                (false, _) => Rule::Tagged { tag: (*t).clone(), entry: None, by: None },
                (true, Some((entry, by))) => Rule::Tagged { tag: (*t).clone(), entry: Some(entry), by: Some(by) },
                (true, None) => Rule::NotKept { tags: vec![(*t).clone()] },
            };
            if rule.action() == Action::Keep {
                self.keep(&f.target, rule.clone());
            }
            self.tag_rules.insert((*t).clone(), rule);
        }
    }

    /// Keep the manifests under a running restore lease, as if tagged while it runs.
    fn keep_leased(&mut self, repo: &RepoFacts, now: SystemTime) {
        for (d, end) in &repo.leased {
            if *end > now && repo.manifests.contains_key(d) {
                self.keep(d, Rule::Leased { until: unix(*end) });
            }
        }
    }

    /// Keep what kept manifests keep (children, bases, referrers, attachment tags and
    /// their targets), until nothing more is kept.
    fn close(&mut self, view: &RepoView) {
        while let Some(d) = self.work.pop() {
            if let Some(f) = view.inv.manifests.get(&d) {
                for (k, rule) in kept_by_manifest(&d, f, view.repo) {
                    self.keep(k, rule);
                }
            }
            for (r, rule) in view.referrers_of.get(&d).into_iter().flatten() {
                self.keep(r, rule.clone());
            }
            for t in view.attached_to.get(&d).into_iter().flatten() {
                self.tag_rules.entry((*t).clone()).or_insert_with(|| Rule::Referrer { subject: d.clone() });
                self.keep(&view.repo.tags[*t].target, Rule::Referrer { subject: d.clone() });
            }
        }
    }

    /// Keep the manifests not yet kept that the delay or the policy's switches keep: an
    /// untagged manifest, or a referrer whose subject is missing.
    fn keep_by_delay_and_switches(&mut self, view: &RepoView, switches: Switches, now: SystemTime, delay: Duration) {
        let repo = view.repo;
        for (d, pushed) in &repo.manifests {
            if self.rules.contains_key(d) {
                continue;
            }
            let subject = view.inv.manifests.get(d).and_then(|f| f.subject.clone());
            let a = age(now, since(repo, d, *pushed));
            let rule = match subject {
                // A present subject decides (it is kept or goes in this run).
                Some(s) if repo.manifests.contains_key(&s) => continue,
                Some(s) if !switches.delete_referrers => Rule::KeepReferrers { subject: s },
                Some(s) if a < delay => Rule::SubjectMissingWithinDelay { subject: s, age_seconds: a.as_secs() },
                Some(_) => continue,
                None if view.tagged_at_start.contains_key(d) => continue,
                None if !switches.delete_untagged => Rule::KeepUntagged,
                None if a < delay => Rule::UntaggedWithinDelay { age_seconds: a.as_secs() },
                None => continue,
            };
            self.keep(d, rule);
        }
    }

    /// Keep the attachment tags not yet decided whose subject is missing from the
    /// repository, when the policy keeps referrers or the tag is within the delay.
    fn keep_orphan_attachments(&mut self, view: &RepoView, switches: Switches, now: SystemTime, delay: Duration) {
        for (t, s) in &view.attached {
            if self.tag_rules.contains_key(*t) || view.repo.manifests.contains_key(s) {
                continue;
            }
            let f = &view.repo.tags[*t];
            let a = age(now, f.pushed);
            let rule = if !switches.delete_referrers {
                Rule::KeepReferrers { subject: s.clone() }
            } else if a < delay {
                Rule::SubjectMissingWithinDelay { subject: s.clone(), age_seconds: a.as_secs() }
            } else {
                continue;
            };
            self.tag_rules.insert((*t).clone(), rule.clone());
            self.keep(&f.target, rule);
        }
    }

    /// The rule of manifest `d` (pushed at `pushed`) once keeping is done: what keeps it,
    /// else why it goes.
    fn manifest_rule(&self, view: &RepoView, d: &OciDigest, pushed: SystemTime, tags: &[String], now: SystemTime) -> Rule {
        if let Some(r) = self.rules.get(d) {
            return r.clone();
        }
        if let Some(s) = view.inv.manifests.get(d).and_then(|f| f.subject.clone()) {
            return Rule::SubjectGone { subject: s };
        }
        // Its tags were all dropped: by keep_tags, or because their subject goes.
        let by_subject = tags.iter().find_map(|t| view.attached.get(t));
        match by_subject {
            Some(s) if tags.iter().all(|t| view.attached.contains_key(t)) => Rule::SubjectGone { subject: s.clone() },
            _ if !tags.is_empty() => Rule::NotKept { tags: tags.to_vec() },
            _ => Rule::Untagged { age_seconds: age(now, since(view.repo, d, pushed)).as_secs() },
        }
    }
}

/// A policy's switches for what is kept without a tag (both on without a policy).
#[derive(Clone, Copy)]
struct Switches {
    delete_untagged: bool,
    delete_referrers: bool,
}

/// The verdicts on repository `name`'s manifests and tags under `policy`: what tags keep
/// (by keep_tags), what leases keep, what kept manifests keep, what the delay and the
/// policy's switches keep; everything else goes.
fn plan_repo(
    retention: &Retention,
    policy: Option<usize>,
    name: &str,
    repo: &RepoFacts,
    inv: &Inventory,
    now: SystemTime,
    delay: Duration,
) -> (Vec<ManifestVerdict>, Vec<TagVerdict>) {
    let pol = policy.map(|p| &retention.config.policies[p]);
    let switches = Switches {
        delete_untagged: pol.and_then(|p| p.delete_untagged).unwrap_or(true),
        delete_referrers: pol.and_then(|p| p.delete_referrers).unwrap_or(true),
    };
    let judged = pol.and_then(|p| p.keep_tags.as_ref()).is_some_and(|k| !k.is_empty());

    let (view, regular) = RepoView::new(repo, inv);
    let mut k = Keeping::default();
    k.judge_regular_tags(retention, policy, judged, &view, &regular, now);
    k.keep_leased(repo, now);
    k.close(&view);
    k.keep_by_delay_and_switches(&view, switches, now, delay);
    k.keep_orphan_attachments(&view, switches, now, delay);
    k.close(&view);

    // Everything else goes.
    for (t, s) in &view.attached {
        k.tag_rules.entry((*t).clone()).or_insert_with(|| Rule::SubjectGone { subject: s.clone() });
    }
    let mut manifests = Vec::new();
    for (d, pushed) in &repo.manifests {
        let facts = inv.manifests.get(d);
        let tags = view.tagged_at_start.get(d).cloned().unwrap_or_default();
        let rule = k.manifest_rule(&view, d, *pushed, &tags, now);
        manifests.push(ManifestVerdict {
            repository: name.to_string(),
            digest: d.clone(),
            action: rule.action(),
            rule,
            policy,
            tags,
            artifact_type: facts.and_then(|f| f.artifact_type.clone()),
            subject: facts.and_then(|f| f.subject.clone()),
            pushed: Some(unix(*pushed)),
            pulled: repo.pulled.get(d).map(|t| unix(*t)),
            bytes: 0,
            shared_bytes: 0,
        });
    }
    let tags = k
        .tag_rules
        .into_iter()
        .map(|(t, rule)| {
            let f = &repo.tags[&t];
            TagVerdict { repository: name.to_string(), tag: t.clone(), target: f.target.clone(), action: rule.action(), rule, policy, pushed: unix(f.pushed) }
        })
        .collect();
    (manifests, tags)
}

/// The digests a plan keeps: the targets of kept tags and the kept manifests of every
/// repository (what gc marks from). The blobs they list are "referenced by retained
/// manifests" (spec/registry.md §4, the contract compaction relies on).
pub fn kept_roots(plan: &Plan) -> BTreeSet<OciDigest> {
    let mut out: BTreeSet<OciDigest> = plan.manifests.iter().filter(|v| v.action == Action::Keep).map(|v| v.digest.clone()).collect();
    out.extend(plan.tags.iter().filter(|t| t.action == Action::Keep).map(|t| t.target.clone()));
    out
}

/// Repositories and digests of manifests a plan deletes, by repository.
pub fn deleted_by_repo(plan: &Plan) -> BTreeMap<&str, HashSet<&OciDigest>> {
    let mut out: BTreeMap<&str, HashSet<&OciDigest>> = BTreeMap::new();
    for v in plan.deleted_manifests() {
        out.entry(v.repository.as_str()).or_default().insert(&v.digest);
    }
    out
}

#[cfg(test)]
mod tests;
