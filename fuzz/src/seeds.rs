//! The seed corpus: small, valid inputs for every fuzz target, made by the
//! real encoders, so that the fuzzer starts from frames a node really
//! sends and mutates from there.
//!
//! `fuzz/corpus/<target>/<name>` holds each seed. `tests/fuzz_corpus.rs`
//! checks that the committed files are exactly what this makes, and
//! rewrites them when asked:
//!
//! ```text
//! cargo test --test fuzz_corpus -- --ignored write_seed_corpus
//! ```
//!
//! Everything here is deterministic: fixed ids, tokens and addresses.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use ferry_control::frame::{ControlCodec, Frame, Service, Status};
use ferry_control::hello::{Hello, HelloReply, VERSION};
use ferry_control::{Channel, HelloStatus};
use ferry_core::{
    Access, Descs, Generation, IbvRemote, MemRemote, MemoryBlock, NodeAddr, NodeId, RailKeys,
    RdmaTransportLevel, RegionId, RegionIds, RegionParts, RemoteBuffer, RemoteDescList,
    RemoteTransports, Scope, Scopes, TcpRemote,
};
use ferry_discovery::NodeMetadata;
use ferry_tcp::frame::{
    ClientFrame, Notify, NotifyOutcome, Range, Ranges, Refusal, Request, RequestKind, Response,
};
use tokio_util::codec::Encoder;

/// One seed: its target, its file name, its bytes.
pub struct Seed {
    /// The fuzz target it feeds.
    pub target: &'static str,
    /// Its file name under `fuzz/corpus/<target>/`.
    pub name: &'static str,
    /// The input.
    pub bytes: Vec<u8>,
}

fn seed(target: &'static str, name: &'static str, bytes: impl Into<Vec<u8>>) -> Seed {
    Seed {
        target,
        name,
        bytes: bytes.into(),
    }
}

fn node(id: u128, endpoint: &str) -> NodeAddr {
    NodeAddr {
        id: NodeId(id),
        endpoint: endpoint.parse().unwrap(),
    }
}

/// A handle as a node hands it out, with every transport's credentials,
/// at a fixed address (a real region's address changes from run to run).
fn handle(owner: NodeAddr, slots: &RegionIds) -> RemoteBuffer {
    let remote = RegionParts {
        slot: slots.allocate(),
        memory: Arc::new(MemoryBlock::alloc(4096).unwrap()),
        access: Access::ReadWrite,
        owner,
        transports: RemoteTransports {
            tcp: Some(TcpRemote { token: 0x1111 }),
            ibverbs: Some(IbvRemote {
                rkeys: RailKeys::new(&[0x2222, 0x2223]).expect("two rails"),
            }),
            memory: Some(MemRemote {
                boot_id: 0x3333,
                token: 0x4444,
                process_vm: false,
            }),
        },
        registrations: Vec::new(),
    }
    .into_region()
    .remote();
    // Through the handle's own serializer and back, with only the address
    // made fixed: what a forger on the wire could do, too.
    let mut json = serde_json::to_value(&remote).unwrap();
    json["addr"] = 0x7f00_0000_1000u64.into();
    serde_json::from_value(json).unwrap()
}

/// Every seed of every target.
pub fn seeds() -> Vec<Seed> {
    let me = node(0x0123_4567_89ab_cdef_0011_2233_4455_6677, "10.0.0.1:7000");
    let me_v6 = node(7, "[fd00::1]:7001");
    let slots = RegionIds::new();
    let handle = handle(me, &slots);
    let mut out = Vec::new();

    // TCP data channel: a write with its payload, a read, a notification
    // with its body; the owner's answers, read data after its header.
    let write = Request {
        kind: RequestKind::Write,
        id: 1,
        region: RegionId(0),
        generation: Generation(1),
        addr: handle.addr(),
        len: 8,
        token: 0x1111,
        scopes: Scopes::default(),
        tag: 5,
    };
    let read = Request {
        kind: RequestKind::Read,
        id: 2,
        len: 4096,
        tag: 0,
        ..write
    };
    let notify = |from| Notify {
        id: 3,
        tag: 5,
        len: 4,
        discard: false,
        from,
    };
    let mut stream = Vec::new();
    stream.extend_from_slice(&ClientFrame::Op(write).encode());
    stream.extend_from_slice(b"payload!");
    stream.extend_from_slice(&ClientFrame::Op(read).encode());
    stream.extend_from_slice(&ClientFrame::Notify(notify(me)).encode());
    stream.extend_from_slice(b"done");
    out.push(seed("tcp_client_stream", "write-read-notify", stream));
    // Ranges: a write of two ranges with their payloads, a read of two.
    let mut stream = Vec::new();
    for kind in [RequestKind::Write, RequestKind::Read] {
        let ranges = Ranges {
            kind,
            id: 4,
            region: RegionId(0),
            generation: Generation(1),
            count: 2,
            len: 12,
            token: 0x1111,
            scopes: Scopes::default(),
            tag: 0,
        };
        stream.extend_from_slice(&ClientFrame::Ranges(ranges).encode());
        for (at, len) in [(0, 4), (64, 8)] {
            let range = Range {
                addr: handle.addr() + at,
                len,
            };
            stream.extend_from_slice(&range.encode());
        }
        if kind == RequestKind::Write {
            stream.extend_from_slice(b"fourandeight");
        }
    }
    out.push(seed("tcp_client_stream", "ranges", stream));
    // Through a narrowed handle: scopes behind each header.
    let scopes = Scopes::new(&[
        Scope {
            addr: handle.addr(),
            len: 256,
            access: Access::ReadWrite,
        },
        Scope {
            addr: handle.addr(),
            len: 128,
            access: Access::ReadOnly,
        },
    ])
    .unwrap();
    let scoped = Request {
        scopes,
        token: scopes.token(0x1111),
        ..read
    };
    let mut stream = ClientFrame::Op(scoped).encode().to_vec();
    scopes.encode_into(&mut stream);
    let ranges = Ranges {
        kind: RequestKind::Read,
        id: 6,
        region: RegionId(0),
        generation: Generation(1),
        count: 1,
        len: 8,
        token: scopes.token(0x1111),
        scopes,
        tag: 0,
    };
    stream.extend_from_slice(&ClientFrame::Ranges(ranges).encode());
    scopes.encode_into(&mut stream);
    let range = Range {
        addr: handle.addr(),
        len: 8,
    };
    stream.extend_from_slice(&range.encode());
    out.push(seed("tcp_client_stream", "scoped", stream));
    let mut v6 = ClientFrame::Notify(notify(me_v6)).encode().to_vec();
    v6.extend_from_slice(b"done");
    out.push(seed("tcp_client_stream", "notify-ipv6", v6));

    let responses = [
        Response::WriteAck { id: 1 },
        Response::Refused {
            id: 2,
            range: 0,
            refusal: Refusal::OutOfBounds {
                offset: 4096,
                bound: 4096,
            },
            len: 8,
        },
        Response::Refused {
            id: 3,
            range: 0,
            refusal: Refusal::StaleGeneration {
                current: Generation(2),
            },
            len: 8,
        },
        Response::Notified {
            id: 4,
            outcome: NotifyOutcome::TooLarge { limit: 1024 },
        },
    ];
    let mut stream: Vec<u8> = responses.iter().flat_map(|r| r.encode()).collect();
    stream.extend_from_slice(&Response::ReadData { id: 5, len: 4 }.encode());
    stream.extend_from_slice(b"data");
    out.push(seed("tcp_response_stream", "answers", stream));

    // Control session: both Opens, a request, its response, a cancel, a
    // tell, as the codec frames them on the wire.
    let mut codec = ControlCodec::default();
    let mut wire = BytesMut::new();
    for frame in [
        Frame::Open {
            min_version: 1,
            max_version: 3,
            node: me,
        },
        Frame::Open {
            min_version: 1,
            max_version: 3,
            node: me_v6,
        },
        Frame::Request {
            id: 1,
            service: Service::RPC,
            deadline: Duration::from_millis(2500),
            body: ferry_control::rpc::encode_call("echo", b"hi"),
        },
        Frame::Response {
            id: 1,
            status: Status::Ok,
            body: Bytes::from_static(b"\0hi"),
        },
        Frame::Cancel { id: 2 },
        Frame::Tell {
            service: Service::IBVERBS_CREDITS,
            deadline: Duration::from_secs(10),
            body: Bytes::from_static(&[0; 8]),
        },
    ] {
        codec.encode(frame, &mut wire).unwrap();
    }
    out.push(seed("control_stream", "session", wire.to_vec()));

    // Endpoint hellos and replies: a refused one, and one between nodes
    // that prove a cluster secret (its reply's tag made by one).
    let secret = ferry_control::ClusterSecret::new("a seed's cluster secret").unwrap();
    let mut hello = Hello::new(Channel::CONTROL, me.id, NodeId(0x7a6e7));
    hello.proves = true;
    hello.nonce = [0x5a; 32];
    let hello = hello.encode();
    let mut hellos = hello.to_vec();
    let mut reply = HelloReply {
        version: VERSION,
        status: HelloStatus::Ok,
        node: me_v6.id,
        proves: true,
        nonce: [0xa5; 32],
        tag: [0; 32],
    };
    reply.tag = secret.server_tag(&[&hello, &reply.header(), &reply.nonce]);
    hellos.extend_from_slice(&reply.encode());
    hellos.extend_from_slice(
        &HelloReply {
            status: HelloStatus::SecretRequired,
            proves: false,
            ..reply
        }
        .encode(),
    );
    out.push(seed("hello", "hello-and-reply", hellos));

    out.push(seed(
        "rpc_call",
        "echo",
        ferry_control::rpc::encode_call("echo", b"argument").to_vec(),
    ));

    // ibverbs: a QP exchange frame; a credit return.
    {
        use ferry_ibverbs::verbs::QpEndpoint;
        use ferry_ibverbs::wire::{QpInfo, encode_credits};
        let info = QpInfo {
            status: 0,
            mtu: 3,
            endpoint: QpEndpoint {
                qpn: 0x11,
                psn: 0xabcdef,
                gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
                lid: 0,
            },
            recv_slots: 16,
            recv_slot_len: 4096,
        };
        out.push(seed("ibverbs_wire", "qp-info", info.encode()));
        out.push(seed("ibverbs_wire", "credits", encode_credits(0x11, 4)));
        use ferry_ibverbs::wire::{PairInfo, RailInfo, encode_pairs, encode_rails};
        let pair = |initiator_rail, owner_rail| PairInfo {
            initiator_rail,
            owner_rail,
            slot: 0,
            qp: info,
        };
        out.push(seed(
            "ibverbs_wire",
            "pairs",
            encode_pairs(&[pair(0, 0), pair(1, 1)]),
        ));
        let rail = |index| RailInfo {
            index,
            ethernet: true,
            mtu: 3,
            lid: 0,
            gid: info.endpoint.gid,
        };
        out.push(seed(
            "ibverbs_wire",
            "release",
            ferry_ibverbs::wire::encode_release(3),
        ));
        out.push(seed(
            "ibverbs_wire",
            "rails",
            encode_rails(&[rail(0), rail(1)]),
        ));
    }

    // Memory transport: a request, and the owner's answers to it.
    {
        use ferry_memory::wire::{Answer, Refusal, Reply, Request};
        let request = Request {
            region: RegionId(0),
            generation: Generation(1),
            write: true,
            token: 0x4444,
            scopes: Scopes::default(),
            process_vm: true,
        };
        out.push(seed("memory_wire", "request", request.encode()));
        let scoped = Request {
            scopes: Scopes::new(&[Scope {
                addr: handle.addr(),
                len: 64,
                access: Access::ReadOnly,
            }])
            .unwrap(),
            ..request
        };
        out.push(seed("memory_wire", "request-scoped", scoped.encode()));
        let granted = Reply::Granted {
            base: handle.addr(),
            len: 4096,
            data_len: 4096,
        };
        out.push(seed(
            "memory_wire",
            "answer-granted",
            Answer::to(&request, granted).encode(),
        ));
        let stale = Reply::Refused(Refusal::StaleGeneration {
            current: Generation(2),
        });
        out.push(seed(
            "memory_wire",
            "answer-stale",
            Answer::to(&request, stale).encode(),
        ));
        let process_vm = Reply::ProcessVm {
            base: handle.addr(),
            len: 4096,
            gate: 7,
            lane: 3,
            stamp: 0x55,
        };
        out.push(seed(
            "memory_wire",
            "answer-process-vm",
            Answer::to(&request, process_vm).encode(),
        ));
        // A notification lane opened, and accepted.
        use ferry_memory::wire::{LaneAck, LaneOpen};
        let open = LaneOpen {
            from: me,
            slots: 64,
            slot_len: 4096,
        };
        out.push(seed("memory_wire", "lane-open", open.encode()));
        let ack = LaneAck::Open { max_len: 65536 };
        out.push(seed("memory_wire", "lane-ack", ack.encode()));
    }

    // Discovery: a node's metadata blob, two published regions.
    let metadata = NodeMetadata::new(
        Some("prefill-0".into()),
        me,
        vec![RdmaTransportLevel::Tcp, RdmaTransportLevel::Nic],
        [
            ("kv/0".to_string(), handle.clone()),
            // Whole regions only: a narrowed handle is refused in metadata.
            ("kv/1".to_string(), self::handle(me, &slots)),
        ]
        .into(),
    );
    out.push(seed("metadata", "two-regions", metadata.encode().to_vec()));

    out.push(seed(
        "handle_json",
        "handle",
        serde_json::to_vec(&handle).unwrap(),
    ));
    out.push(seed(
        "handle_json",
        "slice-read-only",
        serde_json::to_vec(&handle.slice(16..32).unwrap().read_only()).unwrap(),
    ));
    let strided =
        RemoteDescList::new(vec![handle.clone()], Descs::strided(0, 0, 256, 256, 16)).unwrap();
    out.push(seed(
        "desc_list_json",
        "strided",
        serde_json::to_vec(&strided).unwrap(),
    ));
    let explicit = RemoteDescList::new(
        vec![handle.clone(), handle.slice(1024..2048).unwrap()],
        Descs::from_triples(&[[1, 0, 16], [0, 4000, 96], [1, 1000, 24]]).unwrap(),
    )
    .unwrap();
    out.push(seed(
        "desc_list_json",
        "explicit",
        serde_json::to_vec(&explicit).unwrap(),
    ));
    out
}
