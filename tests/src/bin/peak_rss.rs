//! `peak_rss OUT CMD [ARGS...]`: run CMD (stdio inherited), write its peak resident memory
//! in bytes to the file OUT, and exit with its exit code (128 + signal if it was killed).
//!
//! Why a process of its own: the kernel's peak RSS of a child (`ru_maxrss` from `wait4`)
//! also counts the memory of the process it was exec'd from, and `std::process::Command`
//! spawns with `vfork`, so a child of the test binary would report the *test binary's*
//! peak (a large, varying number while other tests run). This small process is the one
//! the measured command is exec'd from.

use std::os::unix::process::ExitStatusExt;

fn main() {
    let mut args = std::env::args_os().skip(1);
    let (Some(out), Some(cmd)) = (args.next(), args.next()) else {
        eprintln!("usage: peak_rss OUT CMD [ARGS...]");
        std::process::exit(2);
    };
    let child = match std::process::Command::new(&cmd).args(args).spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("peak_rss: {}: {e}", cmd.to_string_lossy());
            std::process::exit(2);
        }
    };
    let mut status = 0i32;
    // SAFETY: wait4 writes one int and one `rusage` into values we own; the pid is our own
    // child, which nothing else waits for.
    let (pid, ru) = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        let pid = libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut ru);
        (pid, ru)
    };
    if pid < 0 {
        eprintln!("peak_rss: wait4: {}", std::io::Error::last_os_error());
        std::process::exit(2);
    }
    std::fs::write(&out, format!("{}\n", ru.ru_maxrss as u64 * 1024)).expect("write OUT");
    let st = std::process::ExitStatus::from_raw(status);
    std::process::exit(st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0)));
}
