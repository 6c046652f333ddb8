//! Helpers for process tests: a `basalt target` child process, JSON-RPC on its socket,
//! scratch directories, and external tools (which must be installed: `scripts/test.sh`
//! installs them; a missing tool fails the test rather than skipping it).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The `basalt` binary under test.
pub fn basalt() -> Command {
    Command::new(env!("CARGO_BIN_EXE_basalt"))
}

/// A scratch directory on a disk-backed filesystem (under `target/`), removed on drop.
pub struct ScratchDir {
    pub path: PathBuf,
}

impl ScratchDir {
    pub fn new(name: &str) -> Self {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let unique = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("{name}-{}-{unique}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create scratch dir");
        Self { path }
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        // BASALT_KEEP_SCRATCH=1 keeps the directory (logs, devices) to look at afterwards.
        if std::env::var_os("BASALT_KEEP_SCRATCH").is_none() {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Fails unless `tool` is on the PATH.
pub fn require(tool: &str) {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    assert!(
        found,
        "{tool} is not installed; scripts/test.sh installs the tools the tests need"
    );
}

/// Runs a command, printing its output, and returns it.
pub fn run(command: &mut Command) -> Output {
    let output = command
        .output()
        .unwrap_or_else(|error| panic!("cannot run {command:?}: {error}"));
    eprintln!(
        "$ {command:?}\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Runs a command that must succeed; returns its stdout.
pub fn run_ok(command: &mut Command) -> String {
    let output = run(command);
    assert!(
        output.status.success(),
        "{command:?} failed: {}",
        output.status
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Waits until `ready` holds, polling; panics with `what` after `timeout`.
pub fn wait_for(what: &str, timeout: Duration, ready: impl FnMut() -> bool) {
    wait_for_telling(what, timeout, ready, String::new);
}

/// [`wait_for`], adding what `tell` says to the failure (a process's log, say).
pub fn wait_for_telling(
    what: &str,
    timeout: Duration,
    mut ready: impl FnMut() -> bool,
    tell: impl Fn() -> String,
) {
    let start = Instant::now();
    while !ready() {
        assert!(
            start.elapsed() < timeout,
            "timed out waiting for {what}{}",
            tell()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A running `basalt target`; killed when dropped.
pub struct TargetProcess {
    pub child: Child,
    pub socket: PathBuf,
    pub log: PathBuf,
}

impl TargetProcess {
    /// Starts a target with its socket in `dir` and extra arguments.
    pub fn start(dir: &Path, extra: &[&str]) -> Self {
        let socket = dir.join("rpc.sock");
        let log = dir.join("target.log");
        let child = basalt()
            .arg("target")
            .arg("--rpc-socket")
            .arg(&socket)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn basalt target");
        let mut target = Self { child, socket, log };
        let socket = target.socket.clone();
        let start = Instant::now();
        while UnixStream::connect(&socket).is_err() {
            if let Ok(Some(status)) = target.child.try_wait() {
                panic!("basalt target exited with {status}: {}", target.log_text());
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "target socket never appeared: {}",
                target.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        target
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Calls a method; `Ok(result)` or `Err(error object)`.
    pub fn rpc(&self, method: &str, params: Value) -> Result<Value, Value> {
        let response = rpc_call(&self.socket, method, params);
        match response.get("error") {
            Some(error) => Err(error.clone()),
            None => Ok(response["result"].clone()),
        }
    }

    /// Calls a method that must succeed.
    pub fn rpc_ok(&self, method: &str, params: Value) -> Value {
        self.rpc(method, params.clone())
            .unwrap_or_else(|error| panic!("{method} {params} failed: {error}"))
    }

    /// Calls a method that must fail with `code`; returns the message.
    pub fn rpc_err(&self, method: &str, params: Value, code: i64) -> String {
        let error = self
            .rpc(method, params.clone())
            .expect_err(&format!("{method} {params} must fail"));
        assert_eq!(error["code"], json!(code), "{method} {params}: {error}");
        error["message"].as_str().unwrap_or_default().to_string()
    }

    /// Starts the NBD server on a free loopback port and returns the port.
    pub fn start_nbd(&self) -> u16 {
        let answer = self.rpc_ok(
            "nbd_server_start",
            json!({"listen_address": "127.0.0.1", "port": 0}),
        );
        answer["port"].as_u64().expect("port") as u16
    }

    /// Creates the TCP transport and subsystem `nqn` (any host) with `bdev` as its
    /// namespace, listening on a free loopback port; returns the port.
    pub fn start_nvmf(&self, nqn: &str, bdev: &str) -> u16 {
        self.start_nvmf_with(nqn, bdev, json!({}))
    }

    /// The same, with more parameters of `nvmf_create_subsystem` (`subsystem`, an object).
    pub fn start_nvmf_with(&self, nqn: &str, bdev: &str, subsystem: Value) -> u16 {
        self.rpc_ok("nvmf_create_transport", json!({"trtype": "TCP"}));
        let mut params = json!({"nqn": nqn, "allow_any_host": true});
        params
            .as_object_mut()
            .expect("an object")
            .extend(subsystem.as_object().expect("subsystem parameters").clone());
        self.rpc_ok("nvmf_create_subsystem", params);
        self.rpc_ok(
            "nvmf_subsystem_add_ns",
            json!({"nqn": nqn, "namespace": {"bdev_name": bdev}}),
        );
        self.rpc_ok(
            "nvmf_subsystem_add_listener",
            json!({"nqn": nqn, "listen_address": {"trtype": "TCP", "adrfam": "IPv4",
                "traddr": "127.0.0.1", "trsvcid": "0"}}),
        );
        let subsystems = self.rpc_ok("nvmf_get_subsystems", json!({"nqn": nqn}));
        let port = subsystems[0]["listen_addresses"][0]["trsvcid"]
            .as_str()
            .and_then(|port| port.parse().ok());
        port.unwrap_or_else(|| panic!("no listener port in {subsystems}"))
    }

    /// Kills it with SIGKILL (a crash) and reaps it.
    pub fn kill(&mut self) {
        self.child.kill().expect("kill -9 the target");
        self.child.wait().expect("the killed target");
    }

    /// SIGTERM, then waits (30 s at most) for a clean exit.
    pub fn stop(mut self) {
        let log = &self.log;
        terminate(&mut self.child, "target", || {
            std::fs::read_to_string(log).unwrap_or_default()
        });
    }
}

/// Stops `child` (`name`) in order: SIGTERM, then waits 30 s at most; it must exit
/// cleanly (its `log` is shown if not).
fn terminate(child: &mut std::process::Child, name: &str, log: impl Fn() -> String) {
    run_ok(Command::new("kill").args(["-TERM", &child.id().to_string()]));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if started.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("{name} still running 30 s after SIGTERM: {}", log());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{name} exited with {status}: {}", log());
}

impl Drop for TargetProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One JSON-RPC request on a fresh connection; returns the whole response.
pub fn rpc_call(socket: &Path, method: &str, params: Value) -> Value {
    let mut stream = UnixStream::connect(socket).expect("connect rpc socket");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let request = json!({"jsonrpc": "2.0", "id": 7, "method": method, "params": params});
    stream
        .write_all(request.to_string().as_bytes())
        .expect("send");
    read_responses(&mut stream, 1).remove(0)
}

/// Reads `count` JSON values from the stream.
pub fn read_responses(stream: &mut UnixStream, count: usize) -> Vec<Value> {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 65536];
    loop {
        let values: Vec<Value> = serde_json::Deserializer::from_slice(&buffer)
            .into_iter::<Value>()
            .map_while(Result::ok)
            .collect();
        if values.len() >= count {
            return values;
        }
        let read = stream.read(&mut chunk).expect("read response");
        assert!(
            read > 0,
            "connection closed after {} of {count} responses",
            values.len()
        );
        buffer.extend_from_slice(&chunk[..read]);
    }
}

/// A file of `len` bytes (sparse).
pub fn sparse_file(path: &Path, len: u64) {
    std::fs::File::create(path)
        .expect("create")
        .set_len(len)
        .expect("set_len");
}

/// sha256 of a file, by `sha256sum`.
pub fn sha256(path: &Path) -> String {
    let out = run_ok(Command::new("sha256sum").arg(path));
    out.split_whitespace().next().expect("digest").to_string()
}

/// Runs qemu-io commands on a raw NBD URI: whether it exited 0, and what it printed
/// (stdout, then stderr).
pub fn qemu_io(uri: &str, readonly: bool, commands: &[&str]) -> (bool, String) {
    let mut command = Command::new("qemu-io");
    command.args(["-f", "raw"]);
    if readonly {
        command.arg("-r");
    }
    command.arg(uri);
    for each in commands {
        command.args(["-c", each]);
    }
    let out = run(&mut command);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Runs qemu-io commands on a raw NBD URI; fails if qemu-io fails or reports a pattern
/// mismatch (qemu-io exits 0 after "Pattern verification failed", so the output is read).
pub fn qemu_io_ok(uri: &str, readonly: bool, commands: &[&str]) -> String {
    let (success, text) = qemu_io(uri, readonly, commands);
    assert!(success, "qemu-io failed: {text}");
    assert!(
        !text.contains("verification failed") && !text.contains("failed:"),
        "qemu-io: {text}"
    );
    text
}

/// A free TCP port on loopback (bound, then released), for a server started later. Taken
/// below Linux's ephemeral range (`ip_local_port_range`, 32768 and up by default): a port
/// the kernel hands out for `bind(0)` may meanwhile become the local port of some test's
/// outgoing connection, and the server then fails with "address in use". Never the same
/// port twice in one test process. Where the ephemeral range leaves too little room below
/// it, any port the kernel gives.
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    const FIRST: u16 = 10_000;
    let ephemeral_first = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    let mut given = GIVEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if ephemeral_first > FIRST + 1_000 {
        let count = u64::from(ephemeral_first - FIRST);
        for _ in 0..1000 {
            // A new RandomState is seeded afresh: a random number without a crate.
            let random = std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish();
            let port = FIRST + (random % count) as u16;
            if !given.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                given.push(port);
                return port;
            }
        }
    }
    let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("free port");
    let port = probe.local_addr().expect("addr").port();
    given.push(port);
    port
}

/// A cluster of processes: one `basalt mon` and `basalt osd`s, each with its data and log in
/// a directory; every process is killed when dropped.
pub struct ClusterProcesses {
    pub dir: PathBuf,
    /// Every monitor's address, comma-separated (as `--mon` takes them).
    pub mon_address: String,
    mon_addresses: Vec<String>,
    mons: Vec<Option<Child>>,
    /// Each OSD process (by the test's numbering) and the OSD id it booted as.
    osds: Vec<(Option<Child>, Option<u32>)>,
    osd_extra: Vec<Vec<String>>,
    osd_netns: Vec<Option<String>>,
}

impl ClusterProcesses {
    /// Starts a monitor and `osds` OSDs with 256 MiB devices, and waits until all are up.
    pub fn start(dir: &Path, osds: usize) -> Self {
        Self::start_with_mons(dir, osds, 1)
    }

    /// Three OSDs and a 3-replica pool `rbd` of 16 PGs holding the image `rbd/vol` of
    /// `size` bytes (of `object_size` bytes objects, or the default), once every PG is
    /// clean.
    pub fn start_with_image(dir: &Path, size: u64, object_size: Option<u64>) -> Self {
        let cluster = Self::start(dir, 3);
        cluster.cli_ok(&["pool", "create", "rbd", "--pg-count", "16", "--size", "3"]);
        let size = size.to_string();
        let mut create = vec!["image", "create", "rbd/vol", "--size", &size];
        let object_size = object_size.map(|bytes| bytes.to_string());
        if let Some(bytes) = &object_size {
            create.extend(["--object-size", bytes]);
        }
        cluster.cli_ok(&create);
        cluster.wait_clean(Duration::from_secs(60));
        cluster
    }

    /// The same with `mons` monitors.
    pub fn start_with_mons(dir: &Path, osds: usize, mons: usize) -> Self {
        let mon_addresses: Vec<String> = (0..mons)
            .map(|_| format!("127.0.0.1:{}", free_port()))
            .collect();
        Self::start_custom(dir, mon_addresses, vec![(None, Vec::new()); osds])
    }

    /// Monitors at these addresses, and one OSD per entry of `osds`: the network namespace
    /// it runs in (if any) and its extra arguments.
    pub fn start_custom(
        dir: &Path,
        mon_addresses: Vec<String>,
        osds: Vec<(Option<String>, Vec<String>)>,
    ) -> Self {
        let count = osds.len();
        let (osd_netns, osd_extra) = osds.into_iter().unzip();
        let mut cluster = Self {
            dir: dir.to_path_buf(),
            mon_address: mon_addresses.join(","),
            mons: mon_addresses.iter().map(|_| None).collect(),
            mon_addresses,
            osds: (0..count).map(|_| (None, None)).collect(),
            osd_extra,
            osd_netns,
        };
        cluster.start_mon();
        for n in 0..count {
            cluster.start_osd(n);
        }
        cluster.wait_osds_up(count);
        cluster
    }

    fn log(&self, name: &str) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{name}.log")))
            .expect("log file")
    }

    pub fn log_text(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default()
    }

    /// Starts every monitor.
    pub fn start_mon(&mut self) {
        for n in 0..self.mons.len() {
            self.start_mon_n(n);
        }
    }

    /// Starts monitor `n`.
    pub fn start_mon_n(&mut self, n: usize) {
        let name = format!("mon.{n}");
        let child = basalt()
            .args(["mon", "--grace", "3", "--listen", &self.mon_addresses[n]])
            .args(["--peers", &self.mon_address, "--data-dir"])
            .arg(self.dir.join(&name))
            .stdout(self.log(&name))
            .stderr(self.log(&name))
            .spawn()
            .expect("spawn basalt mon");
        self.mons[n] = Some(child);
    }

    /// The monitors' addresses.
    pub fn mon_addresses(&self) -> &[String] {
        &self.mon_addresses
    }

    /// Sends monitor `n` a signal (`STOP`, `CONT`, ...).
    pub fn signal_mon_n(&self, n: usize, signal: &str) {
        let child = self.mons[n].as_ref().expect("the monitor runs");
        run_ok(Command::new("kill").args([format!("-{signal}"), child.id().to_string()]));
    }

    /// Kills monitor `n` (SIGKILL).
    pub fn kill_mon_n(&mut self, n: usize) {
        if let Some(mut child) = self.mons[n].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Extra arguments for OSD `n` (from its next start).
    pub fn set_osd_args(&mut self, n: usize, args: &[&str]) {
        self.osd_extra[n] = args.iter().map(ToString::to_string).collect();
    }

    pub fn start_osd(&mut self, n: usize) {
        let name = format!("osd.{n}");
        let before = self.log_text(&name).len();
        // An OSD in a network namespace runs under `ip netns exec`, which execs it.
        let mut command = match &self.osd_netns[n] {
            Some(netns) => {
                let mut command = Command::new("ip");
                command
                    .args(["netns", "exec", netns])
                    .arg(env!("CARGO_BIN_EXE_basalt"));
                command
            }
            None => basalt(),
        };
        // Sparse devices: the suite's OSDs take disk space only as their logs reach it.
        command.args(["osd", "--sparse-device"]);
        if !self.osd_extra[n].iter().any(|arg| arg == "--device-size") {
            command.args(["--device-size", "256MiB"]);
        }
        // An OSD given monitors of its own (`--mon`) hears of maps from those alone.
        if !self.osd_extra[n].iter().any(|arg| arg == "--mon") {
            command.args(["--mon", &self.mon_address]);
        }
        let child = command
            .arg("--data-dir")
            .arg(self.dir.join(&name))
            .args(&self.osd_extra[n])
            .stdout(self.log(&name))
            .stderr(self.log(&name))
            .spawn()
            .expect("spawn basalt osd");
        self.osds[n].0 = Some(child);
        // The id it boots as: from the line it prints once booted.
        let mut id = None;
        wait_for(&format!("{name} to boot"), Duration::from_secs(60), || {
            let text = self.log_text(&name);
            id = text[before.min(text.len())..].lines().find_map(|line| {
                line.strip_prefix("basalt osd: osd.")?
                    .split(' ')
                    .next()?
                    .parse()
                    .ok()
            });
            if let Some((Some(child), _)) = self.osds.get_mut(n)
                && let Ok(Some(status)) = child.try_wait()
            {
                panic!("{name} exited with {status}: {}", self.log_text(&name));
            }
            id.is_some()
        });
        self.osds[n].1 = id;
    }

    /// The OSD id process `n` booted as.
    pub fn osd_id(&self, n: usize) -> u32 {
        self.osds[n].1.expect("osd booted")
    }

    /// The process number of OSD `id`.
    pub fn osd_process(&self, id: u32) -> usize {
        self.osds
            .iter()
            .position(|(_, booted)| *booted == Some(id))
            .expect("an osd with that id")
    }

    /// Stops OSD process `n` in order (SIGTERM); it must exit cleanly within 30 s.
    pub fn stop_osd(&mut self, n: usize) {
        let name = format!("osd.{n}");
        if let Some(mut child) = self.osds[n].0.take() {
            terminate(&mut child, &name, || self.log_text(&name));
        }
    }

    /// Sends OSD process `n` a signal (`STOP`, `CONT`, ...).
    pub fn signal_osd(&self, n: usize, signal: &str) {
        let child = self.osds[n].0.as_ref().expect("the osd runs");
        run_ok(Command::new("kill").args([format!("-{signal}"), child.id().to_string()]));
    }

    pub fn kill_osd(&mut self, n: usize) {
        if let Some(mut child) = self.osds[n].0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills every OSD (SIGKILL), starts them again and waits until they are up and
    /// every PG is clean.
    pub fn crash_every_osd(&mut self) {
        let count = self.osds.len();
        for n in 0..count {
            self.kill_osd(n);
        }
        for n in 0..count {
            self.start_osd(n);
        }
        self.wait_osds_up(count);
        self.wait_clean(Duration::from_secs(60));
    }

    /// Kills every monitor (SIGKILL).
    pub fn kill_mon(&mut self) {
        for n in 0..self.mons.len() {
            self.kill_mon_n(n);
        }
    }

    /// Runs the CLI against this cluster.
    pub fn cli(&self, args: &[&str]) -> Output {
        run(basalt().args(args).args(["--mon", &self.mon_address]))
    }

    /// Runs the CLI; it must succeed. Returns stdout.
    pub fn cli_ok(&self, args: &[&str]) -> String {
        let output = self.cli(args);
        assert!(output.status.success(), "basalt {args:?} failed");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Parses a `--json` command's output.
    pub fn cli_json(&self, args: &[&str]) -> Value {
        let mut args = args.to_vec();
        args.push("--json");
        serde_json::from_str(&self.cli_ok(&args)).expect("json output")
    }

    /// `basalt status`'s health: its name (HEALTH_OK, ...) and its checks as JSON text;
    /// ("unreachable", the error) if the CLI fails (a monitor starting, say).
    pub fn health(&self) -> (String, String) {
        let output = self.cli(&["status", "--json"]);
        if !output.status.success() {
            let error = String::from_utf8_lossy(&output.stderr).to_string();
            return ("unreachable".to_string(), error);
        }
        let status: Value = serde_json::from_slice(&output.stdout).expect("json output");
        let name = status["health"]["status"].as_str().unwrap_or_default();
        (name.to_string(), status["health"]["checks"].to_string())
    }

    pub fn wait_osds_up(&self, count: usize) {
        wait_for("the osds to be up", Duration::from_secs(60), || {
            let output = basalt()
                .args(["osd", "ls", "--json", "--mon", &self.mon_address])
                .output()
                .expect("basalt osd ls");
            serde_json::from_slice::<Value>(&output.stdout).is_ok_and(|osds| {
                osds.as_array().is_some_and(|osds| {
                    osds.iter().filter(|osd| osd["up"] == true).count() >= count
                })
            })
        });
    }

    /// Waits until every PG has a leader and all its members up.
    pub fn wait_clean(&self, timeout: Duration) {
        wait_for("every pg active+clean", timeout, || {
            let output = basalt()
                .args(["pg", "ls", "--json", "--mon", &self.mon_address])
                .output()
                .expect("basalt pg ls");
            serde_json::from_slice::<Value>(&output.stdout).is_ok_and(|pgs| {
                pgs.as_array().is_some_and(|pgs| {
                    !pgs.is_empty() && pgs.iter().all(|pg| pg["state"] == "active+clean")
                })
            })
        });
    }

    /// A guest's request about OSDs: "kill" kills the OSD that leads the most PGs (answered
    /// "killed"; `killed` keeps its process), "restart" starts it again and waits until
    /// its replicas equal the others' ("caught-up").
    pub fn guest_request(&mut self, request: &str, killed: &mut Option<usize>) -> &'static str {
        match request {
            "kill" => {
                let victim = self.busiest_leader();
                let process = self.osd_process(victim);
                eprintln!("killing osd.{victim} (process {process})");
                self.kill_osd(process);
                *killed = Some(process);
                "killed"
            }
            "restart" => {
                let process = killed.take().expect("an OSD was killed first");
                self.start_osd(process);
                self.wait_osds_up(self.osds.len());
                self.wait_clean(Duration::from_secs(60));
                self.wait_replicas_equal(Duration::from_secs(60));
                "caught-up"
            }
            other => panic!("unknown request from the guest: {other:?}"),
        }
    }

    /// The OSD id that leads the most PGs.
    pub fn busiest_leader(&self) -> u32 {
        let pgs = self.cli_json(&["pg", "ls"]);
        let mut counts = std::collections::BTreeMap::<u64, usize>::new();
        for pg in pgs.as_array().expect("pg list") {
            if let Some(leader) = pg["leader"].as_u64() {
                *counts.entry(leader).or_default() += 1;
            }
        }
        let (leader, _) = counts
            .into_iter()
            .max_by_key(|(_, n)| *n)
            .expect("a leader");
        leader as u32
    }

    /// Every replica's raft term and leader, one line per replica of each PG (`basalt pg
    /// query`).
    pub fn replica_terms(&self) -> Vec<String> {
        let mut lines = Vec::new();
        for pg in self.cli_json(&["pg", "ls"]).as_array().expect("pg list") {
            let pg = pg["pg"].as_str().expect("pg id");
            for replica in self
                .cli_json(&["pg", "query", pg])
                .as_array()
                .expect("replicas")
            {
                lines.push(format!(
                    "pg {pg} osd {}: term {}, leader {}",
                    replica["osd"], replica["term"], replica["leader"]
                ));
            }
        }
        lines
    }

    /// Waits until the replicas of every PG have applied the same entries and hold the same
    /// data (`basalt pg query`).
    pub fn wait_replicas_equal(&self, timeout: Duration) {
        let pgs: Vec<(String, Vec<u64>)> = self
            .cli_json(&["pg", "ls"])
            .as_array()
            .expect("pg list")
            .iter()
            .map(|pg| {
                let mut members: Vec<u64> = pg["members"]
                    .as_array()
                    .expect("members")
                    .iter()
                    .filter_map(Value::as_u64)
                    .collect();
                members.sort_unstable();
                (pg["pg"].as_str().expect("pg id").to_string(), members)
            })
            .collect();
        // Each replica's raft voters are the map's members, and nothing is left over from a
        // membership change.
        let settled = |replica: &Value, members: &[u64]| {
            let mut voters: Vec<u64> = replica["voters"]
                .as_array()
                .map(|v| v.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default();
            voters.sort_unstable();
            voters == members
                && replica["learners"].as_array().is_some_and(Vec::is_empty)
                && replica["voters_outgoing"]
                    .as_array()
                    .is_some_and(Vec::is_empty)
        };
        for (pg, members) in pgs {
            let start = Instant::now();
            loop {
                let output = basalt()
                    .args(["pg", "query", &pg, "--json", "--mon", &self.mon_address])
                    .output()
                    .expect("basalt pg query");
                let replicas: Value = serde_json::from_slice(&output.stdout).unwrap_or(Value::Null);
                let equal = replicas.as_array().is_some_and(|replicas| {
                    replicas.len() >= 2
                        && replicas.iter().all(|r| {
                            r["error"].is_null()
                                && r["hosted"] == true
                                && settled(r, &members)
                                && r["applied"] == replicas[0]["applied"]
                                && r["digest"] == replicas[0]["digest"]
                                && r["mapped_bytes"] == replicas[0]["mapped_bytes"]
                        })
                });
                if equal {
                    break;
                }
                assert!(
                    start.elapsed() < timeout,
                    "replicas of pg {pg} differ: {replicas:#}"
                );
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

impl Drop for ClusterProcesses {
    fn drop(&mut self) {
        for n in 0..self.osds.len() {
            self.kill_osd(n);
        }
        self.kill_mon();
    }
}

/// Runs fio with the nbd engine against `uri`; returns its JSON report. Fails the test if
/// fio fails.
pub fn fio(uri: &str, args: &[&str]) -> Value {
    require("fio");
    let output = run(Command::new("fio")
        .args([
            "--name=job",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--output-format=json",
            "--verify_state_save=0",
        ])
        .args(args));
    fio_report(&output)
}

/// fio's JSON report from its output; fails unless fio and every job succeeded.
fn fio_report(output: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "fio failed ({}): {stdout}",
        output.status
    );
    // fio may print notes before the JSON.
    let json = &stdout[stdout.find('{').expect("fio json")..];
    let report: Value = serde_json::from_str(json).expect("fio json report");
    for job in report["jobs"].as_array().expect("fio jobs") {
        assert_eq!(job["error"], 0, "fio reported an error: {json}");
    }
    report
}

/// A target exporting `pool/image` of the cluster over NBD; returns it and the URI.
pub fn export_image(
    dir: &std::path::Path,
    cluster: &ClusterProcesses,
    pool: &str,
    image: &str,
) -> (TargetProcess, String) {
    let target = TargetProcess::start(dir, &[]);
    target.rpc_ok(
        "bdev_basalt_create",
        json!({"name": "img", "pool": pool, "image": image, "mons": cluster.mon_addresses()}),
    );
    let port = target.start_nbd();
    target.rpc_ok(
        "nbd_server_add_export",
        json!({"bdev_name": "img", "name": "img"}),
    );
    (target, format!("nbd://127.0.0.1:{port}/img"))
}

/// A pool of one PG with `size` replicas and a 16 MiB image `POOL/vol` in it, exported by
/// a target once the PG is clean, its first MiB written with 0x5a; the target and the
/// export's URI.
pub fn one_pg_image(
    dir: &std::path::Path,
    cluster: &ClusterProcesses,
    pool: &str,
    size: u32,
) -> (TargetProcess, String) {
    let size = size.to_string();
    cluster.cli_ok(&["pool", "create", pool, "--pg-count", "1", "--size", &size]);
    cluster.cli_ok(&["image", "create", &format!("{pool}/vol"), "--size", "16MiB"]);
    cluster.wait_clean(Duration::from_secs(60));
    let (target, uri) = export_image(dir, cluster, pool, "vol");
    qemu_io_ok(&uri, false, &["write -P 0x5a 0 1M"]);
    (target, uri)
}

/// fio's arguments for a crc32c-verified random write of `size` (each block written once,
/// so a later `--verify_only` run with the same arguments checks every block).
pub fn verified_write(size: &str) -> Vec<String> {
    [
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=8",
        &format!("--size={size}"),
        "--verify=crc32c",
        "--randseed=1234",
        "--verify_fatal=1",
    ]
    .iter()
    .map(ToString::to_string)
    .collect()
}

pub fn args(list: &[String]) -> Vec<&str> {
    list.iter().map(String::as_str).collect()
}

pub fn http_get(address: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).expect("connect to metrics");
    write!(stream, "GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").expect("request");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("response");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response
}

pub fn metric(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {metrics}"))
}

/// fio's arguments for a random write of every 4 KiB block of the first `size` of an
/// image, each block filled with `round`'s pattern and its own offset (so that a block
/// left from another round, from another place or torn fails the check, which crc32c
/// alone would not catch), read back and checked at the end.
pub fn pattern_write(round: u32, size: &str) -> Vec<String> {
    let mut args = pattern_args(round);
    args.push(format!("--size={size}"));
    args
}

/// [`pattern_write`]'s arguments but the size.
fn pattern_args(round: u32) -> Vec<String> {
    vec![
        "--rw=randwrite".to_string(),
        "--bs=4k".into(),
        "--iodepth=8".into(),
        "--verify=pattern".into(),
        format!("--verify_pattern=0x{:08x}%o", round + 1),
        "--verify_fatal=1".into(),
    ]
}

/// The number in environment variable `name`, or `default`.
pub fn env_number<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// A small pseudo-random sequence (splitmix64): a test's random choices from a seed.
pub struct SplitMix(u64);

impl SplitMix {
    /// Seeded from environment variable `name` if set, else from the clock; prints the
    /// seed, so that a run's choices can be replayed.
    pub fn from_env(name: &str) -> Self {
        let seed = std::env::var(name)
            .ok()
            .and_then(|value| value.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |now| now.as_nanos() as u64)
            });
        eprintln!("{name}={seed}");
        Self(seed)
    }

    /// A number below `bound`.
    pub fn below(&mut self, bound: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % bound
    }
}

/// What a [`PatternRound`] covers: the first 24 MiB of an image.
const ROUND_BYTES: u64 = 24 << 20;

/// A range a [`PatternRound`] clears while fio writes the rest, and how: an NBD trim
/// (`discard`), a write of zeroes that must allocate (`write -z`), or one that may unmap
/// (`write -z -u`), all as qemu-io sends them.
#[derive(Clone, Copy, Debug)]
pub struct Cleared {
    pub offset: u64,
    pub len: u64,
    pub how: &'static str,
}

/// One to four ranges of the round's 24 MiB, merged where they touch: a block, 64 KiB,
/// 1 MiB or up to 6 MiB (so some cross the image's 4 MiB objects or cover one whole).
fn choose_cleared(random: &mut SplitMix) -> Vec<Cleared> {
    let mut ranges: Vec<(u64, u64)> = (0..1 + random.below(4))
        .map(|_| {
            let len = match random.below(4) {
                0 => 4096,
                1 => 64 << 10,
                2 => 1 << 20,
                _ => (1 + random.below(1536)) * 4096,
            };
            let offset = random.below((ROUND_BYTES - len) / 4096 + 1) * 4096;
            (offset, len)
        })
        .collect();
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (offset, len) in ranges {
        match merged.last_mut() {
            Some(last) if offset <= last.0 + last.1 => {
                last.1 = last.1.max(offset + len - last.0);
            }
            _ => merged.push((offset, len)),
        }
    }
    const HOW: [&str; 3] = ["discard", "write -z", "write -z -u"];
    merged
        .into_iter()
        .map(|(offset, len)| Cleared {
            offset,
            len,
            how: HOW[random.below(3) as usize],
        })
        .collect()
}

/// The parts of the round's 24 MiB outside `cleared` (which is sorted and disjoint).
fn spans_between(cleared: &[Cleared]) -> Vec<(u64, u64)> {
    let mut spans = Vec::new();
    let mut at = 0;
    for range in cleared {
        if range.offset > at {
            spans.push((at, range.offset - at));
        }
        at = range.offset + range.len;
    }
    if at < ROUND_BYTES {
        spans.push((at, ROUND_BYTES - at));
    }
    spans
}

/// fio over an NBD URI with one job per `(offset, len)` span, `global` applying to all
/// (`rate_iops`, if not 0, shared among them by size); returns its report ([`fio_report`]).
fn fio_spans(uri: &str, global: &[String], spans: &[(u64, u64)], rate_iops: u64) -> Value {
    let total: u64 = spans.iter().map(|(_, len)| len).sum();
    let mut command = Command::new("fio");
    command
        .args([
            "--ioengine=nbd",
            "--output-format=json",
            "--verify_state_save=0",
        ])
        .arg(format!("--uri={uri}"))
        .args(global);
    for (n, (offset, len)) in spans.iter().enumerate() {
        command.args([
            format!("--name=span{n}"),
            format!("--offset={offset}"),
            format!("--size={len}"),
        ]);
        if rate_iops > 0 {
            command.arg(format!("--rate_iops={}", (rate_iops * len / total).max(1)));
        }
    }
    fio_report(&run(&mut command))
}

/// A round of [`pattern_write`] over the first 24 MiB of an image at 2,000 writes a second
/// (about 3 s of writes, then as long to read them back), fio running on a thread of its
/// own while the test crashes things; meanwhile qemu-io clears a few ranges that fio
/// leaves alone (they hold an earlier round's data, or zeroes), one every second or so.
pub struct PatternRound {
    round: u32,
    uri: String,
    started: Instant,
    spans: Vec<(u64, u64)>,
    cleared: Vec<Cleared>,
    fio: std::thread::JoinHandle<Value>,
    clear: std::thread::JoinHandle<String>,
}

impl PatternRound {
    pub fn start(uri: &str, round: u32, random: &mut SplitMix) -> Self {
        let cleared = choose_cleared(random);
        let spans = spans_between(&cleared);
        let mut commands = Vec::new();
        for range in &cleared {
            commands.push(format!("sleep {}", random.below(1200)));
            commands.push(format!("{} {} {}", range.how, range.offset, range.len));
        }
        let (fio_uri, clear_uri, fio_jobs) = (uri.to_string(), uri.to_string(), spans.clone());
        Self {
            round,
            uri: uri.to_string(),
            started: Instant::now(),
            cleared,
            fio: std::thread::spawn(move || {
                fio_spans(&fio_uri, &pattern_args(round), &fio_jobs, 2000)
            }),
            clear: std::thread::spawn(move || qemu_io_ok(&clear_uri, false, &args(&commands))),
            spans,
        }
    }

    /// Prints what was done to the cluster during the round, and when.
    pub fn report(&self, what: &str) {
        eprintln!(
            "round {}: {what} ({:?} in; fio still running: {}; cleared: {:?})",
            self.round,
            self.started.elapsed(),
            !self.fio.is_finished(),
            self.cleared
        );
    }

    /// Waits for fio to have written and read back every block and for qemu-io to have
    /// cleared its ranges, then for `osds` OSDs up, every PG active+clean and its replicas
    /// equal (each within `timeout`), and reads the round's data back afresh: fio's blocks
    /// with their pattern, the cleared ranges as zeroes.
    pub fn finish(self, cluster: &ClusterProcesses, osds: usize, timeout: Duration) {
        let round = self.round;
        let report = self.fio.join().expect("fio wrote and verified the round");
        let written: u64 = report["jobs"]
            .as_array()
            .expect("fio jobs")
            .iter()
            .map(|job| job["write"]["io_bytes"].as_u64().unwrap_or(0))
            .sum();
        let spans: u64 = self.spans.iter().map(|(_, len)| len).sum();
        assert_eq!(written, spans, "round {round}: every block was written");
        self.clear
            .join()
            .expect("qemu-io cleared the round's ranges");
        cluster.wait_osds_up(osds);
        cluster.wait_clean(timeout);
        cluster.wait_replicas_equal(timeout);
        let mut verify = pattern_args(round);
        verify.push("--verify_only".into());
        fio_spans(&self.uri, &verify, &self.spans, 0);
        let reads: Vec<String> = self
            .cleared
            .iter()
            .map(|range| format!("read -P 0 {} {}", range.offset, range.len))
            .collect();
        qemu_io_ok(&self.uri, true, &args(&reads));
    }
}

/// Our NVMe/TCP initiator connected to subsystem `nqn` on loopback `port`, and the
/// runtime to drive it on.
pub fn nvmf_host(
    port: u16,
    nqn: &str,
    options: basalt_nvmf::host::HostOptions,
) -> (tokio::runtime::Runtime, basalt_nvmf::host::Host) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let host = runtime
        .block_on(basalt_nvmf::host::Host::connect(address, nqn, options))
        .expect("connect");
    (runtime, host)
}

/// scripts/guest/run.sh: boots the test guest and runs a script in it.
pub const GUEST_RUN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/guest/run.sh");

/// scripts/guest/run.sh with `tests/guest/SCRIPT`, to which arguments are added.
pub fn guest_command(script: &str) -> Command {
    let mut command = Command::new(GUEST_RUN);
    command
        .arg(format!(
            "{}/tests/guest/{script}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .env("BASALT_GUEST_TIMEOUT", "600");
    command
}

/// Runs `tests/guest/SCRIPT` with `args` in the guest and returns its console; fails unless
/// the script exits 0 and prints `done`, showing the console and `log()` (the target's).
pub fn run_guest(script: &str, args: &[&str], done: &str, log: impl Fn() -> String) -> String {
    let output = guest_command(script)
        .args(args)
        .output()
        .expect("run the guest");
    let console = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    check_guest(output.status, &console, done, log);
    console
}

/// Fails unless the guest exited with `status` 0 and its `console` shows `done`.
pub fn check_guest(
    status: std::process::ExitStatus,
    console: &str,
    done: &str,
    log: impl Fn() -> String,
) {
    assert!(
        status.success() && console.contains(done),
        "guest failed ({status}):\n{console}\ntarget log:\n{}",
        log()
    );
    if std::env::var_os("BASALT_SHOW_GUEST").is_some() {
        eprintln!("{console}");
    }
}

/// Runs the guest of `command(port)` ([`guest_command`] and its arguments), its console to
/// `console`, serving the requests its script sends on a connection to `port` on the
/// host's loopback: one line each, answered with the line `serve` returns. Returns the
/// guest's exit status and console once it ends.
pub fn run_guest_serving(
    command: impl FnOnce(u16) -> Command,
    console: &Path,
    mut serve: impl FnMut(&str) -> &'static str,
) -> (std::process::ExitStatus, String) {
    use std::io::{BufRead, BufReader};
    /// The guest's run.sh, sent SIGTERM if the test fails while it runs (its trap stops
    /// QEMU; SIGKILL would leave QEMU running until its timeout, into the next test).
    struct Guest(std::process::Child);
    impl Drop for Guest {
        fn drop(&mut self) {
            if let Ok(None) = self.0.try_wait() {
                let _ = Command::new("kill")
                    .args(["-TERM", &self.0.id().to_string()])
                    .status();
                let _ = self.0.wait();
            }
        }
    }
    let trigger = std::net::TcpListener::bind("127.0.0.1:0").expect("trigger listener");
    let port = trigger.local_addr().expect("address").port();
    let file = std::fs::File::create(console).expect("console file");
    let mut guest = Guest(
        command(port)
            .stdout(file.try_clone().expect("console file"))
            .stderr(file)
            .spawn()
            .expect("run the guest"),
    );
    trigger.set_nonblocking(true).expect("nonblocking");
    let mut requests = None;
    let mut line = String::new();
    let status = loop {
        if let Some(status) = guest.0.try_wait().expect("the guest's status") {
            break status;
        }
        let Some((reader, stream)) = requests.as_mut() else {
            match trigger.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false).expect("blocking");
                    stream
                        .set_read_timeout(Some(Duration::from_millis(100)))
                        .expect("read timeout");
                    let reader = BufReader::new(stream.try_clone().expect("clone"));
                    requests = Some((reader, stream));
                }
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(error) => panic!("accept: {error}"),
            }
            continue;
        };
        // A connection that ends or fails is dropped: the guest's exit status and console
        // then tell what happened.
        match reader.read_line(&mut line) {
            Ok(0) => {
                requests = None;
                line.clear();
            }
            Ok(_) => {
                let answer = serve(line.trim());
                let stream: &mut std::net::TcpStream = stream;
                if stream.write_all(format!("{answer}\n").as_bytes()).is_err() {
                    requests = None;
                }
                line.clear();
            }
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => {
                requests = None;
                line.clear();
            }
        }
    };
    (status, std::fs::read_to_string(console).unwrap_or_default())
}
