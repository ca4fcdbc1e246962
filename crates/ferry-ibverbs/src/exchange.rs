//! Setting up a queue pair with a peer: the `IBVERBS_CONNECT` service on
//! the nodes' control session. The initiator sends its QP's details; the
//! owner creates a QP dedicated to that initiator, answers with its details,
//! and keeps it for as long as the session lives.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use ferry_control::{Endpoint, Request, Service, ServiceError, Session};
use ferry_core::{NodeAddr, OpError, random_u128};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::connection::PeerQp;
use crate::device::Device;
use crate::verbs::{CompletionChannel, CompletionQueue, PathConfig, QpEndpoint, QueuePair};
use crate::wire::{QP_INFO_LEN, QpInfo};

fn random_psn() -> u32 {
    (random_u128() as u32) & 0x00ff_ffff
}

fn endpoint_of(device: &Device, qp: &QueuePair, psn: u32) -> QpEndpoint {
    QpEndpoint {
        qpn: qp.qpn(),
        psn,
        gid: device.gid,
        lid: device.lid,
    }
}

/// Connects a new QP to `peer`: exchanges details over this node's control
/// session to it (by `deadline`), brings the QP to RTS and starts its
/// completion poller.
pub(crate) async fn connect(
    device: &Arc<Device>,
    endpoint: &Endpoint,
    peer: NodeAddr,
    deadline: Instant,
) -> Result<Arc<PeerQp>, OpError> {
    let setup = |e: crate::verbs::VerbsError| OpError::Protocol(format!("queue pair setup: {e}"));
    let left = || deadline.saturating_duration_since(Instant::now());
    let session = endpoint.session(peer, left()).await?;
    let channel = CompletionChannel::new(&device.context).map_err(setup)?;
    channel.set_nonblocking().map_err(setup)?;
    // One completion per request at most, and at most `max_send_wr` requests
    // outstanding (credits): the CQ cannot overflow.
    let cq = CompletionQueue::new(
        &device.context,
        device.max_send_wr + 1,
        Some(channel.clone()),
    )
    .map_err(setup)?;
    let qp = QueuePair::new_rc(&device.pd, &cq, device.max_send_wr).map_err(setup)?;
    qp.to_init(device.port).map_err(setup)?;
    let psn = random_psn();
    let mine = QpInfo {
        status: 0,
        mtu: device.mtu as u8,
        endpoint: endpoint_of(device, &qp, psn),
    };
    let reply = session
        .request(
            Service::IBVERBS_CONNECT,
            Bytes::copy_from_slice(&mine.encode()),
            left(),
        )
        .await?;
    let theirs = <&[u8; QP_INFO_LEN]>::try_from(&reply[..])
        .ok()
        .and_then(QpInfo::decode)
        .ok_or_else(|| OpError::Protocol("malformed queue-pair exchange reply".into()))?;
    let path = PathConfig {
        port: device.port,
        gid_index: device.gid_index,
        mtu: device.mtu.min(theirs.mtu as u32),
    };
    qp.to_rtr(&theirs.endpoint, &path).map_err(setup)?;
    qp.to_rts(psn).map_err(setup)?;
    let credits = qp.max_send_wr().min(device.max_send_wr) as usize;
    let conn = PeerQp::start(peer, qp, cq, channel, credits);
    tokio::spawn(watch_session(
        Arc::downgrade(&conn),
        session,
        conn.closed().clone(),
    ));
    debug!(peer = %peer.endpoint, qpn = conn.qpn(), remote_qpn = theirs.endpoint.qpn, "queue pair connected");
    Ok(conn)
}

/// Fails the QP as soon as the control session it was set up over ends:
/// the peer's process died or the path between the nodes broke, and RC
/// retries would only report it much later.
async fn watch_session(conn: std::sync::Weak<PeerQp>, session: Session, closed: CancellationToken) {
    tokio::select! {
        _ = closed.cancelled() => {}
        _ = session.closed() => {
            if let Some(conn) = conn.upgrade() {
                let endpoint = conn.peer().endpoint;
                conn.break_with(OpError::ConnectionLost { endpoint });
            }
        }
    }
}

/// The owner's queue pairs, one per control session that asked for one: a
/// QP dedicated to that initiator. A new exchange on the same session (the
/// initiator's QP failed and it reconnects) replaces it; the session's end
/// destroys it.
#[derive(Default)]
pub(crate) struct PassiveQps(Mutex<HashMap<u64, QueuePair>>);

impl PassiveQps {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, QueuePair>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many sessions hold a queue pair here.
    pub fn len(&self) -> usize {
        self.lock().len()
    }
}

/// The owner's side of the exchange: the `IBVERBS_CONNECT` service.
pub(crate) async fn accept(
    device: Arc<Device>,
    passive: Arc<PassiveQps>,
    request: Request,
) -> Result<Bytes, ServiceError> {
    let peer = request.session.peer();
    let theirs = <&[u8; QP_INFO_LEN]>::try_from(&request.body[..])
        .ok()
        .and_then(QpInfo::decode)
        .ok_or_else(|| ServiceError("malformed queue-pair exchange frame".into()))?;
    let setup = || -> Result<(QueuePair, u32), crate::verbs::VerbsError> {
        // The passive QP never posts; its CQ only has to exist.
        let cq = CompletionQueue::new(&device.context, 2, None)?;
        let qp = QueuePair::new_rc(&device.pd, &cq, 1)?;
        let psn = random_psn();
        let path = PathConfig {
            port: device.port,
            gid_index: device.gid_index,
            mtu: device.mtu.min(theirs.mtu as u32),
        };
        qp.to_init(device.port)?;
        qp.to_rtr(&theirs.endpoint, &path)?;
        qp.to_rts(psn)?;
        Ok((qp, psn))
    };
    let (qp, psn) = setup().map_err(|e| {
        debug!(node = %peer.id, error = %e, "cannot create a queue pair for a peer");
        ServiceError(format!("cannot create a queue pair: {e}"))
    })?;
    let reply = QpInfo {
        status: 0,
        mtu: device.mtu as u8,
        endpoint: endpoint_of(&device, &qp, psn),
    };
    let session = request.session;
    let replaced = passive.lock().insert(session.id(), qp);
    if replaced.is_none() {
        // The first QP of this session: it (and any that replaces it) lives
        // until the session ends.
        let passive = Arc::downgrade(&passive);
        tokio::spawn(async move {
            session.closed().await;
            if let Some(passive) = passive.upgrade() {
                passive.lock().remove(&session.id());
            }
            debug!(node = %session.peer().id, "control session ended: its queue pair is destroyed");
        });
    }
    Ok(Bytes::copy_from_slice(&reply.encode()))
}
