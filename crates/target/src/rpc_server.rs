//! JSON-RPC 2.0 on a Unix socket, framed as SPDK's `rpc.py` frames it: JSON values back to
//! back, each request answered by one response object.
//!
//! The socket is created with mode 0600: whoever can write to it controls the target's
//! devices. Requests on one connection are answered in order.

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use basalt_common::RpcError;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

use crate::Target;

/// The largest request we buffer: generous for any parameters, small enough to be safe.
pub const REQUEST_SIZE_MAX: usize = 4 << 20;

/// A listening RPC socket; the socket file is removed when this is dropped.
pub struct RpcServer {
    path: PathBuf,
    listener: UnixListener,
}

impl RpcServer {
    /// Binds `path` (replacing a stale socket file, refusing to replace anything else).
    pub fn bind(path: &Path) -> io::Result<Self> {
        match std::fs::symlink_metadata(path) {
            Ok(metadata) if std::os::unix::fs::FileTypeExt::is_socket(&metadata.file_type()) => {
                if std::os::unix::net::UnixStream::connect(path).is_ok() {
                    return Err(io::Error::new(
                        io::ErrorKind::AddrInUse,
                        format!("{}: another process is serving this socket", path.display()),
                    ));
                }
                std::fs::remove_file(path)?;
            }
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!("{}: exists and is not a socket", path.display()),
                ));
            }
            Err(_) => {}
        }
        let listener = UnixListener::bind(path)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        Ok(Self {
            path: path.to_path_buf(),
            listener,
        })
    }

    /// Serves connections until the task is dropped.
    pub async fn run(&self, target: Arc<Target>) -> io::Result<()> {
        loop {
            let (stream, _) = self.listener.accept().await?;
            let target = target.clone();
            tokio::spawn(async move {
                if let Err(error) = serve(stream, &target).await {
                    tracing::debug!(%error, "rpc connection ended with an error");
                }
            });
        }
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

async fn serve(mut stream: UnixStream, target: &Target) -> io::Result<()> {
    let mut buffer: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        let read = stream.read(&mut chunk).await?;
        if read == 0 {
            return Ok(());
        }
        buffer.extend_from_slice(&chunk[..read]);
        let mut consumed = 0;
        let mut values = serde_json::Deserializer::from_slice(&buffer).into_iter::<Value>();
        loop {
            match values.next() {
                Some(Ok(request)) => {
                    consumed = values.byte_offset();
                    let response = answer(target, request).await;
                    let mut bytes = serde_json::to_vec(&response).expect("responses serialise");
                    bytes.push(b'\n');
                    stream.write_all(&bytes).await?;
                }
                Some(Err(error)) if error.is_eof() => break,
                Some(Err(error)) => {
                    // The stream cannot be resynchronised after bad JSON: answer and close.
                    let response = error_response(
                        Value::Null,
                        &RpcError::new(RpcError::PARSE_ERROR, format!("parse error: {error}")),
                    );
                    stream
                        .write_all(&serde_json::to_vec(&response).expect("serialises"))
                        .await?;
                    return Ok(());
                }
                None => break,
            }
        }
        buffer.drain(..consumed);
        if buffer.len() > REQUEST_SIZE_MAX {
            let message = format!("request larger than {REQUEST_SIZE_MAX} bytes");
            let response = error_response(
                Value::Null,
                &RpcError::new(RpcError::INVALID_REQUEST, message),
            );
            stream
                .write_all(&serde_json::to_vec(&response).expect("serialises"))
                .await?;
            return Ok(());
        }
    }
}

/// Answers one decoded request object.
pub async fn answer(target: &Target, request: Value) -> Value {
    let id = request.get("id").cloned().unwrap_or(Value::Null);
    let Some(method) = request.get("method").and_then(Value::as_str) else {
        let error = RpcError::new(
            RpcError::INVALID_REQUEST,
            "request has no \"method\" string",
        );
        return error_response(id, &error);
    };
    if request.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        let error = RpcError::new(
            RpcError::INVALID_REQUEST,
            "request must have \"jsonrpc\": \"2.0\"",
        );
        return error_response(id, &error);
    }
    let params = request.get("params").cloned().unwrap_or(Value::Null);
    match target.call(method, params).await {
        Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
        Err(error) => error_response(id, &error),
    }
}

fn error_response(id: Value, error: &RpcError) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": error})
}
