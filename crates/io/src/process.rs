//! Process-wide settings of command-line tools, and what a process knows of its host.
#![allow(unsafe_code)]

/// Lets SIGPIPE end the process, as command-line tools do: `basalt pg ls | head` then
/// stops quietly instead of failing to print. Rust ignores SIGPIPE by default; daemons keep
/// that (a peer closing a socket must not kill them), so only commands call this.
pub fn default_sigpipe() {
    // SAFETY: restoring a signal's default disposition touches no memory of ours.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// This host's name (`None` if it cannot be read).
pub fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| name.trim().to_string())
}

/// Offers the CPU to any other runnable thread (`sched_yield`); returns at once when there
/// is none. A polling loop calls it so that it spins only on a CPU nothing else wants.
pub fn yield_cpu() {
    // SAFETY: sched_yield takes no arguments and touches no memory.
    unsafe {
        libc::sched_yield();
    }
}
