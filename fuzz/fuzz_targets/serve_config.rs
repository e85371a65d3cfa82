//! The configuration file of `serve` and `gc` (`--config FILE`, TOML):
//! `registry::config`'s parser, then the settings resolved and checked as serve and gc do
//! (defaults, duration bounds, retention policies compiled). Never panics, whatever the
//! text; globs the policies accept match repository names without blowing up, and a glob
//! without wildcards matches itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use registry::config::FileConfig;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(c) = FileConfig::parse(text) else { return };
    let _ = c.gc_options(true);
    let _ = c.clone().serve_settings();
    let Ok(retention) = c.retention() else { return };
    let _ = retention.warnings();
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
