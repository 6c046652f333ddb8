//! Keep-alive, which finds a peer gone without closing (a host powered off, or cut off by
//! the network) behind an idle connection, which TCP would otherwise keep for ever: after
//! [`KEEPALIVE_IDLE`] of silence the peer is probed, [`KEEPALIVE_PROBES`] times
//! [`KEEPALIVE_INTERVAL`] apart, and the connection fails when none is answered: two
//! minutes in all, which a client paused for a while (a VM stopped for a snapshot or a
//! migration) outlasts.
//!
//! A connection with data in flight is left to TCP's retransmissions (Linux's default,
//! `tcp_retries2`, gives up after about 15 minutes). A user timeout (`TCP_USER_TIMEOUT`) would end it sooner, but it also
//! fails a connection to a live peer that only stopped reading (its window shut), whose
//! socket may still hold requests: a client would then send its retries and the host's
//! next writes on a new connection, and the old requests, read late from the old one by
//! the same leader in the same term, would land after them.

use std::io;
use std::time::Duration;

use tokio::net::TcpStream;

/// Silence after which an idle connection's peer is probed.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
/// Time between keep-alive probes.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// Unanswered keep-alive probes after which an idle connection fails.
pub const KEEPALIVE_PROBES: u32 = 6;

/// Sets what every Basalt connection wants: `TCP_NODELAY` (latency matters more than
/// packet count for block I/O) and keep-alive.
pub fn tune(stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    keep_alive(stream)
}

/// Turns keep-alive on for `stream`, with the probes above.
pub fn keep_alive(stream: &TcpStream) -> io::Result<()> {
    socket2::SockRef::from(stream).set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(KEEPALIVE_IDLE)
            .with_interval(KEEPALIVE_INTERVAL)
            .with_retries(KEEPALIVE_PROBES),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_probes_are_set() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("address");
        let stream = TcpStream::connect(address).await.expect("connect");
        keep_alive(&stream).expect("keep-alive");
        let socket = socket2::SockRef::from(&stream);
        assert!(socket.keepalive().expect("SO_KEEPALIVE"));
        assert_eq!(socket.tcp_keepalive_time().expect("idle"), KEEPALIVE_IDLE);
        assert_eq!(
            socket.tcp_keepalive_interval().expect("interval"),
            KEEPALIVE_INTERVAL
        );
        assert_eq!(
            socket.tcp_keepalive_retries().expect("probes"),
            KEEPALIVE_PROBES
        );
        assert_eq!(socket.tcp_user_timeout().expect("user timeout"), None);
    }
}
