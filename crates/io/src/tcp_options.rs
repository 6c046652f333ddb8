//! TCP options that find a peer gone without closing (a host powered off, or cut off by
//! the network), which TCP otherwise keeps a connection to for about 15 minutes of
//! retransmissions, or for ever when the connection is idle.
//!
//! - Keep-alive, on every connection: after [`KEEPALIVE_IDLE`] of silence the peer is
//!   probed, [`KEEPALIVE_PROBES`] times [`KEEPALIVE_INTERVAL`] apart, and the connection
//!   fails when none is answered.
//! - A user timeout (`TCP_USER_TIMEOUT`), on the cluster's own connections: data left
//!   unacknowledged, or held back by a peer's shut window, for that long fails the
//!   connection. The frontends leave it out: a client that stops reading for a while (a
//!   paused VM) is their stall timeout's to judge.

use std::io;
use std::time::Duration;

use tokio::net::TcpStream;

/// Silence after which an idle connection's peer is probed.
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(15);
/// Time between keep-alive probes.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// Unanswered keep-alive probes after which an idle connection fails.
pub const KEEPALIVE_PROBES: u32 = 3;
/// How long sent data may stay unacknowledged (or unsent behind a peer's shut window) on
/// a cluster connection before it fails: far above any pause of a live peer (raft's
/// election timeouts are 1-2 s; a client's attempt gives up after 5 s).
pub const USER_TIMEOUT: Duration = Duration::from_secs(30);

/// Turns keep-alive on for `stream`, with the probes above.
pub fn keep_alive(stream: &TcpStream) -> io::Result<()> {
    socket2::SockRef::from(stream).set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(KEEPALIVE_IDLE)
            .with_interval(KEEPALIVE_INTERVAL)
            .with_retries(KEEPALIVE_PROBES),
    )
}

/// Keep-alive, and a user timeout of `user_timeout` ([`USER_TIMEOUT`] but in tests).
pub fn find_dead_peers(stream: &TcpStream, user_timeout: Duration) -> io::Result<()> {
    keep_alive(stream)?;
    socket2::SockRef::from(stream).set_tcp_user_timeout(Some(user_timeout))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_options_are_set() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("address");
        let stream = TcpStream::connect(address).await.expect("connect");
        let (accepted, _) = listener.accept().await.expect("accept");
        keep_alive(&accepted).expect("keep-alive");
        find_dead_peers(&stream, USER_TIMEOUT).expect("options");
        for (socket, user_timeout) in [(&accepted, None), (&stream, Some(USER_TIMEOUT))] {
            let socket = socket2::SockRef::from(socket);
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
            assert_eq!(
                socket.tcp_user_timeout().expect("user timeout"),
                user_timeout
            );
        }
    }
}
