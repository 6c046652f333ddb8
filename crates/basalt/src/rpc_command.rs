//! `basalt rpc`: one JSON-RPC call to a target, like SPDK's `rpc.py`.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use basalt_target::DEFAULT_RPC_SOCKET;
use serde_json::{Value, json};

/// Options of `basalt rpc`.
#[derive(clap::Args)]
pub struct RpcArgs {
    /// The target's JSON-RPC socket.
    #[arg(short = 's', long, default_value = DEFAULT_RPC_SOCKET)]
    pub rpc_socket: PathBuf,
    /// Seconds to wait for the answer.
    #[arg(short = 't', long, default_value_t = 60)]
    pub timeout: u64,
    /// Method name, e.g. bdev_malloc_create.
    pub method: String,
    /// Parameters as a JSON object, e.g. '{"num_blocks": 2048, "block_size": 512}'.
    pub params: Option<String>,
}

pub fn run(args: RpcArgs) -> anyhow::Result<ExitCode> {
    let params: Value = match &args.params {
        Some(text) => serde_json::from_str(text)
            .with_context(|| format!("parameters {text:?} are not JSON"))?,
        None => Value::Null,
    };
    let response = call(
        &args.rpc_socket,
        &args.method,
        params,
        Duration::from_secs(args.timeout),
    )?;
    if let Some(error) = response.get("error") {
        let message = error
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("unknown error");
        let code = error.get("code").and_then(Value::as_i64).unwrap_or(0);
        eprintln!("basalt rpc: {}: {message} (code {code})", args.method);
        return Ok(ExitCode::FAILURE);
    }
    let result = response.get("result").cloned().unwrap_or(Value::Null);
    println!("{}", serde_json::to_string_pretty(&result)?);
    Ok(ExitCode::SUCCESS)
}

/// Sends one request and reads its response.
pub fn call(
    socket: &std::path::Path,
    method: &str,
    params: Value,
    timeout: Duration,
) -> anyhow::Result<Value> {
    let mut stream = UnixStream::connect(socket).with_context(|| {
        format!(
            "connecting to the target at {} (is `basalt target` running?)",
            socket.display()
        )
    })?;
    stream.set_read_timeout(Some(timeout))?;
    let mut request = json!({"jsonrpc": "2.0", "method": method, "id": 1});
    if !params.is_null() {
        request["params"] = params;
    }
    stream.write_all(&serde_json::to_vec(&request)?)?;
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 64 << 10];
    loop {
        let read = stream.read(&mut chunk).context("reading the answer")?;
        if read == 0 {
            bail!("the target closed the connection without answering");
        }
        buffer.extend_from_slice(&chunk[..read]);
        match serde_json::from_slice::<Value>(&buffer) {
            Ok(value) => return Ok(value),
            Err(error) if error.is_eof() => continue,
            Err(error) => bail!("the target's answer is not JSON: {error}"),
        }
    }
}
