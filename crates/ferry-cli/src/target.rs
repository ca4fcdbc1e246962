//! `ferry bench`'s setup: its node, the region it measures against (from
//! a handle file, a peer's metadata, or a `--loopback` server), and where
//! its workers submit.

use bytes::Bytes;
use ferry::prelude::*;
use kameo::actor::Spawn;

use crate::Failure;
use crate::bench::{BenchArgs, Op, Transport, Via};
use crate::discovery::resolve;
use crate::export_metrics;
use crate::loopback::start_server;
use crate::submitter::{Echo, Submitter};

/// What a run measures against, set up before anything is measured.
pub(crate) struct Target {
    pub node: Node,
    /// The `--loopback` server, stopped when dropped.
    pub server: Option<crate::loopback::Server>,
    pub remote: RemoteBuffer,
    pub local: Region,
    pub size: u64,
    pub transport: &'static str,
    pub transfers: bool,
    pub submitter: Submitter,
}

/// The node, the target, the local region and the submitter.
pub(crate) async fn setup(args: &BenchArgs) -> Result<Target, Failure> {
    if let Some(addr) = args.metrics {
        export_metrics(addr)?;
    }
    let mut builder = Node::builder();
    if let Some(window) = args.window {
        builder = builder.tcp_window(u32::try_from(window).unwrap_or(u32::MAX));
    }
    if let Some(us) = args.busy_poll_us {
        builder = builder.tcp_busy_poll(std::time::Duration::from_micros(us));
    }
    let builder = args.secret.apply(args.etcd.apply(builder, None)?)?;
    let node = builder
        .tcp_connections(args.streams)
        .ibverbs(matches!(
            args.transport,
            Transport::Auto | Transport::Ibverbs
        ))
        .memory(matches!(
            args.transport,
            Transport::Auto | Transport::Memory
        ))
        .spawn()
        .await?;
    let (_server, remote) = match (&args.handle, &args.peer, &args.region) {
        (Some(path), _, _) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| Failure(format!("cannot read handle file {}: {e}", path.display())))?;
            let handle = serde_json::from_str(text.trim())
                .map_err(|e| Failure(format!("{} is not a ferry handle: {e}", path.display())))?;
            (None, handle)
        }
        (None, Some(peer), Some(region)) => (None, resolve(&node, peer, region, &args.etcd).await?),
        _ => {
            let (server, handle) = start_server(args)?;
            (Some(server), handle)
        }
    };
    let size = remote.len();
    let local = node.alloc(size, Access::ReadWrite).await?;
    let probe = RdmaOp::write(local.slice(0..1)?, remote.slice(0..1)?);
    let level = node
        .route(&probe)
        .ok_or_else(|| Failure("no transport shared with the target".into()))?;
    let transport = match args.op {
        // Calls and messages go over the control session, whatever the data
        // transports are.
        Op::Rpc | Op::Message => "control",
        // Every transport the node runs registers.
        Op::Register => "all",
        Op::Write | Op::Read => level.backend(),
    };
    let transfers = matches!(args.op, Op::Write | Op::Read);
    if transfers && args.transport == Transport::Memory && level != RdmaTransportLevel::Memory {
        let why = node
            .unavailable(RdmaTransportLevel::Memory)
            .unwrap_or("the target is not on this host (or shares no memory)");
        return Err(Failure(format!(
            "--transport memory: not available here: {why}"
        )));
    }
    if transfers && args.transport == Transport::Ibverbs && level != RdmaTransportLevel::Nic {
        let why = node
            .unavailable(RdmaTransportLevel::Nic)
            .unwrap_or("the target has no RDMA device");
        return Err(Failure(format!(
            "--transport ibverbs: not available here: {why}"
        )));
    }
    // Fits usize: parse_size keeps it far below, and the node refuses what
    // is over its message limit.
    let notification = args.notify.map(|len| Bytes::from(vec![0x4E; len as usize]));
    let submitter = match args.via {
        Via::Node => Submitter::Node(node.clone(), notification),
        Via::Actor => Submitter::Actor(node.actor().clone(), notification),
        Via::Echo => Submitter::Echo(Echo::spawn(Echo)),
    };
    Ok(Target {
        node,
        server: _server,
        remote,
        local,
        size,
        transport,
        transfers,
        submitter,
    })
}
