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
        let _ = std::fs::remove_dir_all(&self.path);
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
pub fn wait_for(what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
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

    /// SIGTERM, then waits for a clean exit.
    pub fn stop(mut self) {
        let pid = self.child.id().to_string();
        run_ok(Command::new("kill").args(["-TERM", &pid]));
        let status = self.child.wait().expect("wait");
        assert!(
            status.success(),
            "target exited with {status}: {}",
            self.log_text()
        );
    }
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

/// Runs qemu-io commands on a raw NBD URI; fails if qemu-io fails or reports a pattern
/// mismatch (qemu-io exits 0 after "Pattern verification failed", so the output is read).
pub fn qemu_io_ok(uri: &str, readonly: bool, commands: &[&str]) -> String {
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
    assert!(out.status.success(), "qemu-io failed: {text}");
    assert!(
        !text.contains("verification failed") && !text.contains("failed:"),
        "qemu-io: {text}"
    );
    text
}
