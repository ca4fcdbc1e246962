//! Setting up a queue pair with a peer: the `IBVERBS_CONNECT` service on
//! the nodes' control session. The initiator sends its QP's details; the
//! owner creates a QP dedicated to that initiator (`passive`), answers with
//! its details and its notification receive buffers, and keeps it for as
//! long as the session lives (and, if the session went silent, for the
//! session's silent grace).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ferry_control::{Endpoint, Service, Session};
use ferry_core::{NodeAddr, OpError, random_u128};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::connection::PeerQp;
use crate::device::Device;
use crate::notify::NotifyLane;
use crate::verbs::{CompletionChannel, CompletionQueue, PathConfig, QpEndpoint, QueuePair};
use crate::wire::{QP_INFO_LEN, QpInfo};

pub(crate) fn random_psn() -> u32 {
    (random_u128() as u32) & 0x00ff_ffff
}

pub(crate) fn endpoint_of(device: &Device, qp: &QueuePair, psn: u32) -> QpEndpoint {
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
    let qp = QueuePair::new_rc(&device.pd, &cq, device.max_send_wr, 1).map_err(setup)?;
    qp.to_init(device.port).map_err(setup)?;
    let psn = random_psn();
    let mine = QpInfo {
        status: 0,
        mtu: device.mtu as u8,
        endpoint: endpoint_of(device, &qp, psn),
        recv_slots: 0,
        recv_slot_len: 0,
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
        timing: device.qp_timing,
    };
    qp.to_rtr(&theirs.endpoint, &path).map_err(setup)?;
    qp.to_rts(psn, &path.timing).map_err(setup)?;
    let credits = qp.max_send_wr().min(device.max_send_wr) as usize;
    let lane =
        NotifyLane::new(&device.pd, theirs.recv_slots, theirs.recv_slot_len).map_err(setup)?;
    let conn = PeerQp::start(peer, qp, cq, channel, credits, lane);
    tokio::spawn(watch_session(
        Arc::downgrade(&conn),
        session,
        conn.closed().clone(),
    ));
    debug!(peer = %peer.endpoint, qpn = conn.qpn(), remote_qpn = theirs.endpoint.qpn, "queue pair connected");
    Ok(conn)
}

/// Fails the QP once the control session it was set up over ends, since
/// RC retries would report a dead peer much later (never, on soft-RoCE):
///
/// - closed or reset by the peer (its process died): at once;
/// - the peer went silent for the peer timeout (its host or the path is
///   down, or every keepalive probe was lost): at once if the QP is idle or
///   has completed nothing for that long. Otherwise its transfers are still
///   completing, the path works for them, and they go on: the QP retires
///   (new submits get a fresh one, over a new session) and is failed once
///   idle, once it stalls for the peer timeout, or at the session's silent
///   grace, after which the owner lets its end go (`passive::accept`).
///   Each transfer's own deadline bounds it meanwhile.
async fn watch_session(conn: std::sync::Weak<PeerQp>, session: Session, closed: CancellationToken) {
    tokio::select! {
        _ = closed.cancelled() => return,
        _ = session.closed() => {}
    }
    let peer_timeout = session.peer_timeout();
    let grace_ends = Instant::now() + session.silent_grace();
    loop {
        let Some(qp) = conn.upgrade() else { return };
        let progressing = session.went_silent()
            && qp.is_busy()
            && qp.since_progress() < peer_timeout
            && Instant::now() < grace_ends;
        if !progressing {
            let endpoint = qp.peer().endpoint;
            qp.break_with(OpError::ConnectionLost { endpoint });
            return;
        }
        if qp.is_usable() {
            debug!(peer = %qp.peer().endpoint, qpn = qp.qpn(), "control session went silent with transfers completing: they go on, new ones get a new queue pair");
            qp.retire();
        }
        drop(qp);
        tokio::select! {
            _ = closed.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
}
