//! The planner on hand-made inventories: each rule, alone and against the others.

use super::*;

const HOUR: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(86400);

fn d(name: &str) -> OciDigest {
    OciDigest::of(name.as_bytes())
}

/// An inventory being built, as of `now`.
struct Inv {
    now: SystemTime,
    inv: Inventory,
}

impl Inv {
    fn new() -> Inv {
        Inv { now: UNIX_EPOCH + Duration::from_secs(100 * 86400), inv: Inventory::default() }
    }
    fn ago(&self, a: Duration) -> SystemTime {
        self.now - a
    }
    fn repo(&mut self, r: &str) -> &mut RepoFacts {
        self.inv.repos.entry(r.into()).or_default()
    }
    /// A manifest `name` linked in `r`, pushed `a` ago.
    fn manifest(&mut self, r: &str, name: &str, a: Duration, facts: ManifestFacts) -> OciDigest {
        let t = self.ago(a);
        self.repo(r).manifests.insert(d(name), t);
        self.inv.manifests.insert(d(name), ManifestFacts { size: 100, ..facts });
        d(name)
    }
    fn tag(&mut self, r: &str, tag: &str, target: &OciDigest, a: Duration) {
        let t = self.ago(a);
        self.repo(r).tags.insert(tag.into(), TagFacts { target: target.clone(), pushed: t });
    }
    fn pulled(&mut self, r: &str, m: &OciDigest, a: Duration) {
        let t = self.ago(a);
        self.repo(r).pulled.insert(m.clone(), t);
    }
    fn plan(&self, cfg: RetentionConfig, delay: Duration) -> Plan {
        plan(&Retention::new(cfg).unwrap(), &self.inv, self.now, delay)
    }
}

fn verdict<'a>(p: &'a Plan, repo: &str, m: &OciDigest) -> &'a ManifestVerdict {
    p.manifests.iter().find(|v| v.repository == repo && &v.digest == m).unwrap_or_else(|| panic!("no verdict for {repo}@{m}"))
}

fn tag_verdict<'a>(p: &'a Plan, repo: &str, t: &str) -> &'a TagVerdict {
    p.tags.iter().find(|v| v.repository == repo && v.tag == t).unwrap_or_else(|| panic!("no verdict for {repo}:{t}"))
}

fn referrer_of(s: &OciDigest) -> ManifestFacts {
    ManifestFacts { subject: Some(s.clone()), artifact_type: Some("application/vnd.example".into()), ..Default::default() }
}

/// A cosign signature manifest (it names no subject: its tag does).
fn cosign_signature() -> ManifestFacts {
    ManifestFacts { layer_types: vec!["application/vnd.dev.cosign.simplesigning.v1+json".into()], ..Default::default() }
}

/// No policy: tags and what they need stay; an untagged manifest goes once older than the
/// delay, and with it its referrers and the tags named after it.
#[test]
fn defaults_keep_what_is_tagged_and_needed_and_collect_the_rest_after_the_delay() {
    let mut i = Inv::new();
    let base = i.manifest("vm", "base", 30 * DAY, ManifestFacts::default());
    let live = i.manifest("vm", "live", 2 * DAY, ManifestFacts { base: Some(base.clone()), ..Default::default() });
    i.tag("vm", "latest", &live, 2 * DAY);
    let old = i.manifest("vm", "old", 3 * DAY, ManifestFacts::default());
    let young = i.manifest("vm", "young", 10 * 60 * Duration::from_secs(1), ManifestFacts::default());
    let trace_live = i.manifest("vm", "trace-live", DAY, referrer_of(&live));
    let trace_old = i.manifest("vm", "trace-old", DAY, referrer_of(&old));
    let sig_of_trace = i.manifest("vm", "sig-of-trace", DAY, referrer_of(&trace_live));
    let cosign_live = i.manifest("vm", "cosign-live", DAY, cosign_signature());
    i.tag("vm", &format!("sha256-{}.sig", live.hex()), &cosign_live, DAY);
    let cosign_old = i.manifest("vm", "cosign-old", DAY, cosign_signature());
    i.tag("vm", &format!("sha256-{}.sig", old.hex()), &cosign_old, DAY);
    let idx_child = i.manifest("vm", "child", 5 * DAY, ManifestFacts::default());
    let idx = i.manifest("vm", "index", 5 * DAY, ManifestFacts { children: vec![idx_child.clone()], ..Default::default() });
    i.tag("vm", "multi", &idx, 5 * DAY);

    let p = i.plan(RetentionConfig::default(), HOUR);
    let keep = |m: &OciDigest| verdict(&p, "vm", m).action == Action::Keep;
    assert_eq!(verdict(&p, "vm", &live).rule, Rule::Tagged { tag: "latest".into(), entry: None, by: None });
    assert_eq!(verdict(&p, "vm", &base).rule, Rule::Base { of: live.clone() });
    assert_eq!(verdict(&p, "vm", &trace_live).rule, Rule::Referrer { subject: live.clone() });
    assert_eq!(verdict(&p, "vm", &sig_of_trace).rule, Rule::Referrer { subject: trace_live.clone() }, "referrers of referrers");
    assert_eq!(verdict(&p, "vm", &cosign_live).rule, Rule::Referrer { subject: live.clone() }, "cosign's tag scheme");
    assert_eq!(verdict(&p, "vm", &idx_child).rule, Rule::Child { index: idx.clone() });
    assert!(keep(&young), "younger than the delay");
    assert_eq!(verdict(&p, "vm", &old).rule, Rule::Untagged { age_seconds: 3 * 86400 });
    assert_eq!(verdict(&p, "vm", &trace_old).rule, Rule::SubjectGone { subject: old.clone() }, "a referrer goes with its subject");
    assert_eq!(verdict(&p, "vm", &cosign_old).rule, Rule::SubjectGone { subject: old.clone() });
    assert_eq!(tag_verdict(&p, "vm", &format!("sha256-{}.sig", old.hex())).action, Action::Delete);
    assert_eq!(tag_verdict(&p, "vm", &format!("sha256-{}.sig", live.hex())).action, Action::Keep);
    assert_eq!(tag_verdict(&p, "vm", "latest").action, Action::Keep);
    assert_eq!(p.deleted_manifests().count(), 3, "{p:#?}");
    assert_eq!(kept_roots(&p).len(), 8);
}

/// A referrer never keeps its subject: an old untagged snapshot that was restored (and so
/// has a trace) still goes, its trace with it.
#[test]
fn a_referrer_does_not_keep_its_subject() {
    let mut i = Inv::new();
    let old = i.manifest("vm", "old", 3 * DAY, ManifestFacts::default());
    let trace = i.manifest("vm", "trace", 2 * HOUR, referrer_of(&old));
    let p = i.plan(RetentionConfig::default(), HOUR);
    assert_eq!(verdict(&p, "vm", &old).action, Action::Delete);
    assert_eq!(verdict(&p, "vm", &trace).rule, Rule::SubjectGone { subject: old });
}

/// A referrer whose subject is not there: kept within the delay (it may have been pushed
/// first), then deleted; kept for good with `delete_referrers = false`.
#[test]
fn a_referrer_of_a_missing_subject_waits_for_the_delay() {
    let mut i = Inv::new();
    let missing = d("never pushed");
    let young = i.manifest("vm", "young", 10 * Duration::from_secs(60), referrer_of(&missing));
    let old = i.manifest("vm", "old", DAY, referrer_of(&missing));
    let sig = i.manifest("vm", "sig", DAY, cosign_signature());
    i.tag("vm", &format!("sha256-{}.sig", missing.hex()), &sig, DAY);
    let p = i.plan(RetentionConfig::default(), HOUR);
    assert_eq!(verdict(&p, "vm", &young).rule, Rule::SubjectMissingWithinDelay { subject: missing.clone(), age_seconds: 600 });
    assert_eq!(verdict(&p, "vm", &old).rule, Rule::SubjectGone { subject: missing.clone() });
    assert_eq!(verdict(&p, "vm", &sig).rule, Rule::SubjectGone { subject: missing.clone() });
    let keep = RetentionConfig { policies: vec![Policy { delete_referrers: Some(false), ..Default::default() }], ..Default::default() };
    let p = i.plan(keep, HOUR);
    assert_eq!(verdict(&p, "vm", &old).rule, Rule::KeepReferrers { subject: missing.clone() });
    assert_eq!(verdict(&p, "vm", &sig).rule, Rule::KeepReferrers { subject: missing });
}

/// `delete_untagged = false` keeps untagged manifests and what they need.
#[test]
fn delete_untagged_false_keeps_untagged_manifests() {
    let mut i = Inv::new();
    let old = i.manifest("vm", "old", 3 * DAY, ManifestFacts::default());
    let trace = i.manifest("vm", "trace", 3 * DAY, referrer_of(&old));
    let cfg = RetentionConfig { policies: vec![Policy { delete_untagged: Some(false), ..Default::default() }], ..Default::default() };
    let p = i.plan(cfg, HOUR);
    assert_eq!(verdict(&p, "vm", &old).rule, Rule::KeepUntagged);
    assert_eq!(verdict(&p, "vm", &trace).rule, Rule::Referrer { subject: old });
}

/// keep_tags: patterns AND (rules), entries OR'ed, zot's semantics; a manifest whose every
/// tag is dropped goes at once (no delay), and the tags named after it too.
#[test]
fn keep_tags_rules() {
    let mut i = Inv::new();
    let mut m = BTreeMap::new();
    // v1..v6 pushed 6..1 days ago; dev-a, dev-b pushed 40 and 2 days ago; "pinned".
    for (k, (tag, days)) in
        [("v1", 6), ("v2", 5), ("v3", 4), ("v4", 3), ("v5", 2), ("v6", 1), ("dev-a", 40), ("dev-b", 2), ("pinned", 90)].into_iter().enumerate()
    {
        let md = i.manifest("app", tag, (days as u32) * DAY, ManifestFacts::default());
        i.tag("app", tag, &md, (days as u32) * DAY);
        m.insert(tag, md);
        let _ = k;
    }
    // v1 was pulled an hour ago, v2 twenty days ago; dev-a yesterday.
    i.pulled("app", &m["v1"], HOUR);
    i.pulled("app", &m["v2"], 20 * DAY);
    i.pulled("app", &m["dev-a"], DAY);
    let sig = i.manifest("app", "sig-of-v2", 5 * DAY, cosign_signature());
    i.tag("app", &format!("sha256-{}.sig", m["v2"].hex()), &sig, 5 * DAY);
    let toml = r#"
        delay = "1h"
        [[policies]]
        repositories = ["app"]
        [[policies.keep_tags]]
        patterns = ["v.*"]
        most_recently_pushed_count = 2
        most_recently_pulled_count = 1
        [[policies.keep_tags]]
        patterns = ["dev-.*"]
        pulledWithin = "7d"
        [[policies.keep_tags]]
        patterns = ["pinned"]
    "#;
    let cfg: RetentionConfig = toml::from_str(toml).unwrap();
    let p = i.plan(cfg, HOUR);
    let rule = |t: &str| tag_verdict(&p, "app", t).rule.clone();
    let kept = |t: &str, entry: usize, by: KeepBy| Rule::Tagged { tag: t.into(), entry: Some(entry), by: Some(by) };
    assert_eq!(rule("v6"), kept("v6", 0, KeepBy::MostRecentlyPushedCount));
    assert_eq!(rule("v5"), kept("v5", 0, KeepBy::MostRecentlyPushedCount));
    assert_eq!(rule("v1"), kept("v1", 0, KeepBy::MostRecentlyPulledCount));
    for t in ["v2", "v3", "v4"] {
        assert_eq!(rule(t), Rule::NotKept { tags: vec![t.into()] }, "{t}");
        assert_eq!(verdict(&p, "app", &m[t]).rule, Rule::NotKept { tags: vec![t.into()] });
    }
    assert_eq!(rule("dev-a"), kept("dev-a", 1, KeepBy::PulledWithin));
    assert_eq!(rule("dev-b"), Rule::NotKept { tags: vec!["dev-b".into()] }, "pushed recently, never pulled: no rule holds");
    assert_eq!(rule("pinned"), kept("pinned", 2, KeepBy::Patterns), "an entry without rules keeps what it matches");
    // The signature of v2 goes with it.
    assert_eq!(verdict(&p, "app", &sig).rule, Rule::SubjectGone { subject: m["v2"].clone() });
    assert_eq!(tag_verdict(&p, "app", &format!("sha256-{}.sig", m["v2"].hex())).action, Action::Delete);

    // pushed_within, and patterns are anchored: "v" alone matches no tag.
    let cfg: RetentionConfig = toml::from_str(
        r#"
        [[policies]]
        [[policies.keep_tags]]
        patterns = ["v"]
        [[policies.keep_tags]]
        pushed_within = "50h"
    "#,
    )
    .unwrap();
    let p = i.plan(cfg, HOUR);
    let kept: BTreeSet<&str> = p.tags.iter().filter(|t| t.action == Action::Keep && !t.tag.starts_with("sha256-")).map(|t| t.tag.as_str()).collect();
    assert_eq!(kept, ["v5", "v6", "dev-b"].into_iter().collect());
}

/// The first policy whose globs match applies; a repository no policy matches keeps its
/// tags (defaults for the rest).
#[test]
fn the_first_matching_policy_applies() {
    let mut i = Inv::new();
    for r in ["tmp/a/b", "infra/x", "other"] {
        let md = i.manifest(r, &format!("{r}-m"), 30 * DAY, ManifestFacts::default());
        i.tag(r, "old", &md, 30 * DAY);
    }
    let cfg: RetentionConfig = toml::from_str(
        r#"
        [[policies]]
        repositories = ["infra/*"]
        [[policies]]
        repositories = ["tmp/**"]
        keep_tags = [{ pushed_within = "1d" }]
    "#,
    )
    .unwrap();
    let p = i.plan(cfg, HOUR);
    assert_eq!(tag_verdict(&p, "tmp/a/b", "old").action, Action::Delete);
    assert_eq!(tag_verdict(&p, "tmp/a/b", "old").policy, Some(1));
    assert_eq!(tag_verdict(&p, "infra/x", "old").action, Action::Keep);
    assert_eq!(tag_verdict(&p, "infra/x", "old").policy, Some(0));
    assert_eq!(tag_verdict(&p, "other", "old").action, Action::Keep);
    assert_eq!(tag_verdict(&p, "other", "old").policy, None);
}

#[test]
fn globs() {
    for (g, n, want) in [
        ("infra/*", "infra/x", true),
        ("infra/*", "infra/x/y", false),
        ("infra/*", "infra", false),
        ("tmp/**", "tmp/a/b/c", true),
        ("tmp/**", "tmp", true),
        ("**", "a/b", true),
        ("*", "a", true),
        ("*", "a/b", false),
        ("vm-?", "vm-1", true),
        ("vm-?", "vm-10", false),
        ("team/*/vm", "team/a/vm", true),
        ("**/vm", "a/b/vm", true),
        ("**/vm", "vm", true),
        ("**/vm", "a/vmx", false),
    ] {
        assert_eq!(glob_matches(g, n), want, "{g} {n}");
    }
    let bad = RetentionConfig { policies: vec![Policy { repositories: vec!["a/**b".into()], ..Default::default() }], ..Default::default() };
    assert!(matches!(Retention::new(bad), Err(RetentionError::Glob { policy: 0, .. })));
    let bad: RetentionConfig = toml::from_str("[[policies]]\nkeep_tags = [{ patterns = [\"(\"] }]").unwrap();
    assert!(matches!(Retention::new(bad), Err(RetentionError::Pattern { policy: 0, entry: 0, .. })));
}

/// The matcher before it was made linear, as the reference for what a glob means.
fn backtracking_glob(glob: &str, name: &str) -> bool {
    fn comp(p: &[u8], s: &[u8]) -> bool {
        match (p.first(), s.first()) {
            (None, None) => true,
            (Some(b'*'), _) => comp(&p[1..], s) || (!s.is_empty() && comp(p, &s[1..])),
            (Some(b'?'), Some(_)) => comp(&p[1..], &s[1..]),
            (Some(a), Some(b)) if a == b => comp(&p[1..], &s[1..]),
            _ => false,
        }
    }
    fn segs(p: &[&str], s: &[&str]) -> bool {
        match (p.first(), s.first()) {
            (None, None) => true,
            (Some(&"**"), _) => segs(&p[1..], s) || (!s.is_empty() && segs(p, &s[1..])),
            (Some(a), Some(b)) => comp(a.as_bytes(), b.as_bytes()) && segs(&p[1..], &s[1..]),
            _ => false,
        }
    }
    segs(&glob.split('/').collect::<Vec<_>>(), &name.split('/').collect::<Vec<_>>())
}

/// Every glob and name over a small alphabet up to a few symbols: the same answers as the
/// backtracking definition.
#[test]
fn the_linear_glob_matcher_agrees_with_the_definition() {
    fn all(alphabet: &[&str], max: usize) -> Vec<String> {
        let mut out = vec![String::new()];
        let mut last = vec![String::new()];
        for _ in 0..max {
            last = last.iter().flat_map(|w| alphabet.iter().map(move |a| format!("{w}{a}"))).collect();
            out.extend(last.iter().cloned());
        }
        out
    }
    let globs = all(&["a", "b", "*", "?", "/", "**"], 4);
    let names = all(&["a", "b", "/"], 5);
    let mut checked = 0;
    for g in globs.iter().filter(|g| !g.is_empty() && g.split('/').all(|c| !c.is_empty() && (c == "**" || !c.contains("**")))) {
        for n in names.iter().filter(|n| !n.is_empty() && n.split('/').all(|c| !c.is_empty())) {
            assert_eq!(glob_matches(g, n), backtracking_glob(g, n), "{g:?} {n:?}");
            checked += 1;
        }
    }
    assert!(checked > 50_000, "{checked}");
}

/// Issue 35: retention's repository glob backtracked exponentially: one 120-byte
/// repository name, which anyone who may push can choose, held gc for more than 20 s on
/// a glob with 7 stars (5 stars: 0.5 s). Now each answer is immediate, for stars within
/// a component and `**` across components alike.
#[test]
fn regression_issue_35_a_hostile_repository_name_does_not_hold_gc_on_a_many_star_glob() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let name = "a".repeat(120);
        let deep = vec!["a"; 60].join("/");
        let answers = (
            glob_matches("*a*a*a*a*a*a*a*a*a*a*b", &name),
            glob_matches("**/a/**/a/**/a/**/a/**/a/**/a/**/a/**/b", &deep),
            glob_matches("*a*a*a*a*a*a*a*a*a*a*", &name),
        );
        let _ = tx.send(answers);
    });
    // The backtracking matcher needs hours here; a linear one, microseconds.
    let got = rx.recv_timeout(std::time::Duration::from_secs(5)).expect("the glob match did not finish within 5 s");
    assert_eq!(got, (false, false, true));
}

#[test]
fn subject_named_tags() {
    let s = d("x");
    assert_eq!(tag_subject(&format!("sha256-{}", s.hex())), Some(s.clone()));
    assert_eq!(tag_subject(&format!("sha256-{}.sig", s.hex())), Some(s.clone()));
    assert_eq!(tag_subject(&format!("sha256-{}.att", s.hex())), Some(s.clone()));
    assert_eq!(tag_subject("sha256-abc.sig"), None);
    assert_eq!(tag_subject("latest"), None);
    assert_eq!(tag_subject(&format!("md5-{}", s.hex())), None);
}

/// Issue 35: with no retention policy, gc deleted a tagged image whose tag has the shape
/// `sha256-<64 hex>` (a CI's content-hash tag): taken by its name for the referrers
/// fallback tag of a subject that is gone. An attachment is now told by what its manifest
/// is; nothing tagged goes without a policy.
#[test]
fn regression_issue_35_a_content_hash_tag_on_an_image_is_an_ordinary_tag() {
    let mut i = Inv::new();
    let gone = d("a subject that is not in the repository");
    let image = i.manifest("ci", "image", 30 * DAY, ManifestFacts { blobs: vec![d("config"), d("layer")], ..Default::default() });
    i.tag("ci", &format!("sha256-{}", gone.hex()), &image, 30 * DAY);
    let signed_image = i.manifest("ci", "signed-image", 30 * DAY, ManifestFacts::default());
    i.tag("ci", &format!("sha256-{}.sig", gone.hex()), &signed_image, 30 * DAY);
    // Real attachments of the missing subject still go with it.
    let sig = i.manifest("ci", "sig", 30 * DAY, cosign_signature());
    let other = d("another missing subject");
    i.tag("ci", &format!("sha256-{}.sig", other.hex()), &sig, 30 * DAY);
    let referrer = i.manifest("ci", "referrer", 30 * DAY, referrer_of(&other));
    let fallback = i.manifest("ci", "fallback", 30 * DAY, ManifestFacts { children: vec![referrer.clone()], ..Default::default() });
    i.tag("ci", &format!("sha256-{}", other.hex()), &fallback, 30 * DAY);

    let p = i.plan(RetentionConfig::default(), HOUR);
    for (m, t) in [(&image, format!("sha256-{}", gone.hex())), (&signed_image, format!("sha256-{}.sig", gone.hex()))] {
        assert_eq!(verdict(&p, "ci", m).rule, Rule::Tagged { tag: t.clone(), entry: None, by: None }, "{p:#?}");
        assert_eq!(tag_verdict(&p, "ci", &t).action, Action::Keep);
    }
    for m in [&sig, &fallback, &referrer] {
        assert_eq!(verdict(&p, "ci", m).rule, Rule::SubjectGone { subject: other.clone() }, "{p:#?}");
    }
    assert_eq!(p.deleted_manifests().count(), 3);
}

/// zot's camelCase keys are accepted beside snake_case; unknown keys are refused.
#[test]
fn configuration_keys() {
    let cfg: RetentionConfig = toml::from_str(
        r#"
        dryRun = true
        delay = 86400
        [[policies]]
        repositories = ["a"]
        deleteReferrers = false
        deleteUntagged = false
        keepTags = [{ patterns = ["v.*"], mostRecentlyPushedCount = 3, mostRecentlyPulledCount = 2, pushedWithin = "720h", pulledWithin = "30d" }]
    "#,
    )
    .unwrap();
    assert!(cfg.dry_run);
    assert_eq!(cfg.delay, Some(DAY));
    let k = &cfg.policies[0].keep_tags.as_ref().unwrap()[0];
    assert_eq!((k.most_recently_pushed_count, k.most_recently_pulled_count), (Some(3), Some(2)));
    assert_eq!((k.pushed_within, k.pulled_within), (Some(30 * DAY), Some(30 * DAY)));
    assert_eq!((cfg.policies[0].delete_referrers, cfg.policies[0].delete_untagged), (Some(false), Some(false)));
    assert!(toml::from_str::<RetentionConfig>("[[policies]]\nkeep_tag = []").is_err(), "a misspelt key is refused");
    assert!(toml::from_str::<RetentionConfig>("delay = \"soon\"").is_err());
}

/// The plan serializes with a `rule` field per verdict, and reads back (a viewer's input).
#[test]
fn the_plan_is_plain_data() {
    let mut i = Inv::new();
    let old = i.manifest("vm", "old", 3 * DAY, ManifestFacts::default());
    let p = i.plan(RetentionConfig::default(), HOUR);
    let j = serde_json::to_value(&p).unwrap();
    assert_eq!(j["manifests"][0]["rule"], "untagged");
    assert_eq!(j["manifests"][0]["action"], "delete");
    assert_eq!(j["manifests"][0]["digest"], old.to_string());
    assert_eq!(j["manifests"][0]["age_seconds"], 3 * 86400);
    let back: Plan = serde_json::from_value(j).unwrap();
    assert_eq!(back, p);
    // Every rule's fields stay apart from the verdicts' own (flattened into one object).
    let rules = [
        Rule::Tagged { tag: "t".into(), entry: Some(1), by: Some(KeepBy::PulledWithin) },
        Rule::Child { index: old.clone() },
        Rule::Base { of: old.clone() },
        Rule::Referrer { subject: old.clone() },
        Rule::UntaggedWithinDelay { age_seconds: 1 },
        Rule::KeepUntagged,
        Rule::SubjectMissingWithinDelay { subject: old.clone(), age_seconds: 1 },
        Rule::KeepReferrers { subject: old.clone() },
        Rule::InUse,
        Rule::NotKept { tags: vec!["t".into()] },
        Rule::Untagged { age_seconds: 1 },
        Rule::SubjectGone { subject: old.clone() },
    ];
    for rule in rules {
        let mut v = p.manifests[0].clone();
        v.rule = rule.clone();
        v.tags = vec!["x".into()];
        v.subject = Some(d("s"));
        let j = serde_json::to_string(&v).unwrap();
        assert_eq!(serde_json::from_str::<ManifestVerdict>(&j).unwrap(), v, "{j}");
        let t = TagVerdict { repository: "vm".into(), tag: "x".into(), target: old.clone(), action: rule.action(), rule, policy: Some(0), pushed: 5 };
        let j = serde_json::to_string(&t).unwrap();
        assert_eq!(serde_json::from_str::<TagVerdict>(&j).unwrap(), t, "{j}");
    }
}

/// Issue 35: a keep count of 0 in a policy with no `repositories` list deleted every tag
/// of every repository with no warning (0 reads as "no limit" to many). Refused unless the
/// policy names its repositories, `["**"]` for all of them on purpose; then `warnings`
/// says it (gc prints them).
#[test]
fn regression_issue_35_a_count_of_zero_for_every_repository_is_refused_unless_written_on_purpose() {
    let cfg = |repos: &str, entry: &str| {
        toml::from_str::<RetentionConfig>(&format!("[[policies]]\n{repos}\nkeep_tags = [{{ patterns = [\"v.*\"] }}, {{ {entry} }}]\n")).unwrap()
    };
    for rule in ["most_recently_pushed_count", "most_recently_pulled_count"] {
        let e = Retention::new(cfg("", &format!("{rule} = 0"))).unwrap_err();
        assert!(matches!(e, RetentionError::KeepsNothingEverywhere { policy: 0, entry: 1, .. }), "{e}");
        let text = e.to_string();
        assert!(text.contains(&format!("{rule} = 0")) && text.contains("repositories = [\"**\"]"), "{text}");
        let on_purpose = Retention::new(cfg("repositories = [\"**\"]", &format!("{rule} = 0"))).unwrap();
        let w = on_purpose.warnings();
        assert!(w.len() == 1 && w[0].contains(&format!("{rule} = 0 keeps no tag")) && w[0].contains("(**)"), "{w:?}");
    }
    for keeps_some in [
        "most_recently_pushed_count = 0, pushed_within = \"1d\"",
        "most_recently_pushed_count = 0, most_recently_pulled_count = 2",
        "most_recently_pushed_count = 3",
    ] {
        let r = Retention::new(cfg("", keeps_some)).unwrap_or_else(|e| panic!("{keeps_some}: {e}"));
        assert!(r.warnings().is_empty(), "{keeps_some}");
    }
}

/// Issue 35: durations past any sense are refused at load, naming the key and the bound.
#[test]
fn regression_issue_35_retention_durations_are_bounded_at_load() {
    let e = Retention::new(toml::from_str("delay = 9223372036854775807").unwrap()).unwrap_err().to_string();
    assert_eq!(e, "[retention] delay = 9223372036854775807s: longer than 3650d, the most it may be");
    let e = Retention::new(toml::from_str("[[policies]]\nkeep_tags = [{ pulled_within = \"4000d\" }]").unwrap()).unwrap_err().to_string();
    assert!(e.starts_with("retention policy 0, keep_tags entry 0: pulled_within = "), "{e}");
    Retention::new(toml::from_str("delay = \"3650d\"\n[[policies]]\nkeep_tags = [{ pushed_within = \"3650d\" }]").unwrap()).unwrap();
}
