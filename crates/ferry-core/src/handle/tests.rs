use super::*;
use crate::NodeId;

fn handle() -> RemoteBuffer {
    RemoteBuffer::new(
        NodeAddr {
            id: NodeId(1),
            endpoint: "127.0.0.1:1".parse().unwrap(),
        },
        RegionId(3),
        Generation(1),
        0x1000,
        100,
        Access::ReadWrite,
        RemoteTransports {
            tcp: Some(TcpRemote { token: 42 }),
            ibverbs: None,
            memory: None,
        },
    )
}

#[test]
fn slicing_narrows_and_never_widens() {
    let h = handle();
    let s = h.slice(10..30).unwrap();
    assert_eq!((s.addr(), s.len()), (0x1000 + 10, 20));
    let t = s.slice(5..20).unwrap();
    assert_eq!((t.addr(), t.len()), (0x1000 + 15, 15));
    assert!(matches!(
        s.slice(0..21),
        Err(OpError::OutOfBounds { bound: 20, .. })
    ));
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = s.slice(5..4);
    assert_eq!(reversed, Err(OpError::InvertedRange { start: 5, end: 4 }));
    assert_eq!(h.read_only().access(), Access::ReadOnly);
}

/// `h` as another process receives it.
fn handed_over(h: &RemoteBuffer) -> RemoteBuffer {
    serde_json::from_value(serde_json::to_value(h).unwrap()).unwrap()
}

fn with_memory(process_vm: bool) -> RemoteBuffer {
    let mut h = handle();
    Arc::make_mut(&mut h.shared).transports.memory = Some(MemRemote {
        boot_id: 7,
        token: 43,
        process_vm,
    });
    h
}

#[test]
fn views_narrow_their_credentials_when_serialized() {
    let h = with_memory(true);
    // The whole handle travels as it is, with no scopes.
    let json = serde_json::to_value(&h).unwrap();
    assert!(json.get("scopes").is_none(), "{json}");
    assert_eq!(handed_over(&h), h);
    // A slice is narrowed: its scope beside tokens derived for it.
    let s = h.slice(10..30).unwrap();
    assert_eq!(s.transports(), h.transports(), "not before it leaves");
    let got = handed_over(&s);
    let scope = Scope {
        addr: 0x100a,
        len: 20,
        access: Access::ReadWrite,
    };
    assert_eq!(got.scopes().as_slice(), [scope]);
    assert_eq!(got.transports().tcp.unwrap().token, scope_token(42, &scope));
    let memory = got.transports().memory.unwrap();
    assert_eq!((memory.token, memory.boot_id), (scope_token(43, &scope), 7));
    assert_eq!(
        (got.addr(), got.len(), got.access()),
        (0x100a, 20, Access::ReadWrite)
    );
    // Handed on as it is, it stays as it is; sliced again, it narrows
    // again, from its own tokens.
    assert_eq!(handed_over(&got), got);
    let sub = handed_over(&got.slice(5..6).unwrap());
    let inner = Scope {
        addr: 0x100f,
        len: 1,
        ..scope
    };
    assert_eq!(sub.scopes().as_slice(), [scope, inner]);
    let chain = Scopes::new(&[scope, inner]).unwrap();
    assert_eq!(sub.transports().tcp.unwrap().token, chain.token(42));
    // Until the chain is full.
    let mut deep = got;
    for k in 1..crate::MAX_SCOPES {
        deep = handed_over(&deep.slice(1..deep.len()).unwrap());
        assert_eq!(deep.scopes().len(), k + 1);
    }
    assert_eq!(handed_over(&deep), deep, "not narrower: not narrowed");
    let error = serde_json::to_value(deep.read_only()).unwrap_err();
    assert!(error.to_string().contains("narrowed 4 times"), "{error}");
}

#[test]
fn read_only_views_serialize_with_read_only_credentials() {
    let h = with_memory(false);
    let ro = h.read_only();
    assert_eq!(
        (ro.access(), h.access()),
        (Access::ReadOnly, Access::ReadWrite)
    );
    assert_eq!(ro.read_only(), ro);
    let got = handed_over(&ro);
    let scope = Scope {
        addr: 0x1000,
        len: 100,
        access: Access::ReadOnly,
    };
    assert_eq!(got.scopes().as_slice(), [scope]);
    assert_eq!(got.transports().tcp.unwrap().token, scope_token(42, &scope));
    // The whole memfd region, read-only: its memfd may still be mapped
    // (read-only, which the kernel enforces).
    let memory = got.transports().memory.unwrap();
    assert_eq!(memory.token, scope_token(43, &scope));
    // Its access edited back claims more than its scope: the credentials
    // still allow reads only.
    let mut json = serde_json::to_value(&ro).unwrap();
    json["access"] = "ReadWrite".into();
    let upgraded: RemoteBuffer = serde_json::from_value(json).unwrap();
    assert_eq!(upgraded.access(), Access::ReadWrite);
    assert_eq!(upgraded.shared.access, Access::ReadOnly);
    // A part of a memfd region carries no same-host credentials: they
    // would open the whole memfd. TCP's are narrowed as ever.
    let part = handed_over(&h.slice(0..50).unwrap());
    assert_eq!(part.transports().memory, None);
    assert!(part.transports().tcp.is_some());
    let part = handed_over(&ro.slice(0..50).unwrap());
    assert_eq!(part.transports().memory, None);
}

#[test]
fn bad_ranges_get_errors_that_say_what_is_wrong() {
    #[allow(clippy::reversed_empty_ranges)]
    let inverted = handle().slice(10..5).unwrap_err();
    assert_eq!(inverted, OpError::InvertedRange { start: 10, end: 5 });
    assert_eq!(
        inverted.to_string(),
        "range 10..5 is inverted: its end comes before its start"
    );
    // A real out-of-bounds range keeps its own error.
    assert_eq!(
        handle().slice(90..110),
        Err(OpError::OutOfBounds {
            offset: 90,
            len: 20,
            bound: 100
        })
    );
}

#[test]
fn forged_handles_that_wrap_the_address_space_are_refused() {
    let forged = |addr: u64, len: u64| {
        let mut json = serde_json::to_value(handle()).unwrap();
        json["addr"] = addr.into();
        json["len"] = len.into();
        serde_json::from_value::<RemoteBuffer>(json).unwrap()
    };
    let huge = forged(0x1000, u64::MAX);
    let expected = OpError::AddressOverflow {
        addr: 0x1000,
        len: u64::MAX,
    };
    assert_eq!(huge.check_address_range(), Err(expected.clone()));
    // Slicing it refuses before looking at the range, even one that
    // lies inside the forged length.
    assert_eq!(huge.slice(0..10), Err(expected.clone()));
    // Errors a peer reports travel as serde; the forged values survive.
    let json = serde_json::to_string(&expected).unwrap();
    assert_eq!(serde_json::from_str::<OpError>(&json).unwrap(), expected);
    assert_eq!(
        expected.to_string(),
        "handle range 0x1000+18446744073709551615 wraps around the address space: \
         forged or corrupt handle"
    );

    let near_end = forged(u64::MAX - 10, 100);
    assert_eq!(
        near_end.slice(20..30),
        Err(OpError::AddressOverflow {
            addr: u64::MAX - 10,
            len: 100
        })
    );
    // Ending exactly at the top of the address space does not wrap.
    let at_end = forged(u64::MAX - 100, 100);
    assert_eq!(at_end.check_address_range(), Ok(()));
    assert_eq!(at_end.slice(90..100).unwrap().addr(), u64::MAX - 10);
}

#[test]
fn rail_keys_travel_as_a_short_list_and_refuse_too_many() {
    let keys = RailKeys::new(&[0x11, 0x22]).unwrap();
    assert_eq!(
        (keys.get(1), keys.get(2), keys.len()),
        (Some(0x22), None, 2)
    );
    let json = serde_json::to_value(IbvRemote { rkeys: keys }).unwrap();
    assert_eq!(json, serde_json::json!({"rkeys": [0x11, 0x22]}));
    assert_eq!(
        serde_json::from_value::<IbvRemote>(json).unwrap().rkeys,
        keys
    );
    assert!(RailKeys::new(&[0; MAX_RAILS + 1]).is_none());
    let too_many = serde_json::json!({"rkeys": vec![1; MAX_RAILS + 1]});
    let error = serde_json::from_value::<IbvRemote>(too_many).unwrap_err();
    assert!(error.to_string().contains("at most 8 rails"), "{error}");
}

#[test]
fn handle_round_trips_through_serde() {
    let h = handle();
    let json = serde_json::to_value(&h).unwrap();
    // 128-bit values travel as hex strings, which every JSON reader keeps exact.
    assert_eq!(
        json["transports"]["tcp"]["token"],
        "0000000000000000000000000000002a"
    );
    assert_eq!(serde_json::from_value::<RemoteBuffer>(json).unwrap(), h);
    let bad = serde_json::json!({"token": "not hex"});
    assert!(serde_json::from_value::<TcpRemote>(bad).is_err());
}
