//! The configuration file of `serve` and `gc` (`--config FILE`, TOML): `cli`'s parser
//! (`cli/src/cmd/config.rs`, built here from its source file so the fuzz crate does not
//! build the binary), then the retention policies checked and compiled as serve and gc
//! do (`registry::retention::Retention::new`). Never panics, whatever the text; globs the
//! policies accept match repository names without blowing up, and a glob without
//! wildcards matches itself.
#![no_main]

#[allow(dead_code)]
#[path = "../../cli/src/cmd/config.rs"]
mod config;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(c) = config::FileConfig::parse(text) else { return };
    let Ok(retention) = c.retention() else { return };
    for p in &retention.config.policies {
        for g in &p.repositories {
            let plain = !g.contains(['*', '?']);
            assert!(!plain || registry::retention::glob_matches(g, g), "{g:?} does not match itself");
            // Names shaped by the glob: its components, each wildcard taken as a letter.
            let name = g.replace("**", "a/b").replace(['*', '?'], "x");
            let _ = registry::retention::glob_matches(g, &name);
            let _ = retention.policy_for(&name);
        }
    }
    let _ = retention.policy_for("sandboxes/team/vm");
});
