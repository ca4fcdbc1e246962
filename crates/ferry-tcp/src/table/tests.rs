use super::*;

fn request(kind: RequestKind, generation: u32, token: u128, addr: u64, len: u64) -> Request {
    Request {
        kind,
        id: 1,
        region: RegionId(0),
        generation: Generation(generation),
        addr,
        len,
        token,
        scopes: Scopes::default(),
        tag: 0,
    }
}

fn peer() -> MemoryHolder {
    MemoryHolder::TcpPeer {
        node: ferry_core::NodeId(7),
        remote: "127.0.0.1:9".parse().unwrap(),
    }
}

#[test]
fn every_check_refuses_with_its_own_reason() {
    let table = RegionTable::default();
    let mem = Arc::new(MemoryBlock::alloc(100).unwrap());
    let base = mem.addr();
    let cache = &mut ScopeCache::default();
    assert!(table.insert(RegionId(0), Generation(2), 55, Access::ReadOnly, &mem));
    assert!(
        !table.insert(RegionId(0), Generation(3), 56, Access::ReadWrite, &mem),
        "id taken"
    );
    let ok = table
        .authorize(
            &request(RequestKind::Read, 2, 55, base + 10, 90),
            cache,
            peer,
        )
        .unwrap();
    assert_eq!(ok.offset, 10);
    drop(ok);
    let mut refuse = |r: Request| table.authorize(&r, cache, peer).err().unwrap();
    // Credentials first: a generation that never was, and a wrong
    // token, are the same to whoever asks.
    assert_eq!(
        refuse(request(RequestKind::Read, 1, 55, base, 1)),
        Refusal::AccessDenied
    );
    assert_eq!(
        refuse(request(RequestKind::Read, 2, 56, base, 1)),
        Refusal::AccessDenied
    );
    assert_eq!(
        refuse(request(RequestKind::Write, 2, 55, base, 1)),
        Refusal::ReadOnly
    );
    assert_eq!(
        refuse(request(RequestKind::Read, 2, 55, base + 10, 91)),
        Refusal::OutOfBounds {
            offset: 10,
            bound: 100
        }
    );
    assert!(matches!(
        refuse(request(RequestKind::Read, 2, 55, base - 1, 1)),
        Refusal::OutOfBounds { .. }
    ));
    assert!(matches!(
        refuse(request(RequestKind::Read, 2, 55, u64::MAX, 2)),
        Refusal::OutOfBounds { .. }
    ));
    assert!(!table.remove(RegionId(0), Generation(1)));
    assert!(table.remove(RegionId(0), Generation(2)));
    // Gone: its holder hears so, nobody else does.
    let mut refuse = |r: Request| table.authorize(&r, cache, peer).err().unwrap();
    assert_eq!(
        refuse(request(RequestKind::Read, 2, 55, base, 1)),
        Refusal::UnknownRegion
    );
    assert_eq!(
        refuse(request(RequestKind::Read, 2, 54, base, 1)),
        Refusal::AccessDenied
    );
    assert!(table.insert(RegionId(0), Generation(3), 57, Access::ReadWrite, &mem));
    assert_eq!(
        refuse(request(RequestKind::Read, 2, 55, base, 1)),
        Refusal::StaleGeneration {
            current: Generation(3)
        }
    );
}

#[test]
fn narrowed_credentials_open_their_scope_alone() {
    let table = RegionTable::default();
    let mem = Arc::new(MemoryBlock::alloc(4096).unwrap());
    let base = mem.addr();
    let token = 0x5eed;
    assert!(table.insert(RegionId(0), Generation(1), token, Access::ReadWrite, &mem));
    let scope = Scope {
        addr: base + 1024,
        len: 1024,
        access: Access::ReadWrite,
    };
    let scopes = Scopes::new(&[scope]).unwrap();
    let narrowed = |kind, addr, len| Request {
        scopes,
        ..request(kind, 1, scopes.token(token), addr, len)
    };
    let cache = &mut ScopeCache::default();
    let grant = table
        .authorize(
            &narrowed(RequestKind::Write, base + 1024, 1024),
            cache,
            peer,
        )
        .unwrap();
    assert_eq!(grant.offset, 1024);
    drop(grant);
    assert!(cache.last.is_some(), "remembered for the next request");
    // Outside the scope, inside the region: refused, relative to the scope.
    for (addr, len, offset) in [
        (base, 1, 1024u64.wrapping_neg()),
        (base + 1024, 1025, 0),
        (base + 2048, 1, 1024),
    ] {
        assert_eq!(
            table
                .authorize(&narrowed(RequestKind::Read, addr, len), cache, peer)
                .err(),
            Some(Refusal::OutOfBounds {
                offset,
                bound: 1024
            })
        );
    }
    // The scope edited: refused whether or not the cache holds the real
    // one.
    for edited in [
        Scope {
            addr: base,
            len: 4096,
            ..scope
        },
        Scope {
            access: Access::ReadOnly,
            ..scope
        },
    ] {
        let forged = Request {
            scopes: Scopes::new(&[edited]).unwrap(),
            ..narrowed(RequestKind::Read, base, 1)
        };
        let refused = table.authorize(&forged, cache, peer).err();
        assert_eq!(refused, Some(Refusal::AccessDenied), "{edited:?}");
    }
    // Read-only from a read-only link on.
    let ro = scopes
        .with(Scope {
            access: Access::ReadOnly,
            ..scope
        })
        .unwrap();
    let read_only = |kind| Request {
        scopes: ro,
        ..request(kind, 1, ro.token(token), base + 1024, 8)
    };
    assert!(
        table
            .authorize(&read_only(RequestKind::Read), cache, peer)
            .is_ok()
    );
    let write = table.authorize(&read_only(RequestKind::Write), cache, peer);
    assert_eq!(write.err(), Some(Refusal::ReadOnly));
    // The region replaced: the cache does not outlive it.
    assert!(table.remove(RegionId(0), Generation(1)));
    assert!(table.insert(RegionId(0), Generation(2), 9, Access::ReadWrite, &mem));
    let stale = table.authorize(&read_only(RequestKind::Read), cache, peer);
    assert_eq!(
        stale.err(),
        Some(Refusal::StaleGeneration {
            current: Generation(2)
        })
    );
}
