//! The peer-to-peer fetch: a node serves its metadata on its control
//! sessions (`Service::METADATA`), and a peer that knows only its address
//! asks it who it is (the `IDENTIFY` hello) and then for the blob.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use ferry_control::{Channel, ControlError, Endpoint, EndpointError, Service, ServiceError};
use ferry_core::NodeAddr;
use tokio::time::Instant;

use crate::metadata::{MetadataError, NodeMetadata};
use crate::peers::LookupError;

/// Why a peer's metadata could not be fetched.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// The peer could not be reached or answered with an error.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// Nothing by the deadline.
    #[error("no metadata from {endpoint} within {after:?}")]
    Timeout {
        /// The peer's address.
        endpoint: SocketAddr,
        /// The deadline it had.
        after: Duration,
    },
    /// It answered with a blob this node cannot use.
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    /// The blob describes another node than the one that sent it.
    #[error("{endpoint} sent the metadata of another node")]
    Impostor {
        /// The peer's address.
        endpoint: SocketAddr,
    },
    /// The name or region is not known (and no registry can tell).
    #[error(transparent)]
    Lookup(#[from] LookupError),
    /// etcd could not tell.
    #[cfg(feature = "etcd")]
    #[error(transparent)]
    Etcd(#[from] crate::etcd::EtcdError),
}

/// Serves this node's metadata on `endpoint`: `export(names)` makes the
/// blob, for every region (`None`) or for the names a peer asked for. Also
/// answers the `IDENTIFY` hello, so peers that know only the address can
/// find the node's id.
pub fn serve_metadata<F>(endpoint: &Endpoint, export: F) -> Result<(), EndpointError>
where
    F: Fn(Option<Vec<String>>) -> Bytes + Send + Sync + 'static,
{
    // The hello reply carries the id; nothing more to say.
    endpoint.handle(Channel::IDENTIFY, |_connection| async {})?;
    endpoint.serve(Service::METADATA, move |request| {
        let names = match &request.body[..] {
            [] => Ok(None),
            body => serde_json::from_slice::<Vec<String>>(body)
                .map(Some)
                .map_err(|e| ServiceError(format!("malformed metadata request: {e}"))),
        };
        let answer = names.map(&export);
        async move { answer }
    })
}

/// Fetches the metadata of the node at `address` (all of it, or the
/// regions in `names`) within `timeout`: first its id, then the blob over
/// this node's control session to it.
pub async fn fetch(
    endpoint: &Endpoint,
    address: SocketAddr,
    names: Option<&[String]>,
    timeout: Duration,
) -> Result<NodeMetadata, DiscoveryError> {
    let deadline = Instant::now() + timeout;
    let timed_out = DiscoveryError::Timeout {
        endpoint: address,
        after: timeout,
    };
    let id = tokio::time::timeout_at(deadline, endpoint.dialer().identify(address))
        .await
        .map_err(|_| timed_out.clone())??;
    let peer = NodeAddr {
        id,
        endpoint: address,
    };
    let left = deadline.saturating_duration_since(Instant::now());
    fetch_from(endpoint, peer, names, left).await
}

/// As [`fetch`], for a peer whose id is known: the session's hello proves
/// it is still that node (a restarted one fails with `WrongNode`).
pub async fn fetch_from(
    endpoint: &Endpoint,
    peer: NodeAddr,
    names: Option<&[String]>,
    timeout: Duration,
) -> Result<NodeMetadata, DiscoveryError> {
    let deadline = Instant::now() + timeout;
    let session = endpoint.session(peer, timeout).await?;
    let body = match names {
        None => Bytes::new(),
        Some(names) => serde_json::to_vec(names)
            .expect("names always serialize")
            .into(),
    };
    let left = deadline.saturating_duration_since(Instant::now());
    let blob = session.request(Service::METADATA, body, left).await?;
    let metadata = NodeMetadata::decode(&blob)?;
    if metadata.node.id != peer.id {
        return Err(DiscoveryError::Impostor {
            endpoint: peer.endpoint,
        });
    }
    Ok(metadata)
}
