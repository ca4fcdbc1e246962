//! Discovery through etcd, for clusters (cargo feature `etcd`).
//!
//! A node keeps its metadata blob under `/ferry/<cluster>/nodes/<name>`,
//! attached to a lease it keeps alive ([`publish`](Etcd::publish)): a node
//! that dies stops renewing, and etcd deletes its key within the lease's
//! TTL. Unlike NIXL's etcd keys (no lease), a crashed node's metadata does
//! not outlive it. Peers look a node up by name, waiting for the key up to
//! their deadline ([`EtcdDiscovery::lookup`]), and a watch on the namespace
//! drops a cached peer when its key goes and reloads it when it is
//! republished, so a restarted node's new incarnation replaces the old one
//! in every cache that holds it.
//!
//! Every request to etcd has a deadline ([`EtcdConfig::request_timeout`]);
//! losing etcd never stops transfers, only discovery: the publication and
//! the watch reconnect with backoff, republish and resynchronize.

mod publish;
mod watch;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions, WatchOptions, WatchStream};

use crate::metadata::{MetadataError, NodeMetadata};
use crate::peers::{Loaded, Peers};

pub use publish::Publication;
pub use watch::PeerWatch;

/// Where a node finds etcd and how it uses it.
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// etcd's client URLs, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// The namespace: keys live under `/ferry/<cluster>/nodes/`.
    pub cluster: String,
    /// How long a published key outlives its node's last keep-alive
    /// (default 10 s; etcd rounds it up to whole seconds). Keep-alives go
    /// out every third of it.
    pub lease_ttl: Duration,
    /// The deadline of every single request to etcd (default 3 s).
    pub request_timeout: Duration,
    /// Whether a node fails to start when etcd is unreachable then (default
    /// true). Otherwise it starts, and publishes once etcd answers.
    pub required: bool,
}

impl EtcdConfig {
    /// etcd at `endpoint`, cluster `default`, the default lease and timeouts.
    pub fn new(endpoint: impl Into<String>) -> Self {
        EtcdConfig {
            endpoints: vec![endpoint.into()],
            cluster: "default".into(),
            lease_ttl: Duration::from_secs(10),
            request_timeout: Duration::from_secs(3),
            required: true,
        }
    }

    /// The cluster namespace.
    pub fn cluster(mut self, cluster: impl Into<String>) -> Self {
        self.cluster = cluster.into();
        self
    }

    /// The lease TTL (at least one second).
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl.max(Duration::from_secs(1));
        self
    }

    /// The deadline of each request.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Whether etcd must answer when the node starts.
    pub fn required(mut self, required: bool) -> Self {
        self.required = required;
        self
    }

    /// The prefix of every node key in the namespace.
    pub fn prefix(&self) -> String {
        format!("/ferry/{}/nodes/", self.cluster)
    }

    /// The key a node of this name is published under.
    pub fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix())
    }

    /// The lease TTL in etcd's unit (whole seconds, rounded up).
    fn ttl_seconds(&self) -> i64 {
        let ttl = self.lease_ttl.as_secs() + u64::from(self.lease_ttl.subsec_nanos() > 0);
        i64::try_from(ttl.max(1)).unwrap_or(i64::MAX)
    }
}

/// Why an etcd operation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EtcdError {
    /// etcd did not answer when the node needed it to.
    #[error("etcd at {endpoints} is unreachable: {reason}")]
    Unreachable {
        /// The URLs tried, comma separated.
        endpoints: String,
        /// What the client reported.
        reason: String,
    },
    /// etcd answered a request with an error.
    #[error("etcd {what} failed: {reason}")]
    Request {
        /// The request.
        what: &'static str,
        /// What etcd or the client reported.
        reason: String,
    },
    /// A request got no answer within [`EtcdConfig::request_timeout`].
    #[error("etcd {what}: no answer within {after:?}")]
    Timeout {
        /// The request.
        what: &'static str,
        /// The deadline it had.
        after: Duration,
    },
    /// No node of that name was published by the lookup's deadline.
    #[error("no node named {name:?} is published in etcd (waited {waited:?})")]
    NotFound {
        /// The name looked up.
        name: String,
        /// How long the lookup waited for it.
        waited: Duration,
    },
    /// A key in the namespace holds something that is not node metadata.
    #[error("etcd key {key}: {source}")]
    Metadata {
        /// The key.
        key: String,
        /// Why its value could not be read.
        source: MetadataError,
    },
}

/// A connection to etcd for one cluster namespace. Cheap to clone.
#[derive(Clone)]
pub struct Etcd {
    client: Client,
    config: Arc<EtcdConfig>,
}

impl Etcd {
    /// Connects and checks that etcd answers within the request timeout
    /// ([`EtcdError::Unreachable`] otherwise).
    pub async fn connect(config: EtcdConfig) -> Result<Self, EtcdError> {
        let etcd = Self::connect_lazily(config).await?;
        let probe = GetOptions::new()
            .with_prefix()
            .with_keys_only()
            .with_limit(1);
        let prefix = etcd.config.prefix();
        match etcd
            .call(
                "probe",
                |mut c| async move { c.get(prefix, Some(probe)).await },
            )
            .await
        {
            Ok(_) => Ok(etcd),
            Err(e) => Err(EtcdError::Unreachable {
                endpoints: etcd.config.endpoints.join(","),
                reason: e.to_string(),
            }),
        }
    }

    /// A client that connects on first use: for nodes that may start before
    /// etcd does. Fails only on malformed endpoint URLs.
    pub async fn connect_lazily(config: EtcdConfig) -> Result<Self, EtcdError> {
        let options = ConnectOptions::new()
            .with_connect_timeout(config.request_timeout)
            // HTTP/2 pings find a silently dead etcd (a cut link) for the
            // streams, which have no deadline of their own.
            .with_keep_alive(Duration::from_secs(5), config.request_timeout)
            .with_keep_alive_while_idle(true);
        // The client's channel connects on first use: this does no I/O.
        let client = Client::connect(config.endpoints.clone(), Some(options))
            .await
            .map_err(|e| EtcdError::Unreachable {
                endpoints: config.endpoints.join(","),
                reason: e.to_string(),
            })?;
        Ok(Etcd {
            client,
            config: Arc::new(config),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EtcdConfig {
        &self.config
    }

    /// Runs one request with the configured deadline.
    async fn call<T, F, Fut>(&self, what: &'static str, request: F) -> Result<T, EtcdError>
    where
        F: FnOnce(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let after = self.config.request_timeout;
        match tokio::time::timeout(after, request(self.client.clone())).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(e)) => Err(EtcdError::Request {
                what,
                reason: e.to_string(),
            }),
            Err(_) => Err(EtcdError::Timeout { what, after }),
        }
    }

    /// Opens a watch on `key` with `options`.
    async fn watch(&self, key: String, options: WatchOptions) -> Result<WatchStream, EtcdError> {
        self.call(
            "watch",
            |mut c| async move { c.watch(key, Some(options)).await },
        )
        .await
    }

    /// Every key in the namespace, and the store's revision it was read at.
    async fn nodes(&self) -> Result<(Vec<NodeKey>, i64), EtcdError> {
        let prefix = self.config.prefix();
        let p = prefix.clone();
        let answer = self
            .call("list", |mut c| async move {
                c.get(p, Some(GetOptions::new().with_prefix())).await
            })
            .await?;
        let revision = answer.header().map_or(0, |h| h.revision());
        let nodes = answer
            .kvs()
            .iter()
            .filter_map(|kv| {
                let key = String::from_utf8_lossy(kv.key()).into_owned();
                let name = key.strip_prefix(&prefix)?.to_string();
                Some(NodeKey {
                    key,
                    name,
                    value: kv.value().to_vec(),
                    lease: kv.lease(),
                })
            })
            .collect();
        Ok((nodes, revision))
    }

    fn decode(key: &str, value: &[u8]) -> Result<NodeMetadata, EtcdError> {
        NodeMetadata::decode(value).map_err(|source| EtcdError::Metadata {
            key: key.to_string(),
            source,
        })
    }

    /// The metadata published under `name`, if any, and the store's
    /// revision it was read at.
    pub async fn get(&self, name: &str) -> Result<(Option<NodeMetadata>, i64), EtcdError> {
        let key = self.config.key(name);
        let k = key.clone();
        let answer = self
            .call("get", |mut c| async move { c.get(k, None).await })
            .await?;
        let revision = answer.header().map_or(0, |h| h.revision());
        let metadata = match answer.kvs().first() {
            Some(kv) => Some(Self::decode(&key, kv.value())?),
            None => None,
        };
        Ok((metadata, revision))
    }

    /// The metadata published under `name` once it satisfies `wanted`,
    /// waiting up to `timeout` for it to be published (or republished, e.g.
    /// with a region it lacked). At the deadline: the last metadata seen,
    /// wanted or not, or [`EtcdError::NotFound`] when there was none.
    pub async fn lookup(
        &self,
        name: &str,
        timeout: Duration,
        wanted: impl Fn(&NodeMetadata) -> bool,
    ) -> Result<NodeMetadata, EtcdError> {
        let mut seen = None;
        let wait = async {
            let (found, revision) = self.get(name).await?;
            if let Some(metadata) = found {
                if wanted(&metadata) {
                    return Ok(metadata);
                }
                seen = Some(metadata);
            }
            // Watch from just after the read, so a put in between is seen.
            let key = self.config.key(name);
            let options = WatchOptions::new().with_start_revision(revision + 1);
            let mut stream = self.watch(key.clone(), options).await?;
            loop {
                let answer = next_answer(&mut stream).await?;
                for event in answer.events() {
                    match (event.event_type(), event.kv()) {
                        (etcd_client::EventType::Put, Some(kv)) => {
                            let metadata = Self::decode(&key, kv.value())?;
                            if wanted(&metadata) {
                                return Ok(metadata);
                            }
                            seen = Some(metadata);
                        }
                        _ => seen = None,
                    }
                }
            }
        };
        let waited = tokio::time::timeout(timeout, wait).await;
        match (waited, seen) {
            (Ok(found), _) => found,
            (Err(_), Some(metadata)) => Ok(metadata),
            (Err(_), None) => Err(EtcdError::NotFound {
                name: name.to_string(),
                waited: timeout,
            }),
        }
    }

    /// Every node published in the namespace, by name, with the time its
    /// lease has left.
    pub async fn list(&self) -> Result<Vec<Listing>, EtcdError> {
        let (nodes, _) = self.nodes().await?;
        let mut listings = Vec::new();
        for node in nodes {
            let lease = node.lease;
            let lease_left = if lease == 0 {
                None
            } else {
                let answer = self
                    .call("lease time-to-live", |mut c| async move {
                        c.lease_time_to_live(lease, None).await
                    })
                    .await?;
                // -1: the lease expired between the two reads.
                Some(Duration::from_secs(
                    u64::try_from(answer.ttl()).unwrap_or(0),
                ))
            };
            listings.push(Listing {
                name: node.name,
                metadata: NodeMetadata::decode(&node.value),
                lease_left,
            });
        }
        Ok(listings)
    }

    /// Publishes `blob` under `name` with a lease kept alive until the
    /// returned [`Publication`] is withdrawn or dropped; reconnects and
    /// republishes (with backoff) whenever etcd is lost.
    pub fn publish(&self, name: &str, blob: bytes::Bytes) -> Publication {
        Publication::start(self.clone(), self.config.key(name), blob)
    }
}

/// One key of the namespace, as read.
struct NodeKey {
    key: String,
    /// The key below the namespace prefix.
    name: String,
    value: Vec<u8>,
    /// Its lease (0: none).
    lease: i64,
}

/// The next answer on a watch; a broken or closed stream is an error.
async fn next_answer(stream: &mut WatchStream) -> Result<etcd_client::WatchResponse, EtcdError> {
    let closed = |reason: String| EtcdError::Request {
        what: "watch",
        reason,
    };
    stream
        .message()
        .await
        .map_err(|e| closed(e.to_string()))?
        .ok_or_else(|| closed("etcd closed the watch".into()))
}

/// One node as `list` found it.
#[derive(Clone, Debug)]
pub struct Listing {
    /// Its name (the key below the namespace prefix).
    pub name: String,
    /// Its metadata, or why the value is not readable.
    pub metadata: Result<NodeMetadata, MetadataError>,
    /// What its lease has left (`None`: a key without a lease).
    pub lease_left: Option<Duration>,
}

/// etcd discovery for a node: lookups by name into the node's peer cache,
/// kept current by a watch on the namespace.
pub struct EtcdDiscovery {
    etcd: Etcd,
    peers: Arc<Peers>,
    /// Names loaded through etcd: the watch keeps these current (a peer
    /// loaded peer-to-peer is left alone).
    tracked: Arc<Mutex<BTreeSet<String>>>,
    _watch: PeerWatch,
}

impl EtcdDiscovery {
    /// Starts watching the namespace for `peers`.
    pub fn start(etcd: Etcd, peers: Arc<Peers>) -> Self {
        let tracked = Arc::new(Mutex::default());
        let watch = PeerWatch::start(etcd.clone(), peers.clone(), Arc::clone(&tracked));
        EtcdDiscovery {
            etcd,
            peers,
            tracked,
            _watch: watch,
        }
    }

    /// The etcd connection.
    pub fn etcd(&self) -> &Etcd {
        &self.etcd
    }

    /// `name`'s metadata once it satisfies `wanted`: from the cache when
    /// the watch keeps it there, else from etcd, waiting up to `timeout` as
    /// [`Etcd::lookup`] does.
    pub async fn lookup(
        &self,
        name: &str,
        timeout: Duration,
        wanted: impl Fn(&NodeMetadata) -> bool,
    ) -> Result<(NodeMetadata, Option<Loaded>), EtcdError> {
        if self.is_tracked(name)
            && let Some(metadata) = self.peers.get(name)
            && wanted(&metadata)
        {
            return Ok((metadata, None));
        }
        let metadata = self.etcd.lookup(name, timeout, wanted).await?;
        // Tracked before loading: a delete the watch sees from now on drops it.
        self.tracked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string());
        let loaded = self.peers.load(metadata.clone());
        Ok((metadata, Some(loaded)))
    }

    fn is_tracked(&self, name: &str) -> bool {
        self.tracked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(name)
    }
}
