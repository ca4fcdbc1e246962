//! Endpoints on loopback: hellos, control sessions and their services,
//! channel hand-off, and the connection limits.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use ferry_control::frame::{ControlCodec, Frame, SESSION_VERSIONS};
use ferry_control::hello::{HELLO_LEN, Hello, HelloReply};
use ferry_control::{
    Channel, ConnectionLimits, ControlError, DEFAULT_MAX_FRAME, EVICTABLE_AFTER, Endpoint,
    EndpointConfig, EndpointError, HelloStatus, Service, ServiceError,
};
use ferry_core::{NodeAddr, NodeId};
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_util::codec::Framed;

const T: Duration = Duration::from_secs(10);
const ECHO: Service = Service(100);
const SLOW: Service = Service(101);
const FAIL: Service = Service(102);

#[path = "endpoint/limits.rs"]
mod limits;
#[path = "endpoint/tells.rs"]
mod tells;

async fn endpoint_with(config: EndpointConfig) -> Endpoint {
    let endpoint = Endpoint::bind(
        "127.0.0.1:0".parse().unwrap(),
        None,
        NodeId::random(),
        config,
    )
    .await
    .unwrap();
    endpoint
        .serve(ECHO, |r| async move {
            let mut answer = b"echo: ".to_vec();
            answer.extend_from_slice(&r.body);
            Ok(Bytes::from(answer))
        })
        .unwrap();
    endpoint
        .serve(SLOW, |_| async move {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok(Bytes::new())
        })
        .unwrap();
    endpoint
        .serve(FAIL, |r| async move {
            Err(ServiceError(format!("refused {} bytes", r.body.len())))
        })
        .unwrap();
    endpoint.start();
    endpoint
}

async fn endpoint() -> Endpoint {
    endpoint_with(EndpointConfig::default()).await
}

#[tokio::test]
async fn requests_are_answered_and_failures_are_typed() {
    let (a, b) = (endpoint().await, endpoint().await);
    let session = a.session(b.local(), T).await.unwrap();
    assert_eq!(session.peer(), b.local());
    assert_eq!(session.version(), SESSION_VERSIONS.1);
    let answer = session.request(ECHO, &b"hi"[..], T).await.unwrap();
    assert_eq!(&answer[..], b"echo: hi");

    // The same session serves every caller.
    assert_eq!(a.session(b.local(), T).await.unwrap().id(), session.id());

    assert_eq!(
        session.request(FAIL, &b"abc"[..], T).await,
        Err(ControlError::Failed {
            endpoint: b.local().endpoint,
            service: FAIL,
            message: "refused 3 bytes".into()
        })
    );
    assert_eq!(
        session.request(Service(999), Bytes::new(), T).await,
        Err(ControlError::NoSuchService {
            endpoint: b.local().endpoint,
            service: Service(999)
        })
    );
    let short = Duration::from_millis(200);
    assert_eq!(
        session.request(SLOW, Bytes::new(), short).await,
        Err(ControlError::Timeout {
            endpoint: b.local().endpoint,
            service: SLOW,
            after: short
        })
    );
    // The session survived all of that.
    assert!(session.request(ECHO, Bytes::new(), T).await.is_ok());
}

#[tokio::test]
async fn many_concurrent_requests_are_told_apart_by_id() {
    let (a, b) = (endpoint().await, endpoint().await);
    let session = a.session(b.local(), T).await.unwrap();
    let calls = (0..200u32).map(|i| {
        let session = session.clone();
        tokio::spawn(async move {
            let body = i.to_le_bytes().to_vec();
            let answer = session.request(ECHO, body.clone(), T).await.unwrap();
            assert_eq!(&answer[6..], &body[..], "answer to call {i}");
        })
    });
    for call in calls {
        call.await.unwrap();
    }
}

#[tokio::test]
async fn too_many_requests_in_flight_are_answered_busy() {
    let config = EndpointConfig {
        max_requests_in_flight: 2,
        ..Default::default()
    };
    let (a, b) = (endpoint().await, endpoint_with(config).await);
    let session = a.session(b.local(), T).await.unwrap();
    // Handlers that never finish: exactly two run, the rest are refused.
    let calls: Vec<_> = (0..5)
        .map(|_| {
            let session = session.clone();
            tokio::spawn(async move { session.request(SLOW, Bytes::new(), T).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let busy = calls.iter().filter(|c| c.is_finished()).count();
    assert_eq!(busy, 3);
    for call in calls {
        if call.is_finished() {
            assert!(matches!(
                call.await.unwrap(),
                Err(ControlError::Busy { service: SLOW, .. })
            ));
        } else {
            call.abort();
        }
    }
}

#[tokio::test]
async fn a_session_to_the_wrong_node_is_refused() {
    let b = endpoint().await;
    let a = endpoint().await;
    let impostor = NodeAddr {
        id: NodeId(b.local().id.0 ^ 1),
        endpoint: b.local().endpoint,
    };
    match a.session(impostor, T).await {
        Err(ControlError::WrongNode { expected, .. }) => {
            // Refused by the node there, which names nobody.
            assert_eq!(expected, impostor.id);
        }
        other => panic!("expected WrongNode, got {other:?}"),
    }
    // Nobody listens: unreachable, not a hang.
    let closed: SocketAddr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let nowhere = NodeAddr {
        id: NodeId::random(),
        endpoint: closed,
    };
    assert!(matches!(
        a.session(nowhere, T).await,
        Err(ControlError::Unreachable { endpoint, .. }) if endpoint == closed
    ));
}

#[tokio::test]
async fn a_dropped_peer_closes_the_session_and_fails_its_requests() {
    let (a, b) = (endpoint().await, endpoint().await);
    let session = a.session(b.local(), T).await.unwrap();
    let waiting = tokio::spawn({
        let session = session.clone();
        async move { session.request(SLOW, Bytes::new(), T).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let peer = b.local();
    drop(b);
    tokio::time::timeout(T, session.closed())
        .await
        .expect("the session notices its peer is gone");
    assert_eq!(
        waiting.await.unwrap(),
        Err(ControlError::SessionClosed {
            endpoint: peer.endpoint
        })
    );
    assert!(matches!(
        session.request(ECHO, Bytes::new(), T).await,
        Err(ControlError::SessionClosed { .. })
    ));
    // A new session is not to be had from a dropped endpoint.
    assert!(a.session(peer, Duration::from_secs(2)).await.is_err());
}

/// A raw control connection to `to` that has said hello and exchanged
/// `Open` frames: the next bytes written are frames of the session.
async fn raw_session(to: &Endpoint) -> TcpStream {
    raw_session_up_to(to, SESSION_VERSIONS.1).await
}

/// [`raw_session`], speaking session versions up to `max_version`.
async fn raw_session_up_to(to: &Endpoint, max_version: u16) -> TcpStream {
    let raw = TcpStream::connect(to.local().endpoint).await.unwrap();
    raw_session_on(raw, to.local().id, max_version).await
}

/// [`raw_session_up_to`] on a connection made already, to node `to`.
async fn raw_session_on(mut raw: TcpStream, to: NodeId, max_version: u16) -> TcpStream {
    let hello = Hello::new(Channel::CONTROL, NodeId::random(), to);
    raw.write_all(&hello.encode()).await.unwrap();
    let mut reply = [0; HelloReply::LEN];
    raw.read_exact(&mut reply).await.unwrap();
    let reply: [u8; HELLO_LEN] = reply[..HELLO_LEN].try_into().unwrap();
    assert_eq!(HelloReply::decode(&reply).unwrap().status, HelloStatus::Ok);
    let mut framed = Framed::new(raw, ControlCodec::default());
    framed
        .send(Frame::Open {
            min_version: 1,
            max_version,
            node: NodeAddr {
                id: hello.node,
                endpoint: "127.0.0.1:9".parse().unwrap(),
            },
        })
        .await
        .unwrap();
    assert!(matches!(framed.next().await, Some(Ok(Frame::Open { .. }))));
    framed.into_inner()
}

/// A length-prefixed frame of `len` bytes: `kind`, then zeros.
fn frame_bytes(kind: u8, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; 4 + len];
    bytes[..4].copy_from_slice(&(len as u32).to_be_bytes());
    if len > 0 {
        bytes[4] = kind;
    }
    bytes
}

/// Every kind of bad frame ends that session (the endpoint hangs up); the
/// endpoint goes on serving everyone else.
#[tokio::test]
async fn a_malformed_frame_ends_only_its_own_session() {
    let b = endpoint().await;
    let a = endpoint().await;
    let good = a.session(b.local(), T).await.unwrap();
    let mut response_never_sent = frame_bytes(3, 16);
    response_never_sent[4 + 8..4 + 16].copy_from_slice(&999u64.to_le_bytes());
    let mut oversized = vec![0u8; 4];
    oversized.copy_from_slice(&((DEFAULT_MAX_FRAME + 1) as u32).to_be_bytes());
    let bad: [(&str, Vec<u8>); 5] = [
        ("unknown kind", frame_bytes(0xEE, 16)),
        ("truncated cancel", frame_bytes(4, 5)),
        ("truncated request", frame_bytes(2, 9)),
        ("length over the frame limit", oversized),
        ("response to a request never sent", response_never_sent),
    ];
    for (what, bytes) in bad {
        let mut raw = raw_session(&b).await;
        raw.write_all(&bytes).await.unwrap();
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(T, raw.read_to_end(&mut rest)).await;
        assert!(closed.is_ok(), "{what}: the endpoint did not hang up");
        assert!(good.request(ECHO, Bytes::new(), T).await.is_ok(), "{what}");
    }
    // A Cancel of a request that is not running is no error: it may have
    // finished just before the caller gave up.
    let mut raw = raw_session(&b).await;
    let mut cancel = frame_bytes(4, 16);
    cancel[4 + 8..4 + 16].copy_from_slice(&5u64.to_le_bytes());
    raw.write_all(&cancel).await.unwrap();
    let mut byte = [0u8; 1];
    let still_open = tokio::time::timeout(Duration::from_millis(300), raw.read(&mut byte)).await;
    assert!(still_open.is_err(), "a stray Cancel ended the session");
}

#[tokio::test]
async fn sessions_of_incompatible_versions_are_refused_with_the_reason() {
    let b = endpoint().await;
    let mut raw = TcpStream::connect(b.local().endpoint).await.unwrap();
    let hello = Hello::new(Channel::CONTROL, NodeId::random(), b.local().id);
    raw.write_all(&hello.encode()).await.unwrap();
    let mut reply = [0; HelloReply::LEN];
    raw.read_exact(&mut reply).await.unwrap();
    let mut framed = Framed::new(raw, ControlCodec::default());
    let future = SESSION_VERSIONS.1 + 1;
    framed
        .send(Frame::Open {
            min_version: future,
            max_version: future + 1,
            node: NodeAddr {
                id: hello.node,
                endpoint: "127.0.0.1:9".parse().unwrap(),
            },
        })
        .await
        .unwrap();
    // It still answers with what it speaks, then hangs up.
    match framed.next().await {
        Some(Ok(Frame::Open { max_version, .. })) => assert_eq!(max_version, SESSION_VERSIONS.1),
        other => panic!("expected an Open, got {other:?}"),
    }
    assert!(
        tokio::time::timeout(T, framed.next())
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn data_channels_go_to_their_handler_and_others_are_refused() {
    let b = Endpoint::bind(
        "127.0.0.1:0".parse().unwrap(),
        None,
        NodeId::random(),
        EndpointConfig::default(),
    )
    .await
    .unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    b.handle(Channel::TCP_DATA, {
        let seen = seen.clone();
        move |mut c: ferry_control::Connection| {
            let seen = seen.clone();
            async move {
                seen.fetch_add(1, Ordering::SeqCst);
                let mut byte = [0];
                c.stream.read_exact(&mut byte).await.unwrap();
                c.stream.write_all(&[byte[0] + 1]).await.unwrap();
            }
        }
    })
    .unwrap();
    assert!(matches!(
        b.handle(Channel::TCP_DATA, |_| async {}),
        Err(EndpointError::ChannelTaken(Channel::TCP_DATA))
    ));
    assert!(matches!(
        b.handle(Channel::CONTROL, |_| async {}),
        Err(EndpointError::ChannelTaken(Channel::CONTROL))
    ));
    b.start();
    let me = NodeId::random();
    let mut stream = ferry_control::Dialer::new(me, None)
        .connect(b.local(), Channel::TCP_DATA)
        .await
        .unwrap()
        .stream;
    stream.write_all(&[41]).await.unwrap();
    let mut answer = [0];
    stream.read_exact(&mut answer).await.unwrap();
    assert_eq!(answer, [42]);
    assert_eq!(seen.load(Ordering::SeqCst), 1);

    assert_eq!(
        ferry_control::Dialer::new(me, None)
            .connect(b.local(), Channel(77))
            .await
            .err(),
        Some(ControlError::Refused {
            endpoint: b.local().endpoint,
            status: Some(HelloStatus::BadChannel)
        })
    );
}

#[tokio::test]
async fn advertised_addresses_never_carry_an_unspecified_ip() {
    let any: SocketAddr = "0.0.0.0:0".parse().unwrap();
    let id = NodeId::random();
    let config = EndpointConfig::default();
    assert!(matches!(
        Endpoint::bind(any, None, id, config).await,
        Err(EndpointError::Unadvertised { listen }) if listen == any
    ));
    assert!(matches!(
        Endpoint::bind("[::]:0".parse().unwrap(), None, id, config).await,
        Err(EndpointError::Unadvertised { .. })
    ));
    assert!(matches!(
        Endpoint::bind("127.0.0.1:0".parse().unwrap(), Some(any), id, config).await,
        Err(EndpointError::UnspecifiedAdvertise { .. })
    ));
    // Port 0 in the advertised address means the port actually bound.
    let advertised = "127.0.0.1:0".parse().unwrap();
    let e = Endpoint::bind(any, Some(advertised), id, config)
        .await
        .unwrap();
    assert_eq!(e.local().endpoint.ip(), advertised.ip());
    assert_ne!(e.local().endpoint.port(), 0);
    e.start();
    // Reachable at what it advertises.
    let client = endpoint().await;
    assert!(client.session(e.local(), T).await.is_ok());
}

#[tokio::test]
async fn shutdown_ends_sessions_and_stops_the_listener() {
    let (a, b) = (endpoint().await, endpoint().await);
    let session = a.session(b.local(), T).await.unwrap();
    b.shutdown();
    tokio::time::timeout(T, session.closed())
        .await
        .expect("session ends");
    let mut refused = false;
    for _ in 0..100 {
        if TcpStream::connect(b.local().endpoint).await.is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(refused, "the listener closed");
}
