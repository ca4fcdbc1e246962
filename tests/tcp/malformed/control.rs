//! The attacks on the endpoint's hello and on its control channel.

use std::collections::HashSet;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use ferry::control::frame::{ControlCodec, Frame, SESSION_VERSIONS, Service};
use ferry::control::hello::{HELLO_LEN, Hello, HelloReply, MAGIC, VERSION};
use ferry::control::{Channel, HelloStatus};
use ferry::{NodeAddr, NodeId};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::codec::{Decoder, Encoder};

use super::{Sent, WAIT, bytes, connect, junk, open, rest};

/// One connection's hello: garbage, cut short, a wrong version, an unknown
/// channel, or an identify. Each gets its answer (or none) and a hang-up.
pub(super) async fn hello_round(rng: &mut fastrand::Rng, owner: NodeAddr, sent: &mut Sent) {
    let mut s = connect(owner.endpoint).await;
    let mut hello = Hello::new(Channel::IDENTIFY, NodeId(rng.u128(..)), NodeId(0)).encode();
    let mut len = hello.len();
    let expected = match rng.u8(..8) {
        0 => {
            rng.fill(&mut hello);
            if hello[..4] == MAGIC.to_le_bytes() {
                hello[0] ^= 1;
            }
            None
        }
        1 => {
            let cut = rng.usize(..Hello::LEN);
            s.write_all(&hello[..cut]).await.unwrap();
            s.shutdown().await.unwrap();
            assert!(rest(&mut s).await.is_empty());
            sent.hellos += 1;
            return;
        }
        2 => {
            let version = rng.u16(..);
            hello[4..6].copy_from_slice(&version.to_le_bytes());
            // A node of another version sends another length: the header,
            // all a refusal reads.
            len = HELLO_LEN;
            (version != VERSION).then_some(HelloStatus::BadVersion)
        }
        3 => {
            hello[6] = rng.u8(4..);
            Some(HelloStatus::BadChannel)
        }
        // An authenticated hello (a node with a cluster secret): this node
        // has none, and says so.
        4 => {
            hello[7] = 1;
            rng.fill(&mut hello[HELLO_LEN + 16..]);
            Some(HelloStatus::NoSecret)
        }
        // Meant for another node (a relayed hello), or claiming to be this
        // one (a reflected one).
        5 => {
            hello[6] = Channel::CONTROL.0;
            let other = NodeId(owner.id.0 ^ rng.u128(1..));
            hello[HELLO_LEN..HELLO_LEN + 16].copy_from_slice(&other.0.to_le_bytes());
            Some(HelloStatus::WrongNode)
        }
        6 => {
            hello[6] = Channel::CONTROL.0;
            hello[8..24].copy_from_slice(&owner.id.0.to_le_bytes());
            hello[HELLO_LEN..HELLO_LEN + 16].copy_from_slice(&owner.id.0.to_le_bytes());
            Some(HelloStatus::Reflected)
        }
        _ => Some(HelloStatus::Ok),
    };
    s.write_all(&hello[..len]).await.unwrap();
    let answer = rest(&mut s).await;
    match expected {
        None if hello[..4] != MAGIC.to_le_bytes() => assert!(answer.is_empty()),
        // A random version that happens to be this one: an identify.
        expected => {
            let reply = HelloReply::decode(answer[..HELLO_LEN].try_into().unwrap()).unwrap();
            assert_eq!(reply.status, expected.unwrap_or(HelloStatus::Ok));
            // A refusal names no node.
            let named = if reply.status == HelloStatus::Ok {
                owner.id
            } else {
                NodeId(0)
            };
            assert_eq!(reply.node, named);
        }
    }
    sent.hellos += 1;
}

/// The node's side of a control connection, as this client reads it.
struct Incoming {
    buf: BytesMut,
    /// Keeps its state between calls: it may have taken a frame's length
    /// prefix out of `buf` already.
    codec: ControlCodec,
}

/// The next control frame the node sends; `None` once it hangs up.
async fn next_frame(s: &mut TcpStream, incoming: &mut Incoming) -> Option<Frame> {
    let Incoming { buf, codec } = incoming;
    loop {
        if let Some(frame) = codec.decode(buf).expect("the node's frames parse") {
            return Some(frame);
        }
        match tokio::time::timeout(WAIT, s.read_buf(buf)).await {
            Ok(Ok(0)) => {
                assert!(buf.is_empty(), "the node hung up mid-frame");
                assert!(codec.decode_eof(buf).unwrap().is_none());
                return None;
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
            Ok(Err(e)) => panic!("{e}"),
            Err(_) => panic!("the node neither answered nor hung up"),
        }
    }
}

fn framed(frame: Frame) -> BytesMut {
    let mut out = BytesMut::new();
    ControlCodec::default().encode(frame, &mut out).unwrap();
    out
}

/// A length prefix and whatever follows it.
fn prefixed(len: u32, body: &[u8]) -> Vec<u8> {
    let mut out = len.to_be_bytes().to_vec();
    out.extend_from_slice(body);
    out
}

/// One control connection, claiming a random node or the well-behaved one:
/// garbage before the session's `Open`, or a proper session whose requests
/// to every service (with junk bodies) must each be answered, ended by a
/// frame that breaks the protocol or by a hang-up.
pub(super) async fn control_round(
    rng: &mut fastrand::Rng,
    owner: NodeAddr,
    good: NodeAddr,
    sent: &mut Sent,
) {
    let claimed = if rng.bool() {
        good
    } else {
        NodeAddr {
            id: NodeId(rng.u128(..)),
            endpoint: "127.0.0.1:9".parse().unwrap(),
        }
    };
    let (mut s, reply) = open(owner, Channel::CONTROL, claimed.id).await;
    assert_eq!(reply.status, HelloStatus::Ok);
    let mut incoming = Incoming {
        buf: BytesMut::new(),
        codec: ControlCodec::default(),
    };
    let open = |min_version, max_version| Frame::Open {
        min_version,
        max_version,
        node: claimed,
    };
    if rng.u8(..3) == 0 {
        // The node answers a well-formed first frame with its Open even
        // when it cannot go on, so that the opener learns why.
        let (wire, answered) = match rng.u8(..5) {
            0 => (framed(Frame::Cancel { id: 1 }).to_vec(), true),
            1 => {
                let min = rng.u16(SESSION_VERSIONS.1 + 1..);
                (framed(open(min, rng.u16(min..))).to_vec(), true)
            }
            2 => {
                let mut body = framed(open(1, 2)).to_vec();
                body[4 + 16 + 4 + 16] = [0, 5, rng.u8(7..)][rng.usize(..3)];
                (body, false)
            }
            3 => (prefixed(rng.u32((1 << 20) + 1..), &bytes(rng, 16)), false),
            _ => {
                let mut body = framed(open(1, 2)).to_vec();
                body.truncate(rng.usize(1..body.len()));
                (body, false)
            }
        };
        s.write_all(&wire).await.unwrap();
        s.shutdown().await.unwrap();
        sent.control_frames += 1;
        if answered {
            let frame = next_frame(&mut s, &mut incoming).await;
            assert!(
                matches!(frame, Some(Frame::Open { node, .. }) if node == owner),
                "{frame:?}"
            );
        }
        assert_eq!(next_frame(&mut s, &mut incoming).await, None);
        return;
    }

    s.write_all(&framed(open(1, SESSION_VERSIONS.1)))
        .await
        .unwrap();
    let frame = next_frame(&mut s, &mut incoming).await;
    assert!(
        matches!(frame, Some(Frame::Open { node, .. }) if node == owner),
        "{frame:?}"
    );
    let requests = rng.u64(1..=12);
    let mut wire = BytesMut::new();
    for id in 0..requests {
        let (service, body) = match rng.u8(..7) {
            0 => {
                let len = rng.usize(..20);
                let name: String = std::iter::repeat_with(|| rng.alphanumeric())
                    .take(len)
                    .collect();
                (Service::RPC, ferry::control::rpc::encode_call(&name, b"x"))
            }
            1 => {
                let body: &[&[u8]] = &[b"", b"[\"kv\"]", b"[1,", b"\xff"];
                (Service::METADATA, Bytes::from_static(body[rng.usize(..4)]))
            }
            2 => (Service::MESSAGE, junk(rng, 64).into()),
            3 => (Service::NOTIFY, junk(rng, 64).into()),
            4 => (Service::IBVERBS_CONNECT, junk(rng, 39).into()),
            5 => (Service::IBVERBS_CREDITS, bytes(rng, 7).into()),
            _ => (Service(rng.u16(7..)), junk(rng, 300).into()),
        };
        let deadline = Duration::from_millis(rng.u64(50..300));
        ControlCodec::default()
            .encode(
                Frame::Request {
                    id,
                    service,
                    deadline,
                    body,
                },
                &mut wire,
            )
            .unwrap();
        if rng.u8(..4) == 0 {
            let id = rng.u64(1 << 20..);
            ControlCodec::default()
                .encode(Frame::Cancel { id }, &mut wire)
                .unwrap();
        }
        // Tells of anything to anyone: handled or dropped, never answered.
        if rng.u8(..4) == 0 {
            let tell = Frame::Tell {
                service: Service(rng.u16(..10)),
                deadline: Duration::from_millis(rng.u64(..300)),
                body: junk(rng, 64).into(),
            };
            ControlCodec::default().encode(tell, &mut wire).unwrap();
        }
    }
    s.write_all(&wire).await.unwrap();
    sent.control_frames += requests as usize;
    let mut answered = HashSet::new();
    while answered.len() < requests as usize {
        match next_frame(&mut s, &mut incoming).await {
            Some(Frame::Response { id, .. }) if id < requests => {
                assert!(answered.insert(id), "request {id} answered twice")
            }
            other => panic!("expected a response, got {other:?}"),
        }
    }
    // An end that breaks the protocol: the node ends the session.
    let id = rng.u64(..);
    let header = |kind: u8, status: u8| {
        let mut out = vec![kind, status];
        out.extend_from_slice(&[0; 6]);
        out.extend_from_slice(&id.to_le_bytes());
        out
    };
    let end = match rng.u8(..6) {
        0 => Vec::new(),
        1 => prefixed(16, &header(rng.u8(6..), 0)),
        2 => prefixed(16, &header(3, rng.u8(5..))),
        3 => prefixed(16, &header(3, 0)),
        4 => framed(open(1, 2)).to_vec(),
        _ => prefixed(rng.u32((1 << 20) + 1..), &[]),
    };
    s.write_all(&end).await.unwrap();
    s.shutdown().await.unwrap();
    sent.control_frames += 1;
    assert_eq!(next_frame(&mut s, &mut incoming).await, None);
}
