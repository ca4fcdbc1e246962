//! What each fuzz target asserts about its decoder, one function per target.
//!
//! Every decoder here reads bytes another node (or whoever reaches its
//! listener) chose. The rule they share: a typed error or a value, never a
//! panic; and a value must survive its own encoder (decode → encode →
//! decode gives it back), so that what a node accepts is what it would
//! send. Each function panics when a rule breaks; it returns how many
//! values the input decoded to, so that the seed test can tell a valid seed
//! from one the decoder refuses.
//!
//! This file is shared: the fuzz targets in `fuzz/fuzz_targets/` call it,
//! and `tests/fuzz_corpus.rs` in the main workspace includes it to replay
//! every seed and regression input without cargo-fuzz.

use bytes::{Bytes, BytesMut};
use ferry_control::HelloStatus;
use ferry_control::frame::{self, ControlCodec, Frame};
use ferry_control::hello::{HELLO_LEN, Hello, HelloReply};
use ferry_core::{Descs, RemoteBuffer, RemoteDescList};
use ferry_discovery::NodeMetadata;
use ferry_tcp::frame::{ClientFrame, MAX_CHUNK, REQUEST_LEN, RESPONSE_LEN, Response};
use tokio_util::codec::{Decoder, Encoder};

/// A fuzz target's check.
pub type Check = fn(&[u8]) -> usize;

/// Every target by name: the names of `fuzz/fuzz_targets/*.rs` and of the
/// directories under `fuzz/corpus/` and `fuzz/regressions/`.
pub const TARGETS: &[(&str, Check)] = &[
    ("tcp_client_stream", tcp_client_stream),
    ("tcp_response_stream", tcp_response_stream),
    ("control_stream", control_stream),
    ("hello", hello),
    ("rpc_call", rpc_call),
    ("ibverbs_wire", ibverbs_wire),
    ("memory_wire", memory_wire),
    ("metadata", metadata),
    ("handle_json", handle_json),
    ("desc_list_json", desc_list_json),
];

/// A data connection as the owner reads it (`ferry-tcp`'s server): request
/// and notification headers, each followed by the payload its length
/// announces; a ranges request by its table, which must add up to its
/// header's length. A header or table that does not parse ends the stream,
/// as it ends the connection, and a header must still name the request id
/// for the error response.
pub fn tcp_client_stream(data: &[u8]) -> usize {
    let mut rest = data;
    let mut decoded = 0;
    let mut ranges = Vec::new();
    while let Some((header, tail)) = rest.split_first_chunk::<REQUEST_LEN>() {
        let id = u64::from_le_bytes(header[8..16].try_into().unwrap());
        match ClientFrame::decode(header) {
            Ok(mut frame) => {
                assert_eq!(ClientFrame::decode(&frame.encode()), Ok(frame));
                assert_eq!(frame.id(), id);
                assert!(frame.bytes() <= MAX_CHUNK, "{frame:?} over MAX_CHUNK");
                // A scoped request's scopes come first; ones cut short or
                // that do not parse end the stream.
                let mut tail = tail;
                if frame.scopes_len() > 0 {
                    let Some((scopes, more)) = tail.split_at_checked(frame.scopes_len()) else {
                        break;
                    };
                    if frame.read_scopes(scopes).is_err() {
                        break;
                    }
                    tail = more;
                }
                if let ClientFrame::Ranges(request) = frame {
                    let table = &tail[..request.table_len().min(tail.len())];
                    if request.decode_table(table, &mut ranges).is_err() {
                        break;
                    }
                    assert_eq!(ranges.len(), request.count as usize);
                    let total: u64 = ranges.iter().map(|r| r.len).sum();
                    assert_eq!(total, request.len, "the table adds up");
                }
                let payload = usize::try_from(frame.payload_len()).unwrap();
                rest = &tail[payload.min(tail.len())..];
                decoded += 1;
            }
            Err((error_id, _)) => {
                assert_eq!(error_id, id, "the error response names the request");
                break;
            }
        }
    }
    decoded
}

/// A data connection as the initiator reads it (`ferry-tcp`'s client):
/// response headers, read data following `ReadData`. An owner is as
/// untrusted as any peer.
pub fn tcp_response_stream(data: &[u8]) -> usize {
    let mut rest = data;
    let mut decoded = 0;
    while let Some((header, tail)) = rest.split_first_chunk::<RESPONSE_LEN>() {
        let Ok(response) = Response::decode(header) else {
            break;
        };
        assert_eq!(Response::decode(&response.encode()), Ok(response));
        let payload = match response {
            Response::ReadData { len, .. } => {
                assert!(len <= MAX_CHUNK, "{response:?} over MAX_CHUNK");
                usize::try_from(len).unwrap()
            }
            _ => 0,
        };
        rest = &tail[payload.min(tail.len())..];
        decoded += 1;
    }
    decoded
}

/// A control session's byte stream through the session's own codec
/// (length prefix, bound, frame parse), then the same bytes as one
/// unprefixed frame.
pub fn control_stream(data: &[u8]) -> usize {
    // A small bound, so that inputs can reach the "frame too long" path.
    let mut codec = ControlCodec::new(4096);
    let mut buf = BytesMut::from(data);
    let mut decoded = 0;
    loop {
        match codec.decode(&mut buf) {
            Ok(Some(frame)) => {
                control_round_trip(frame);
                decoded += 1;
            }
            Ok(None) => {
                // End of stream: what is left is a truncated frame or nothing.
                if let Ok(Some(frame)) = codec.decode_eof(&mut buf) {
                    control_round_trip(frame);
                    decoded += 1;
                }
                break;
            }
            Err(_) => break,
        }
    }
    if let Ok(frame) = frame::parse(Bytes::copy_from_slice(data)) {
        control_round_trip(frame);
        decoded += 1;
    }
    decoded
}

fn control_round_trip(frame: Frame) {
    assert_eq!(frame::parse(frame::serialize(&frame)).unwrap(), frame);
    let mut codec = ControlCodec::new(usize::MAX);
    let mut wire = BytesMut::new();
    codec.encode(frame.clone(), &mut wire).unwrap();
    assert_eq!(codec.decode(&mut wire).unwrap(), Some(frame));
    assert!(wire.is_empty(), "the codec consumed the whole frame");
}

/// The endpoint's hellos (56-byte frames) and, read again as replies, the
/// same bytes in 88-byte frames: a 24-byte header, and the nonce and tag
/// that follow one that takes the connection.
pub fn hello(data: &[u8]) -> usize {
    let mut decoded = 0;
    for chunk in data.chunks_exact(Hello::LEN) {
        if let Ok(hello) = Hello::decode(chunk.try_into().unwrap()) {
            assert_eq!(Hello::decode(&hello.encode()), Ok(hello));
            decoded += 1;
        }
    }
    for chunk in data.chunks_exact(HelloReply::LEN) {
        let Ok(reply) = HelloReply::decode(chunk[..HELLO_LEN].try_into().unwrap()) else {
            continue;
        };
        let reply = match reply.status {
            HelloStatus::Ok => reply.with_tail(chunk[HELLO_LEN..].try_into().unwrap()),
            _ => reply,
        };
        let bytes = reply.encode();
        let again = HelloReply::decode(bytes[..HELLO_LEN].try_into().unwrap()).unwrap();
        let again = match again.status {
            HelloStatus::Ok => again.with_tail(bytes[HELLO_LEN..].try_into().unwrap()),
            _ => again,
        };
        assert_eq!(again, reply);
    }
    decoded
}

/// An RPC request body as the callee reads it. Its layout leaves nothing
/// ignored, so a decoded call re-encodes to exactly the input.
pub fn rpc_call(data: &[u8]) -> usize {
    let body = Bytes::copy_from_slice(data);
    match ferry_control::rpc::decode_call(&body) {
        Ok((name, argument)) => {
            assert_eq!(ferry_control::rpc::encode_call(&name, &argument), body);
            1
        }
        Err(_) => 0,
    }
}

/// The ibverbs queue-pair exchange: a QP details frame (first 40 bytes),
/// and as whole inputs a credit return, a rails answer, a pairs frame and a
/// lease release. Pure code: no device is opened.
pub fn ibverbs_wire(data: &[u8]) -> usize {
    use ferry_ibverbs::wire::{
        QP_INFO_LEN, QpInfo, decode_credits, decode_pairs, decode_rails, decode_release,
        encode_credits, encode_pairs, encode_rails, encode_release,
    };
    let mut decoded = 0;
    if let Some(slot) = decode_release(data) {
        assert_eq!(encode_release(slot)[..], data[..]);
        decoded += 1;
    }
    if let Some(pairs) = decode_pairs(data) {
        assert_eq!(decode_pairs(&encode_pairs(&pairs)).as_ref(), Some(&pairs));
        decoded += 1;
    }
    if let Some(rails) = decode_rails(data) {
        assert_eq!(decode_rails(&encode_rails(&rails)).as_ref(), Some(&rails));
        decoded += 1;
    }
    if let Some((bytes, _)) = data.split_first_chunk::<QP_INFO_LEN>()
        && let Some(info) = QpInfo::decode(bytes)
    {
        assert_eq!(QpInfo::decode(&info.encode()), Some(info));
        decoded += 1;
    }
    if let Some((qpn, count)) = decode_credits(data) {
        assert_eq!(encode_credits(qpn, count)[..], data[..]);
        decoded += 1;
    }
    decoded
}

/// The memory transport's setup packets, as the owner reads a request and
/// the peer reads an answer. The input is offered whole to each decoder,
/// as a datagram would be.
pub fn memory_wire(data: &[u8]) -> usize {
    use ferry_memory::wire::{Answer, LaneAck, LaneOpen, Reply, Request};
    let mut decoded = 0;
    if let Some(open) = LaneOpen::decode(data) {
        assert_eq!(LaneOpen::decode(&open.encode()), Some(open));
        decoded += 1;
    }
    if let Some(ack) = LaneAck::decode(data) {
        assert_eq!(LaneAck::decode(&ack.encode()), Some(ack));
        decoded += 1;
    }
    if let Some(request) = Request::decode(data) {
        assert_eq!(Request::decode(&request.encode()), Some(request));
        decoded += 1;
    }
    if let Some(answer) = Answer::decode(data) {
        assert_eq!(Answer::decode(&answer.encode()), Some(answer));
        decoded += 1;
    }
    if let Some(reply) = Reply::decode(data) {
        assert_eq!(Reply::decode(&reply.encode()), Some(reply));
        decoded += 1;
    }
    decoded
}

/// A node's metadata blob, as a peer or etcd hands it over. Beyond the
/// round trip, the decoder promises that every published handle belongs to
/// the node the blob describes.
pub fn metadata(data: &[u8]) -> usize {
    let Ok(metadata) = NodeMetadata::decode(data) else {
        return 0;
    };
    for handle in metadata.regions.values() {
        assert_eq!(handle.owner().id, metadata.node.id);
    }
    assert_eq!(NodeMetadata::decode(&metadata.encode()), Ok(metadata));
    1
}

/// A handle as JSON, as users pass them between processes. A forged one
/// must still round-trip, and its range checks must agree with each other
/// instead of overflowing.
pub fn handle_json(data: &[u8]) -> usize {
    let Ok(handle) = serde_json::from_slice::<RemoteBuffer>(data) else {
        return 0;
    };
    // Handed on, a handle keeps its view, its credentials narrowed to it
    // if they opened more; handed on again, it stays as it is. Only a
    // chain of scopes already full cannot narrow again.
    match serde_json::to_vec(&handle) {
        Ok(json) => {
            let back = serde_json::from_slice::<RemoteBuffer>(&json).unwrap();
            let view =
                |h: &RemoteBuffer| (h.owner(), h.region(), h.generation(), h.addr(), h.len());
            assert_eq!(view(&back), view(&handle));
            assert_eq!(back.access(), handle.access());
            assert_eq!(serde_json::to_vec(&back).unwrap(), json);
        }
        Err(_) => assert_eq!(handle.scopes().len(), ferry_core::MAX_SCOPES),
    }
    let whole = handle.slice(0..handle.len());
    match handle.check_address_range() {
        Ok(()) => {
            assert_eq!(whole.as_ref(), Ok(&handle));
            let half = handle.len() / 2;
            let tail = handle.slice(half..handle.len()).unwrap();
            assert_eq!(tail.addr(), handle.addr() + half);
            assert_eq!(tail.len(), handle.len() - half);
        }
        Err(e) => assert_eq!(whole, Err(e)),
    }
    assert!(!handle.read_only().access().allows_write());
    1
}

/// A remote descriptor list as JSON, as users pass them between processes
/// (issue 37: an edited one reached a panic in the initiator). What
/// decodes must be a list `RemoteDescList::new` accepts, round-trip, and
/// name only bytes inside its handles; bare descriptors must be readable
/// whole without a panic.
pub fn desc_list_json(data: &[u8]) -> usize {
    let mut decoded = 0;
    if let Ok(descs) = serde_json::from_slice::<Descs>(data) {
        // Bounded: a strided list may name billions of blocks.
        for (i, desc) in descs.iter().enumerate().take(1 << 12) {
            assert_eq!(descs.get(i), Some(desc));
        }
        assert_eq!(descs.get(descs.len()), None);
        let _ = descs.spans(4);
        decoded += 1;
    }
    let Ok(list) = serde_json::from_slice::<RemoteDescList>(data) else {
        return decoded;
    };
    // Handed on, the list keeps its views (a handle edited to view more or
    // other bytes than its credentials open is narrowed to its view, as
    // `handle_json` checks); handed on again, it stays as it is. Only a
    // chain of scopes already full cannot narrow again.
    match serde_json::to_vec(&list) {
        Ok(json) => {
            let back = serde_json::from_slice::<RemoteDescList>(&json).unwrap();
            assert_eq!(back.descs(), list.descs());
            let view = |h: &RemoteBuffer| (h.owner(), h.addr(), h.len(), h.access());
            assert!((back.regions().iter().map(view)).eq(list.regions().iter().map(view)));
            assert_eq!(serde_json::to_vec(&back).unwrap(), json);
        }
        Err(_) => {
            assert!((list.regions().iter()).any(|h| h.scopes().len() == ferry_core::MAX_SCOPES))
        }
    }
    assert_eq!(
        RemoteDescList::new(list.regions().to_vec(), list.descs().clone()).as_ref(),
        Ok(&list)
    );
    let count = list.descs().len();
    let firsts = 0..count.min(1 << 12);
    let last = count.checked_sub(1);
    for i in firsts.chain(last) {
        let desc = list.descs().get(i).expect("i < len");
        let handle = &list.regions()[desc.region as usize];
        let end = desc
            .offset
            .checked_add(desc.len)
            .expect("checked when decoded");
        assert!(end <= handle.len(), "descriptor {i} leaves its handle");
        assert!(handle.slice(desc.offset..end).is_ok());
    }
    decoded + 1
}
