//! A process without the cluster secret in the middle: members A and B hold
//! it, and A is made to dial a relay that says it is B (a handle, NIXL
//! connection info or an etcd record naming B's id at the relay's address:
//! none of these is signed). The relay passes the handshake through, as any
//! router would; what it must not get is a voice of its own. Every frame
//! after the hello is sealed with keys derived from the secret and the
//! handshake, so an injected, replayed or altered frame closes the
//! connection, counted as forged; and a hello bounced back to its sender is
//! refused before any proof is checked. Last, revoking a leaked secret
//! ends what its holder opened.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use ferry::control::{ControlError, Dialer, HelloStatus};
use ferry::prelude::*;
use ferry::{ClusterSecret, Node, NodeAddr, RpcError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

use crate::DEADLINE;

const SECRET: &str = "the relay test's secret, 32 B!!";
/// A hello (72 bytes) and the client's proof (32): what the relay lets
/// through before the sealed frames begin.
const HANDSHAKE: usize = 72 + 32;

async fn member(tcp_only: bool) -> Node {
    Node::builder()
        .ibverbs(false)
        .memory(!tcp_only)
        .cluster_secret(ClusterSecret::new(SECRET).unwrap())
        .spawn()
        .await
        .unwrap()
}

/// What the relay does with the client's bytes past the handshake.
enum Tamper {
    /// Flip the last byte of the client's next chunk (a sealed frame's tag).
    Flip,
    /// Stop passing the client's bytes, and send the server instead what
    /// the client sent past the handshake so far (a replay of its frames:
    /// the only sealed bytes the relay has).
    Replay,
    /// Stop passing the client's bytes, and send the server these: frames
    /// the relay made itself, as it would without the secret.
    Inject(Vec<u8>),
}

/// A relay on loopback to `to`, for one connection: it passes bytes both
/// ways, recording the client's, until told to tamper.
struct Relay {
    addr: SocketAddr,
    tamper: mpsc::Sender<(Tamper, oneshot::Sender<()>)>,
}

impl Relay {
    async fn to(to: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tamper, mut told) = mpsc::channel::<(Tamper, oneshot::Sender<()>)>(1);
        tokio::spawn(async move {
            let (client, _) = listener.accept().await.unwrap();
            let server = TcpStream::connect(to).await.unwrap();
            let (mut client_read, mut client_write) = client.into_split();
            let (mut server_read, server_write) = server.into_split();
            tokio::spawn(async move { tokio::io::copy(&mut server_read, &mut client_write).await });
            let server_write = Arc::new(tokio::sync::Mutex::new(server_write));
            let recorded = Arc::new(Mutex::new(Vec::new()));
            let mut buf = vec![0u8; 1 << 16];
            let mut flip = false;
            loop {
                tokio::select! {
                    read = client_read.read(&mut buf) => {
                        let n = match read {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        let mut chunk = buf[..n].to_vec();
                        let before = recorded.lock().unwrap().len();
                        // The chunk's last byte: a sealed frame's tag.
                        if flip && before + n > HANDSHAKE {
                            chunk[n - 1] ^= 0x40;
                            flip = false;
                        }
                        recorded.lock().unwrap().extend_from_slice(&buf[..n]);
                        if server_write.lock().await.write_all(&chunk).await.is_err() {
                            return;
                        }
                    }
                    order = told.recv() => {
                        let Some((order, done)) = order else { return };
                        match order {
                            Tamper::Flip => {
                                flip = true;
                                let _ = done.send(());
                            }
                            Tamper::Replay | Tamper::Inject(_) => {
                                let bytes = match order {
                                    Tamper::Inject(bytes) => bytes,
                                    _ => recorded.lock().unwrap()[HANDSHAKE..].to_vec(),
                                };
                                let _ = server_write.lock().await.write_all(&bytes).await;
                                let _ = done.send(());
                                // The client is cut off from here on.
                                std::future::pending::<()>().await;
                            }
                        }
                    }
                }
            }
        });
        Relay { addr, tamper }
    }

    async fn tamper(&self, how: Tamper) {
        let (done, told) = oneshot::channel();
        self.tamper.send((how, done)).await.unwrap();
        told.await.unwrap();
    }

    /// `node` as reached through this relay.
    fn posing_as(&self, node: &Node) -> NodeAddr {
        NodeAddr {
            id: node.addr().id,
            endpoint: self.addr,
        }
    }
}

/// Waits until `done` holds, up to the deadline.
async fn until(what: &str, done: impl Fn() -> bool) {
    let start = std::time::Instant::now();
    while !done() {
        assert!(start.elapsed() < DEADLINE, "{what}");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// B's RPC handler, counting its calls.
fn counted(b: &Node) -> Arc<AtomicUsize> {
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    b.serve_rpc("count", move |_| {
        seen.fetch_add(1, Ordering::SeqCst);
        async { Ok(Bytes::new()) }
    })
    .unwrap();
    calls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_replays_a_members_control_frames_gets_no_call_through() {
    let (a, b) = (member(true).await, member(true).await);
    let calls = counted(&b);
    let relay = Relay::to(b.addr().endpoint).await;
    // A's call goes through the relay: it only passes bytes.
    a.call(relay.posing_as(&b), "count", Bytes::new(), DEADLINE)
        .await
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // Cut off from A, the relay replays A's sealed frames (its Open and its
    // call) to B: they fail their sequence numbers, and B closes.
    relay.tamper(Tamper::Replay).await;
    until("B counts the forged session", || {
        b.forged_connections() == 1
    })
    .await;
    assert_eq!(calls.load(Ordering::SeqCst), 1, "a replayed call ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_drops_a_member_and_speaks_for_itself_gets_no_call_through() {
    use ferry::control::Service;
    use ferry::control::frame::{ControlCodec, Frame};
    use tokio_util::codec::Encoder;

    let (a, b) = (member(true).await, member(true).await);
    let calls = counted(&b);
    let relay = Relay::to(b.addr().endpoint).await;
    a.call(relay.posing_as(&b), "count", Bytes::new(), DEADLINE)
        .await
        .unwrap();
    // The relay's own call, as A's session's next frame: what a process
    // without the secret can make.
    let mut call = bytes::BytesMut::new();
    let frame = Frame::Request {
        id: 1 << 40,
        service: Service::RPC,
        deadline: DEADLINE,
        body: ferry::control::rpc::encode_call("count", &Bytes::new()),
    };
    ControlCodec::default().encode(frame, &mut call).unwrap();
    relay.tamper(Tamper::Inject(call.to_vec())).await;
    until("B counts the forged session", || {
        b.forged_connections() == 1
    })
    .await;
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the relay's call ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_frame_altered_on_the_way_closes_the_session() {
    let (a, b) = (member(true).await, member(true).await);
    let calls = counted(&b);
    let relay = Relay::to(b.addr().endpoint).await;
    let via = relay.posing_as(&b);
    a.call(via, "count", Bytes::new(), DEADLINE).await.unwrap();
    relay.tamper(Tamper::Flip).await;
    // The next frame A sends arrives altered: B closes the session, so the
    // call fails (typed) instead of running with the altered bytes.
    let altered = a
        .call(via, "count", Bytes::from_static(b"body"), DEADLINE)
        .await;
    assert!(
        matches!(
            altered,
            Err(RpcError::ConnectionLost { .. } | RpcError::Unreachable { .. })
        ),
        "{altered:?}"
    );
    until("B counts the forged session", || {
        b.forged_connections() == 1
    })
    .await;
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_replays_a_members_writes_changes_no_byte() {
    let (a, b) = (member(true).await, member(true).await);
    let target = b.alloc(4096, Access::ReadWrite).await.unwrap();
    let relay = Relay::to(b.addr().endpoint).await;
    // B's handle, as a forged record would give it: B's id at the relay.
    let mut json = serde_json::to_value(target.remote()).unwrap();
    json["owner"]["endpoint"] = relay.addr.to_string().into();
    let through: RemoteBuffer = serde_json::from_value(json).unwrap();
    let src = a.alloc(4096, Access::ReadWrite).await.unwrap();
    src.write_at(0, &[7; 4096]).unwrap();
    a.submit(vec![RdmaOp::write(src.whole(), through.clone())], DEADLINE)
        .await
        .unwrap();
    assert_eq!(target.to_vec(), vec![7; 4096]);
    // B's bytes change; the relay then replays A's sealed write request:
    // B refuses it (a stale sequence number) and closes, the bytes stay.
    target.write_at(0, &[1; 4096]).unwrap();
    relay.tamper(Tamper::Replay).await;
    until("B counts the forged connection", || {
        b.forged_connections() >= 1
    })
    .await;
    assert_eq!(target.to_vec(), vec![1; 4096], "a replayed write landed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_writes_with_a_handles_token_changes_no_byte() {
    use ferry::tcp::frame::{Request, RequestKind};

    let (a, b) = (member(true).await, member(true).await);
    let target = b.alloc(4096, Access::ReadWrite).await.unwrap();
    let relay = Relay::to(b.addr().endpoint).await;
    let handle = target.remote();
    let mut json = serde_json::to_value(&handle).unwrap();
    json["owner"]["endpoint"] = relay.addr.to_string().into();
    let through: RemoteBuffer = serde_json::from_value(json).unwrap();
    let src = a.alloc(4096, Access::ReadWrite).await.unwrap();
    src.write_at(0, &[7; 4096]).unwrap();
    a.submit(vec![RdmaOp::write(src.whole(), through)], DEADLINE)
        .await
        .unwrap();
    target.write_at(0, &[1; 4096]).unwrap();
    // The relay holds the handle (it forged the record that sent A to it),
    // token included: its own write request, on A's connection.
    let request = Request {
        kind: RequestKind::Write,
        id: 1 << 40,
        region: handle.region(),
        generation: handle.generation(),
        addr: handle.addr(),
        len: 4096,
        token: handle.transports().tcp.unwrap().token,
        scopes: Default::default(),
        tag: 0,
    };
    let mut bytes = request.encode().to_vec();
    bytes.extend_from_slice(&[0xEE; 4096]);
    relay.tamper(Tamper::Inject(bytes)).await;
    until("B counts the forged connection", || {
        b.forged_connections() >= 1
    })
    .await;
    assert_eq!(target.to_vec(), vec![1; 4096], "the relay's write landed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_meant_for_another_node_or_bounced_back_is_refused() {
    let (a, b) = (member(true).await, member(true).await);
    // A dials what it believes is B, and the relay bounces it to A itself:
    // A's endpoint refuses a hello meant for B, before any proof.
    let bounce = Relay::to(a.addr().endpoint).await;
    let dialer = Dialer::new(a.addr().id, Some(ClusterSecret::new(SECRET).unwrap()));
    let bounced = dialer
        .connect(bounce.posing_as(&b), ferry::control::Channel::CONTROL)
        .await;
    assert!(
        matches!(bounced, Err(ControlError::WrongNode { expected, .. }) if expected == b.addr().id),
        "{bounced:?}"
    );
    // A hello claiming the node's own id, meant for it (a reflection): refused.
    let reflected = dialer
        .connect(a.addr(), ferry::control::Channel::CONTROL)
        .await;
    assert!(
        matches!(
            reflected,
            Err(ControlError::Refused {
                status: Some(HelloStatus::Reflected),
                ..
            })
        ),
        "{reflected:?}"
    );
    assert_eq!(a.forged_connections(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_a_leaked_secret_ends_what_its_holder_opened() {
    let owner = member(true).await;
    // A holder of the secret that leaked: a control session and TCP data
    // connections open to the owner.
    let holder = member(true).await;
    let calls = counted(&owner);
    holder
        .call(owner.addr(), "count", Bytes::new(), DEADLINE)
        .await
        .unwrap();
    let target = owner.alloc(4096, Access::ReadWrite).await.unwrap();
    let src = holder.alloc(4096, Access::ReadWrite).await.unwrap();
    holder
        .submit(vec![RdmaOp::write(src.whole(), target.remote())], DEADLINE)
        .await
        .unwrap();
    // Rolled with revocation: what proved the old secret is closed now,
    // not when it next reconnects.
    let new = ClusterSecret::new("the secret after the leak, 32 B").unwrap();
    let closed = owner.revoke_cluster_secret(Some(new));
    assert!(
        closed >= 2,
        "closed {closed}: the session and a data connection"
    );
    // The holder may send once more on the session before it sees it
    // closed (`ConnectionLost`); its next session is refused at the hello.
    let start = std::time::Instant::now();
    loop {
        let after = holder
            .call(owner.addr(), "count", Bytes::new(), DEADLINE)
            .await;
        match after {
            Err(RpcError::AuthFailed { .. }) => break,
            Err(RpcError::ConnectionLost { .. }) => {
                assert!(start.elapsed() < DEADLINE, "never refused at the hello")
            }
            other => panic!("a call under the revoked secret: {other:?}"),
        }
    }
    let write = holder
        .submit(vec![RdmaOp::write(src.whole(), target.remote())], DEADLINE)
        .await;
    assert!(
        write.is_err(),
        "a write under the revoked secret went through"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}
