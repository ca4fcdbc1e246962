//! A node with TCP off (`NodeBuilder::tcp(false)`): same-host memory still
//! moves its bytes, a peer only TCP reaches is refused both ways with
//! `NoSharedTransport`, nothing moved, and a same-host peer that died is
//! unreachable.

use ferry::prelude::*;
use ferry::{NodeError, OpError, PrepareError, SubmitError};

use crate::common::{PeerProcess, digest, pattern, reads_back, write_then_read_back};
use crate::{DEADLINE, sharing_peer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_tcp_off_moves_same_host_bytes_and_refuses_a_tcp_only_peer() {
    let node = Node::builder()
        .ibverbs(false)
        .tcp(false)
        .spawn()
        .await
        .unwrap();
    assert!(node.unavailable(RdmaTransportLevel::Tcp).is_some());
    let mut shared = sharing_peer().await;
    let memory = Some(RdmaTransportLevel::Memory);
    write_then_read_back(&node, &mut shared, 1 << 20, 3, memory).await;

    // The peer's memory carries TCP credentials only: no route, no fall-back.
    let mut tcp_only = PeerProcess::spawn().await;
    let target = tcp_only.alloc(4096, Access::ReadWrite, 4).await;
    let src = node.alloc(4096, Access::ReadWrite).await.unwrap();
    src.write_at(0, &pattern(4096, 9)).unwrap();
    let op = RdmaOp::write(src.whole(), target.handle.clone());
    assert_eq!(node.route(&op), None);
    let result = node.submit(vec![op], DEADLINE).await;
    assert!(
        matches!(
            result,
            Err(SubmitError::Op {
                index: 0,
                error: OpError::NoSharedTransport
            })
        ),
        "{result:?}"
    );
    assert_eq!(tcp_only.digest(&target).await, digest(&target.original()));

    // This node's memory carries none: the TCP-only peer cannot reach it.
    let ours = node.alloc(4096, Access::ReadWrite).await.unwrap();
    ours.write_at(0, &pattern(4096, 5)).unwrap();
    assert!(ours.remote().transports().tcp.is_none());
    assert!(ours.remote().transports().memory.is_some());
    let back = tcp_only.alloc(4096, Access::ReadWrite, 6).await;
    let refused = tcp_only.read_from(&back, &ours.remote()).await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.contains(&OpError::NoSharedTransport.to_string())),
        "{refused:?}"
    );
    assert_eq!(tcp_only.digest(&back).await, digest(&back.original()));

    // Connecting ahead opens no TCP data connections to it either.
    let tcp_only_addr = tcp_only.node_addr().await.unwrap();
    let connected = node.connect(tcp_only_addr, DEADLINE).await;
    assert!(
        matches!(
            connected,
            Err(PrepareError::Connect {
                error: OpError::NoSharedTransport,
                ..
            })
        ),
        "{connected:?}"
    );

    // A same-host peer that dies is unreachable, not a transport never shared.
    let target = shared.alloc(4096, Access::ReadWrite, 7).await;
    reads_back(&node, &src, &target, DEADLINE).await;
    shared.kill().await;
    let op = RdmaOp::write(src.whole(), target.handle.clone());
    let result = node.submit(vec![op], DEADLINE).await;
    assert!(
        matches!(
            result,
            Err(SubmitError::Op {
                index: 0,
                error: OpError::PeerUnreachable { .. } | OpError::ConnectionLost { .. }
            })
        ),
        "{result:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requiring_tcp_with_tcp_off_is_refused_at_spawn() {
    let result = Node::builder()
        .tcp(false)
        .require(RdmaTransportLevel::Tcp)
        .spawn()
        .await
        .err();
    assert!(
        matches!(
            result,
            Some(NodeError::TransportUnavailable {
                transport: RdmaTransportLevel::Tcp,
                ..
            })
        ),
        "{result:?}"
    );
}
