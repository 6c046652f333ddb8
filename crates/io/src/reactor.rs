//! Reactors: a fixed set of threads, each running its own single-threaded tokio runtime,
//! pinned to one CPU, and owning the connections handed to it.
//!
//! A connection served by one reactor stays on one thread: a request that arrives wakes
//! exactly that thread, and nothing is stolen by or handed to another worker. Where a
//! connection goes is a [`Placement`]: in turn (round robin), or to the reactor on the CPU
//! where the connection's packets arrive (`SO_INCOMING_CPU`), so that waking the reactor
//! does not cross CPUs. On the 2-vCPU machines we measure on, a cross-CPU wake-up costs
//! tens of microseconds, more than the rest of a 4 KiB request (docs/benchmarks.md).
#![allow(unsafe_code)]

use std::future::Future;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// The most reactor threads a process may start.
pub const REACTOR_COUNT_MAX: usize = 256;

/// How new connections are spread over the reactors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Placement {
    /// Each new connection to the next reactor (the default, as SPDK's target does).
    #[default]
    RoundRobin,
    /// To the reactor pinned to the CPU where the connection's packets arrive; round robin
    /// when no reactor is on that CPU.
    IncomingCpu,
    /// Smooth weighted round robin over the reactors' weights (see
    /// [`Reactors::set_weights`]; equal weights by default, which is round robin): a
    /// reactor of weight 2 gets twice the connections of one of weight 1, interleaved.
    WeightedRoundRobin,
}

impl std::str::FromStr for Placement {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "round-robin" => Ok(Placement::RoundRobin),
            "incoming-cpu" => Ok(Placement::IncomingCpu),
            "weighted-round-robin" => Ok(Placement::WeightedRoundRobin),
            _ => Err(format!(
                "unknown placement {text:?} (round-robin, incoming-cpu, weighted-round-robin)"
            )),
        }
    }
}

/// A set of reactor threads.
pub struct Reactors {
    handles: Vec<Handle>,
    cpus: Vec<Option<usize>>,
    placement: Placement,
    next: AtomicUsize,
    /// Weight of each reactor, and its running credit for smooth weighted round robin.
    weights: Mutex<Vec<(u32, i64)>>,
    threads: Mutex<Vec<(oneshot::Sender<()>, JoinHandle<()>)>>,
    /// How long an idle connection polls its socket before its reactor sleeps, in
    /// microseconds (0: it does not).
    poll_us: AtomicU64,
}

impl Reactors {
    /// Starts `count` reactors (1 to [`REACTOR_COUNT_MAX`]) named `name-N`, round robin.
    pub fn start(count: usize, name: &str) -> io::Result<Self> {
        Self::start_with(count, name, Placement::RoundRobin)
    }

    /// Starts `count` reactors named `name-N`; reactor N is pinned to the N-th CPU this
    /// process may run on (when there are more reactors than CPUs, the extra ones float).
    pub fn start_with(count: usize, name: &str, placement: Placement) -> io::Result<Self> {
        if count == 0 || count > REACTOR_COUNT_MAX {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("reactor count {count} is not in 1..={REACTOR_COUNT_MAX}"),
            ));
        }
        let allowed = allowed_cpus();
        let mut handles = Vec::with_capacity(count);
        let mut threads = Vec::with_capacity(count);
        let mut cpus = Vec::with_capacity(count);
        for index in 0..count {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            handles.push(runtime.handle().clone());
            let (stop, stopped) = oneshot::channel::<()>();
            let cpu = allowed.get(index).copied();
            cpus.push(cpu);
            let thread = std::thread::Builder::new()
                .name(format!("{name}-{index}"))
                .spawn(move || {
                    if let Some(cpu) = cpu
                        && let Err(error) = pin_to_cpu(cpu)
                    {
                        tracing::warn!(cpu, %error, "reactor could not be pinned; it floats");
                    }
                    // Tasks spawned through the handle run while this thread drives the runtime.
                    runtime.block_on(async move {
                        let _ = stopped.await;
                    });
                })?;
            threads.push((stop, thread));
        }
        Ok(Self {
            handles,
            cpus,
            placement,
            next: AtomicUsize::new(0),
            weights: Mutex::new(vec![(1, 0); count]),
            threads: Mutex::new(threads),
            poll_us: AtomicU64::new(0),
        })
    }

    /// The CPU each reactor is pinned to, if any.
    pub fn cpus(&self) -> &[Option<usize>] {
        &self.cpus
    }

    /// Runs the `task` serving a connection on the reactor its placement chooses;
    /// `incoming_cpu` is the connection's [`incoming_cpu`], taken before the socket moved.
    pub fn spawn_connection<F>(&self, incoming_cpu: Option<usize>, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let by_cpu = match self.placement {
            Placement::RoundRobin => None,
            Placement::WeightedRoundRobin => Some(self.next_weighted()),
            Placement::IncomingCpu => incoming_cpu
                .and_then(|cpu| self.cpus.iter().position(|pinned| *pinned == Some(cpu))),
        };
        match by_cpu {
            Some(index) => {
                self.handles[index].spawn(task);
            }
            None => self.spawn(task),
        }
    }

    /// Lets a connection with nothing to do poll its socket for up to `poll` before its
    /// reactor goes to sleep (zero: never). Only NVMe/TCP queue pairs read it so far. Off
    /// by default: on a small machine a polling thread takes CPU the other processes need.
    /// It pays where the reactor has a CPU of its own and waking a sleeping CPU is dear
    /// (docs/benchmarks.md).
    pub fn set_poll(&self, poll: std::time::Duration) {
        let micros = u64::try_from(poll.as_micros()).unwrap_or(u64::MAX);
        self.poll_us.store(micros, Ordering::Relaxed);
    }

    /// How long an idle connection polls before sleeping (see [`Reactors::set_poll`]).
    pub fn poll(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.poll_us.load(Ordering::Relaxed))
    }

    /// Sets the reactors' weights for [`Placement::WeightedRoundRobin`]: one per reactor,
    /// not all zero.
    pub fn set_weights(&self, weights: &[u32]) -> io::Result<()> {
        if weights.len() != self.handles.len() || weights.iter().all(|w| *w == 0) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} reactor weights for {} reactors (one each, not all zero)",
                    weights.len(),
                    self.handles.len()
                ),
            ));
        }
        *self.weights.lock().unwrap_or_else(|p| p.into_inner()) =
            weights.iter().map(|w| (*w, 0)).collect();
        Ok(())
    }

    /// The next reactor by smooth weighted round robin: every reactor's credit grows by its
    /// weight, the one with the most credit is chosen and pays the total weight.
    fn next_weighted(&self) -> usize {
        let mut weights = self.weights.lock().unwrap_or_else(|p| p.into_inner());
        let total: i64 = weights.iter().map(|(w, _)| i64::from(*w)).sum();
        let mut best = 0;
        for index in 0..weights.len() {
            let (weight, credit) = &mut weights[index];
            *credit += i64::from(*weight);
            if *credit > weights[best].1 {
                best = index;
            }
        }
        weights[best].1 -= total;
        best
    }

    /// How many reactors there are.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Whether there are none (never: a set of reactors has at least one).
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// Runs `task` on reactor `index` (modulo their count).
    pub fn spawn_on<F>(&self, index: usize, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.handles[index % self.handles.len()].spawn(task);
    }

    /// Runs `task` on the next reactor in turn.
    pub fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let index = self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        self.handles[index].spawn(task);
    }
}

/// Accepts connections on `listener` until the task is dropped, and serves each on a
/// reactor (the one on the connection's incoming CPU when the placement says so). `what`
/// names the protocol in logs; `serve` runs one connection on its reactor.
pub async fn serve_connections<F, Fut>(
    reactors: std::sync::Arc<Reactors>,
    listener: tokio::net::TcpListener,
    what: &'static str,
    serve: F,
) where
    F: Fn(tokio::net::TcpStream, std::net::SocketAddr) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = io::Result<()>> + Send + 'static,
{
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                // No Nagle delay; a client host that died leaves no idle connection behind.
                if let Err(error) = crate::tcp_options::tune(&stream) {
                    tracing::debug!(what, %peer, %error, "connection options not set");
                }
                // The connection moves to a reactor, which registers it with its runtime.
                let stream = match stream.into_std() {
                    Ok(stream) => stream,
                    Err(error) => {
                        tracing::debug!(what, %peer, %error, "connection lost before serving");
                        continue;
                    }
                };
                let serve = serve.clone();
                let cpu = incoming_cpu(&stream);
                reactors.spawn_connection(cpu, async move {
                    let stream = match tokio::net::TcpStream::from_std(stream) {
                        Ok(stream) => stream,
                        Err(error) => {
                            tracing::warn!(what, %peer, %error, "connection could not join a reactor");
                            return;
                        }
                    };
                    if let Err(error) = serve(stream, peer).await {
                        tracing::debug!(what, %peer, %error, "connection ended with an error");
                    }
                });
            }
            Err(error) => {
                // Out of descriptors or similar: back off rather than spin.
                tracing::warn!(what, %error, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

/// The CPUs this process may run on, in order.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: the pointer and size describe `set`, which the call fills.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Vec::new();
    }
    // SAFETY: CPU_ISSET reads the set at an index below CPU_SETSIZE.
    (0..libc::CPU_SETSIZE as usize)
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect()
}

/// Pins the calling thread to `cpu`.
fn pin_to_cpu(cpu: usize) -> io::Result<()> {
    pin_current_thread(&[cpu])
}

/// Lets the calling thread run only on `cpus` (an error when it is empty or names a CPU
/// past `CPU_SETSIZE`, or when the kernel refuses, e.g. none of them is allowed).
pub fn pin_current_thread(cpus: &[usize]) -> io::Result<()> {
    if cpus.is_empty() || cpus.iter().any(|&cpu| cpu >= libc::CPU_SETSIZE as usize) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("cannot pin a thread to CPUs {cpus:?}"),
        ));
    }
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        // SAFETY: cpu is below CPU_SETSIZE (checked above).
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: the pointer and size describe `set`; 0 is the calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// The CPU on which the socket's packets were last processed (`SO_INCOMING_CPU`).
pub fn incoming_cpu(socket: &impl AsRawFd) -> Option<usize> {
    let mut cpu: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: the pointers describe `cpu` and `len`, which getsockopt fills.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_INCOMING_CPU,
            (&mut cpu as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    (rc == 0)
        .then_some(cpu)
        .and_then(|cpu| usize::try_from(cpu).ok())
}

impl Drop for Reactors {
    fn drop(&mut self) {
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        let current = std::thread::current().id();
        for (stop, thread) in threads {
            let _ = stop.send(());
            // The last owner can be a task on one of these threads (a connection holding
            // its server): that thread stops by itself once the task returns.
            if thread.thread().id() != current {
                let _ = thread.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::sync::Arc;

    #[test]
    fn a_thread_is_pinned_to_a_set_of_cpus() {
        let allowed = allowed_cpus();
        let first = allowed[0];
        let pinned = std::thread::spawn(move || {
            pin_current_thread(&[first]).expect("pin");
            allowed_cpus()
        })
        .join()
        .expect("thread");
        assert_eq!(pinned, [first]);
        assert!(pin_current_thread(&[]).is_err(), "no CPU");
        assert!(
            pin_current_thread(&[libc::CPU_SETSIZE as usize]).is_err(),
            "past CPU_SETSIZE"
        );
        assert_eq!(allowed_cpus(), allowed, "the failed calls changed nothing");
    }

    #[test]
    fn weighted_round_robin_interleaves_by_weight() {
        let reactors =
            Reactors::start_with(3, "test-weighted", Placement::WeightedRoundRobin).expect("start");
        let picks: Vec<usize> = (0..6).map(|_| reactors.next_weighted()).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2], "equal weights: round robin");
        reactors.set_weights(&[5, 1, 1]).expect("weights");
        let picks: Vec<usize> = (0..7).map(|_| reactors.next_weighted()).collect();
        assert_eq!(
            picks,
            [0, 0, 1, 0, 2, 0, 0],
            "nginx's smooth sequence for 5:1:1"
        );
        reactors
            .set_weights(&[0, 3, 1])
            .expect("a zero weight gets nothing");
        let picks: Vec<usize> = (0..8).map(|_| reactors.next_weighted()).collect();
        assert_eq!(picks.iter().filter(|p| **p == 0).count(), 0);
        assert_eq!(picks.iter().filter(|p| **p == 1).count(), 6);
        assert!(
            reactors.set_weights(&[1, 1]).is_err(),
            "one weight per reactor"
        );
        assert!(reactors.set_weights(&[0, 0, 0]).is_err(), "not all zero");
    }

    #[test]
    fn tasks_go_round_robin_to_named_threads() {
        let reactors = Reactors::start(2, "test-reactor").expect("start");
        let (names, seen) = std::sync::mpsc::channel();
        for _ in 0..4 {
            let names = names.clone();
            reactors.spawn(async move {
                let name = std::thread::current()
                    .name()
                    .unwrap_or_default()
                    .to_string();
                names.send(name).expect("send");
            });
        }
        let seen: BTreeSet<String> = (0..4).map(|_| seen.recv().expect("recv")).collect();
        let expected: BTreeSet<String> = ["test-reactor-0", "test-reactor-1"]
            .map(String::from)
            .into();
        assert_eq!(seen, expected);
    }

    #[test]
    fn reactors_are_pinned_to_allowed_cpus() {
        let allowed = allowed_cpus();
        assert!(!allowed.is_empty());
        let reactors = Reactors::start_with(1, "pinned", Placement::IncomingCpu).expect("start");
        assert_eq!(reactors.cpus(), &[Some(allowed[0])]);
        let (cpu_sender, cpu) = std::sync::mpsc::channel();
        reactors.spawn(async move {
            // SAFETY: sched_getcpu takes no arguments.
            let current = unsafe { libc::sched_getcpu() };
            cpu_sender.send(current).expect("send");
        });
        assert_eq!(cpu.recv().expect("recv"), allowed[0] as i32);
    }

    #[test]
    fn incoming_cpu_of_a_loopback_connection_is_known() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let client =
            std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (server, _) = listener.accept().expect("accept");
        let cpu = incoming_cpu(&server).expect("SO_INCOMING_CPU");
        assert!(allowed_cpus().contains(&cpu), "cpu {cpu}");
        drop(client);
    }

    #[test]
    fn placements_parse() {
        assert_eq!(
            "round-robin".parse::<Placement>(),
            Ok(Placement::RoundRobin)
        );
        assert_eq!(
            "incoming-cpu".parse::<Placement>(),
            Ok(Placement::IncomingCpu)
        );
        assert_eq!(
            "weighted-round-robin".parse::<Placement>(),
            Ok(Placement::WeightedRoundRobin)
        );
        assert!("cpu".parse::<Placement>().is_err());
    }

    #[test]
    fn reactor_count_is_checked() {
        assert!(Reactors::start(0, "r").is_err());
        assert!(Reactors::start(REACTOR_COUNT_MAX + 1, "r").is_err());
    }

    #[test]
    fn drop_stops_the_threads_and_their_tasks() {
        /// Sets the flag when the task holding it is dropped.
        struct Guard(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Guard {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reactors = Reactors::start(1, "r").expect("start");
        let guard = Guard(dropped.clone());
        reactors.spawn(async move {
            let _guard = guard;
            std::future::pending::<()>().await;
        });
        assert!(
            !dropped.load(Ordering::SeqCst),
            "the task waits while the reactor runs"
        );
        drop(reactors);
        assert!(
            dropped.load(Ordering::SeqCst),
            "dropping the reactors ended the thread and its task"
        );
    }

    /// Connections handed to a frontend come with keep-alive on (a client host that dies
    /// leaves no idle connection behind) and without Nagle's delay.
    #[tokio::test]
    async fn served_connections_have_keep_alive() {
        let reactors = Arc::new(Reactors::start(1, "r").expect("start"));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("address");
        let (told, options) = tokio::sync::oneshot::channel();
        let told = Arc::new(std::sync::Mutex::new(Some(told)));
        tokio::spawn(serve_connections(
            reactors,
            listener,
            "test",
            move |stream, _| {
                let told = told.clone();
                async move {
                    let socket = socket2::SockRef::from(&stream);
                    let seen = (
                        socket.keepalive()?,
                        socket.tcp_keepalive_time()?,
                        stream.nodelay()?,
                    );
                    if let Some(told) = told.lock().expect("lock").take() {
                        let _ = told.send(seen);
                    }
                    Ok(())
                }
            },
        ));
        let _client = tokio::net::TcpStream::connect(address)
            .await
            .expect("connect");
        let seen = tokio::time::timeout(std::time::Duration::from_secs(5), options)
            .await
            .expect("served")
            .expect("options");
        assert_eq!(seen, (true, crate::tcp_options::KEEPALIVE_IDLE, true));
    }
}
