//! `netem_proxy`: the dialled network of `snapctl_tests::netem` as a program, for `bench/`.
//!
//! ```text
//! netem_proxy --upstream 127.0.0.1:5000 --rtt 20ms --rate 1gbit [--link deep]
//! 127.0.0.1:41237                      <- stdout, first line, once it listens
//! {"connections":3,"max_open":2,"bytes_up":..,...}  <- stdout, last line, when it stops
//! ```
//!
//! The summary: `connections`, `max_open`, `bytes_up`, `bytes_down`, `seconds`, `rtt_ms`,
//! `rate_bps`, `link` (window, deep or shallow), `queue_limit` (a shallow buffer's bytes,
//! else null), `drops` (pieces a shallow buffer dropped), `max_queue_ms` (the most link
//! time a piece found booked ahead of it: the deepest queue).
//!
//! It stops on SIGTERM or SIGINT, and when its stdin reaches end of file, unless stdin is
//! /dev/null (a background job of a script gets /dev/null; a parent that holds a pipe to
//! it ties the proxy's life to its own). Exit codes: 0 stopped as asked, 2 error.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::fs::MetadataExt;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use snapctl_tests::netem::{parse_duration, parse_rate, LinkModel, Netem, NetemConfig};

#[derive(Debug, Parser)]
#[command(about = "A TCP proxy adding round-trip time and a bandwidth cap (a user-space netem)")]
struct Args {
    /// Address to listen on (loopback only; port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Where to relay connections to (HOST:PORT).
    #[arg(long)]
    upstream: String,
    /// Round-trip time added: half of it to every byte in each direction (e.g. 20ms, 500us, 0).
    #[arg(long, default_value = "0", value_parser = parse_duration)]
    rtt: Duration,
    /// Bandwidth cap per direction, shared by all connections, in bits per second as tc
    /// writes it (1gbit, 200mbit); 0 or none: no cap.
    #[arg(long, default_value = "0")]
    rate: String,
    /// Bytes one direction of one connection may have in flight (its TCP window).
    #[arg(long, default_value = "16MiB", value_parser = parse_size)]
    window: u64,
    /// Do not charge a fresh connection one RTT for TCP's handshake.
    #[arg(long)]
    no_handshake: bool,
    /// How the bottleneck queues (needs --rate but for window): window (each busy
    /// connection's next piece waits its turn at the link, pushing back on its sender),
    /// deep (one FIFO per direction takes every byte at once and drops none: only the delay
    /// grows), shallow (window with a buffer of --queue-limit; a piece that does not fit is
    /// dropped and sent again a round trip later). Default: window, or shallow with
    /// --queue-limit.
    #[arg(long, value_name = "MODEL")]
    link: Option<LinkModel>,
    /// A shallow buffer's size per direction (e.g. 256KiB); default: 30 % of the
    /// bandwidth-delay product, at least 256 KiB. Drops are counted in the summary's `drops`.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    queue_limit: Option<u64>,
}

fn parse_size(s: &str) -> Result<u64, String> {
    imgfmt::size::parse_size(s)
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("netem_proxy: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run() -> anyhow::Result<()> {
    let a = Args::parse();
    let rate_bps = parse_rate(&a.rate).map_err(anyhow::Error::msg)?;
    let window = usize::try_from(a.window).context("--window too large")?;
    let queue_limit = a.queue_limit.map(usize::try_from).transpose().context("--queue-limit too large")?;
    let link = a.link.unwrap_or(if queue_limit.is_some() { LinkModel::Shallow } else { LinkModel::Window });
    let cfg = NetemConfig { rtt: a.rtt, rate_bps, window, handshake: !a.no_handshake, link, queue_limit };
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, stop.clone()).context("installing a signal handler")?;
    }
    let netem = Netem::start_on(a.listen, a.upstream.as_str(), cfg.clone()).with_context(|| format!("starting a proxy on {} to {}", a.listen, a.upstream))?;
    let started = Instant::now();
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", netem.addr)?;
    out.flush()?;
    eprintln!(
        "netem_proxy: {} -> {} rtt {:?} rate {} link {}{}",
        netem.addr,
        a.upstream,
        cfg.rtt,
        rate_bps.map_or("none".to_string(), |b| format!("{b} bit/s")),
        link.name(),
        cfg.shallow_limit().map_or(String::new(), |q| format!(" of {q} bytes"))
    );

    if watch_stdin() {
        let s = stop.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            let mut stdin = std::io::stdin();
            while matches!(stdin.read(&mut buf), Ok(n) if n > 0) {}
            s.store(true, Ordering::SeqCst);
        });
    }
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let seconds = started.elapsed().as_secs_f64();
    let (connections, max_open, bytes_up, bytes_down, drops) = (netem.connections(), netem.max_open(), netem.bytes_up(), netem.bytes_down(), netem.drops());
    let max_queue = netem.max_queue();
    drop(netem);
    let summary = serde_json::json!({
        "connections": connections,
        "max_open": max_open,
        "bytes_up": bytes_up,
        "bytes_down": bytes_down,
        "seconds": seconds,
        "rtt_ms": cfg.rtt.as_secs_f64() * 1000.0,
        "rate_bps": rate_bps,
        "link": link.name(),
        "queue_limit": cfg.shallow_limit(),
        "drops": drops,
        "max_queue_ms": max_queue.as_secs_f64() * 1000.0,
    });
    writeln!(out, "{summary}")?;
    Ok(())
}

/// Whether stdin's end of file should stop the proxy: not when it is /dev/null or closed.
fn watch_stdin() -> bool {
    let (Ok(null), Ok(stdin)) = (std::fs::metadata("/dev/null"), std::fs::metadata("/proc/self/fd/0")) else { return false };
    !(null.rdev() == stdin.rdev() && null.ino() == stdin.ino())
}
