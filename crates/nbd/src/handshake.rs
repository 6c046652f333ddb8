//! Server side of fixed-newstyle negotiation ("option haggling").
//!
//! Any malformed input here ends only this connection: the caller drops it.

use std::io;
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::protocol::*;
use crate::server::{Export, Exports};

/// How negotiation ended.
pub enum Outcome {
    /// The client chose `export` and transmission begins.
    Transmission {
        /// The export.
        export: Arc<Export>,
        /// Structured replies were negotiated.
        structured: bool,
    },
    /// The client aborted or the negotiation failed politely.
    Closed,
}

/// Negotiates with one client.
pub async fn negotiate<R, W>(
    reader: &mut R,
    writer: &mut W,
    exports: &Exports,
) -> io::Result<Outcome>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut greeting = Vec::with_capacity(18);
    greeting.extend_from_slice(&INIT_MAGIC.to_be_bytes());
    greeting.extend_from_slice(&OPTION_MAGIC.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    writer.write_all(&greeting).await?;
    writer.flush().await?;

    let client_flags = reader.read_u32().await?;
    let known = CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES;
    if client_flags & !known != 0 {
        return Err(invalid(format!("unknown client flags {client_flags:#x}")));
    }
    let no_zeroes = client_flags & CLIENT_FLAG_NO_ZEROES != 0;
    let mut structured = false;

    loop {
        let magic = reader.read_u64().await?;
        if magic != OPTION_MAGIC {
            return Err(invalid(format!("bad option magic {magic:#x}")));
        }
        let option = reader.read_u32().await?;
        let len = reader.read_u32().await?;
        if len > OPTION_SIZE_MAX {
            // NBD_OPT_EXPORT_NAME gets no option reply: a name that long names no export,
            // which only closing the connection can say.
            if option == OPT_EXPORT_NAME {
                return Ok(Outcome::Closed);
            }
            // Too large to read; refusing and skipping it would mean reading it anyway.
            discard(reader, u64::from(len)).await?;
            reply(writer, option, REP_ERR_TOO_BIG, b"option data too large").await?;
            continue;
        }
        let mut data = vec![0u8; len as usize];
        reader.read_exact(&mut data).await?;
        match option {
            OPT_EXPORT_NAME => {
                let name = String::from_utf8_lossy(&data);
                // NBD: an unknown name after NBD_OPT_EXPORT_NAME can only be answered by
                // closing the connection.
                let Some(export) = exports.find(&name) else {
                    return Ok(Outcome::Closed);
                };
                let mut answer = Vec::with_capacity(10 + 124);
                answer.extend_from_slice(&export.size_bytes().to_be_bytes());
                answer.extend_from_slice(&export.transmission_flags(structured).to_be_bytes());
                if !no_zeroes {
                    answer.extend_from_slice(&[0u8; 124]);
                }
                writer.write_all(&answer).await?;
                writer.flush().await?;
                return Ok(Outcome::Transmission { export, structured });
            }
            OPT_ABORT => {
                // The client may already have closed; an error here changes nothing.
                let _ = reply(writer, option, REP_ACK, &[]).await;
                return Ok(Outcome::Closed);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    reply(
                        writer,
                        option,
                        REP_ERR_INVALID,
                        b"NBD_OPT_LIST takes no data",
                    )
                    .await?;
                    continue;
                }
                for name in exports.names() {
                    let mut entry = Vec::with_capacity(4 + name.len());
                    entry.extend_from_slice(&(name.len() as u32).to_be_bytes());
                    entry.extend_from_slice(name.as_bytes());
                    reply(writer, option, REP_SERVER, &entry).await?;
                }
                reply(writer, option, REP_ACK, &[]).await?;
            }
            OPT_INFO | OPT_GO => {
                let Some(request) = InfoRequest::decode(&data) else {
                    reply(writer, option, REP_ERR_INVALID, b"malformed info request").await?;
                    continue;
                };
                let Some(export) = exports.find(&request.name) else {
                    let message = format!("no export named {:?}", request.name);
                    reply(writer, option, REP_ERR_UNKNOWN, message.as_bytes()).await?;
                    continue;
                };
                send_info(writer, option, &export, &request.requests, structured).await?;
                reply(writer, option, REP_ACK, &[]).await?;
                if option == OPT_GO {
                    return Ok(Outcome::Transmission { export, structured });
                }
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    reply(
                        writer,
                        option,
                        REP_ERR_INVALID,
                        b"NBD_OPT_STRUCTURED_REPLY takes no data",
                    )
                    .await?;
                    continue;
                }
                structured = true;
                reply(writer, option, REP_ACK, &[]).await?;
            }
            _ => {
                let message = format!("option {option} is not supported");
                reply(writer, option, REP_ERR_UNSUP, message.as_bytes()).await?;
            }
        }
    }
}

async fn send_info<W: AsyncWrite + Unpin>(
    writer: &mut W,
    option: u32,
    export: &Export,
    requested: &[u16],
    structured: bool,
) -> io::Result<()> {
    let mut item = Vec::with_capacity(12);
    item.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    item.extend_from_slice(&export.size_bytes().to_be_bytes());
    item.extend_from_slice(&export.transmission_flags(structured).to_be_bytes());
    reply(writer, option, REP_INFO, &item).await?;
    // Block sizes go to every client, asked or not (the protocol allows it), so a client
    // that did not ask still learns our alignment rather than meeting EINVAL.
    let mut kinds = vec![INFO_BLOCK_SIZE];
    kinds.extend(
        requested
            .iter()
            .copied()
            .filter(|&kind| kind != INFO_BLOCK_SIZE),
    );
    for kind in kinds {
        let mut item = kind.to_be_bytes().to_vec();
        match kind {
            INFO_NAME => item.extend_from_slice(export.name.as_bytes()),
            INFO_DESCRIPTION => item.extend_from_slice(export.description().as_bytes()),
            INFO_BLOCK_SIZE => {
                let block_size = export.bdev.info().block_size;
                item.extend_from_slice(&block_size.to_be_bytes());
                item.extend_from_slice(&block_size.max(4096).to_be_bytes());
                item.extend_from_slice(&PAYLOAD_SIZE_MAX.to_be_bytes());
            }
            _ => continue,
        }
        reply(writer, option, REP_INFO, &item).await?;
    }
    Ok(())
}

async fn reply<W: AsyncWrite + Unpin>(
    writer: &mut W,
    option: u32,
    kind: u32,
    data: &[u8],
) -> io::Result<()> {
    writer
        .write_all(&encode_option_reply(option, kind, data))
        .await?;
    writer.flush().await
}

/// Reads and drops `len` bytes.
pub async fn discard<R: AsyncRead + Unpin>(reader: &mut R, len: u64) -> io::Result<()> {
    let copied = tokio::io::copy(&mut reader.take(len), &mut tokio::io::sink()).await?;
    if copied < len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

fn invalid(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}
