//! Talking to the monitors: one connection at a time, to the first monitor that answers,
//! moving on to the next when it fails.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use basalt_common::Epoch;
use basalt_wire::tcp::Client;
use tokio::sync::Mutex;

use crate::map::{ClusterMap, Command};
use crate::protocol::{ClusterStatus, MonReply, MonRequest, decode};

/// How long a request may take in all, retries over every monitor included.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(10);
/// Pause between rounds over the monitors.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// Why a monitor request failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum MonClientError {
    /// No monitor answered in time.
    #[error("no monitor answered at {addresses} ({last_error})")]
    Unreachable {
        /// The monitors tried.
        addresses: String,
        /// The last failure seen.
        last_error: String,
    },
    /// The monitor refused the request; the message says why.
    #[error("{0}")]
    Refused(String),
    /// The monitor answered something unexpected.
    #[error("unexpected answer from the monitor: {0}")]
    Protocol(String),
}

/// A client of the monitors.
pub struct MonClient {
    addresses: Vec<SocketAddr>,
    deadline: Duration,
    connection: Mutex<Option<Arc<Client>>>,
}

impl MonClient {
    /// A client of these monitors; nothing is connected yet.
    pub fn new(addresses: Vec<SocketAddr>) -> Self {
        Self {
            addresses,
            deadline: REQUEST_DEADLINE,
            connection: Mutex::new(None),
        }
    }

    /// The same, giving up on a request after `deadline` rather than [`REQUEST_DEADLINE`].
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    fn unreachable(&self, last_error: String) -> MonClientError {
        MonClientError::Unreachable {
            addresses: self
                .addresses
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(","),
            last_error,
        }
    }

    /// Sends a request to a monitor and returns its answer; a monitor that cannot be
    /// reached or fails mid-request is left for the next one, until the deadline.
    /// `wait` is how long the monitor may legitimately hold the request (a map wait).
    pub async fn request_waiting(
        &self,
        request: &MonRequest,
        wait: Duration,
    ) -> Result<MonReply, MonClientError> {
        let deadline = tokio::time::Instant::now() + self.deadline + wait;
        let message = request.to_message();
        let mut last_error = "no monitor address given".to_string();
        let mut next = 0usize;
        while tokio::time::Instant::now() < deadline {
            let connection = {
                let mut current = self.connection.lock().await;
                if current.is_none() && !self.addresses.is_empty() {
                    let address = self.addresses[next % self.addresses.len()];
                    next += 1;
                    let connect =
                        tokio::time::timeout(Duration::from_secs(2), Client::connect(address));
                    match connect.await {
                        Ok(Ok(client)) => *current = Some(Arc::new(client)),
                        Ok(Err(error)) => last_error = error.to_string(),
                        Err(_) => last_error = format!("connecting to {address} timed out"),
                    }
                }
                current.clone()
            };
            let Some(connection) = connection else {
                if next.is_multiple_of(self.addresses.len().max(1)) {
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
                continue;
            };
            let budget = deadline.saturating_duration_since(tokio::time::Instant::now());
            match tokio::time::timeout(budget, connection.call(&message)).await {
                Ok(Ok(reply)) => {
                    let reply = decode::<MonReply>(&reply).map_err(MonClientError::Protocol)?;
                    match reply {
                        // Asked again after a pause, of the next monitor (this one may be
                        // cut off from the others), unless a change may have been made (a
                        // command is not asked twice).
                        MonReply::Unavailable { reason, maybe_done }
                            if !maybe_done || !matches!(request, MonRequest::Command(_)) =>
                        {
                            last_error = reason;
                            tokio::time::sleep(RETRY_PAUSE).await;
                        }
                        reply => return Ok(reply),
                    }
                }
                Ok(Err(error)) => last_error = error.to_string(),
                Err(_) => last_error = "the request timed out".to_string(),
            }
            let mut current = self.connection.lock().await;
            if current
                .as_ref()
                .is_some_and(|c| Arc::ptr_eq(c, &connection))
            {
                *current = None;
            }
        }
        Err(self.unreachable(last_error))
    }

    /// Sends a request that the monitor answers at once.
    pub async fn request(&self, request: &MonRequest) -> Result<MonReply, MonClientError> {
        self.request_waiting(request, Duration::ZERO).await
    }

    /// Applies a command; returns whether the map changed and its epoch.
    pub async fn command(&self, command: Command) -> Result<(bool, Epoch), MonClientError> {
        match self.request(&MonRequest::Command(command)).await? {
            MonReply::Applied { changed, epoch } => Ok((changed, epoch)),
            MonReply::Error(message) => Err(MonClientError::Refused(message)),
            MonReply::Unavailable { reason, .. } => Err(MonClientError::Refused(format!(
                "{reason}; the change may or may not have been made (look before trying again)"
            ))),
            other => Err(MonClientError::Protocol(format!("{other:?}"))),
        }
    }

    /// The map once it is newer than `after`, waiting up to `wait`; `None` if it did not
    /// change in that time.
    pub async fn map_after(
        &self,
        after: Epoch,
        wait: Duration,
    ) -> Result<Option<ClusterMap>, MonClientError> {
        let request = MonRequest::GetMap {
            after: Some(after),
            wait_ms: wait.as_millis() as u64,
        };
        match self.request_waiting(&request, wait).await? {
            MonReply::Map(map) => Ok(map),
            MonReply::Error(message) => Err(MonClientError::Refused(message)),
            other => Err(MonClientError::Protocol(format!("{other:?}"))),
        }
    }

    /// The current map.
    pub async fn map(&self) -> Result<ClusterMap, MonClientError> {
        let request = MonRequest::GetMap {
            after: None,
            wait_ms: 0,
        };
        match self.request(&request).await? {
            MonReply::Map(Some(map)) => Ok(map),
            MonReply::Error(message) => Err(MonClientError::Refused(message)),
            other => Err(MonClientError::Protocol(format!("{other:?}"))),
        }
    }

    /// The cluster's state.
    pub async fn status(&self) -> Result<ClusterStatus, MonClientError> {
        match self.request(&MonRequest::Status).await? {
            MonReply::Status(status) => Ok(status),
            MonReply::Error(message) => Err(MonClientError::Refused(message)),
            other => Err(MonClientError::Protocol(format!("{other:?}"))),
        }
    }
}
