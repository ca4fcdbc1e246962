use super::*;

#[test]
fn frames_round_trip() {
    let req = Request {
        kind: RequestKind::Write,
        id: 7,
        region: RegionId(3),
        generation: Generation(9),
        addr: 0x0dea_dbee_f000,
        len: 4096,
        token: u128::MAX - 5,
        scopes: Scopes::default(),
        tag: 11,
    };
    assert_eq!(Request::decode(&req.encode()), Ok(req));
    for kind in [RequestKind::Read, RequestKind::Write] {
        let ranges = ClientFrame::Ranges(Ranges {
            kind,
            id: 8,
            region: RegionId(3),
            generation: Generation(9),
            count: MAX_RANGES,
            len: 64 << 10,
            token: 77,
            scopes: Scopes::default(),
            tag: 12,
        });
        assert_eq!(ClientFrame::decode(&ranges.encode()), Ok(ranges));
    }
    for endpoint in ["10.1.2.3:7000", "[fd00::5]:1"] {
        let notify = Notify {
            id: 12,
            tag: 11,
            len: 64,
            discard: true,
            from: NodeAddr {
                id: NodeId(u128::MAX - 1),
                endpoint: endpoint.parse().unwrap(),
            },
        };
        let frame = ClientFrame::Notify(notify);
        assert_eq!(ClientFrame::decode(&frame.encode()), Ok(frame));
    }
    for resp in [
        Response::ReadData { id: 1, len: 10 },
        Response::WriteAck { id: 2 },
        Response::Refused {
            id: 3,
            range: 0,
            refusal: Refusal::StaleGeneration {
                current: Generation(4),
            },
            len: 5,
        },
        Response::Refused {
            id: 4,
            range: 1023,
            refusal: Refusal::OutOfBounds {
                offset: 9,
                bound: 100,
            },
            len: 5,
        },
        Response::Notified {
            id: 5,
            outcome: NotifyOutcome::TooLarge { limit: 1024 },
        },
        Response::Notified {
            id: 6,
            outcome: NotifyOutcome::InboxFull,
        },
    ] {
        assert_eq!(Response::decode(&resp.encode()), Ok(resp));
    }
}

#[test]
fn scoped_requests_carry_their_scopes_behind_the_header() {
    let scope = |addr, access| Scope {
        addr,
        len: 4096,
        access,
    };
    let scopes = Scopes::new(&[
        scope(0x1000, Access::ReadWrite),
        scope(0x1000, Access::ReadOnly),
    ])
    .unwrap();
    let request = Request {
        kind: RequestKind::Write,
        id: 7,
        region: RegionId(3),
        generation: Generation(9),
        addr: 0x1010,
        len: 16,
        token: 5,
        scopes,
        tag: 0,
    };
    let ranges = Ranges {
        kind: RequestKind::Read,
        id: 8,
        region: RegionId(3),
        generation: Generation(9),
        count: 2,
        len: 32,
        token: 5,
        scopes,
        tag: 0,
    };
    for frame in [ClientFrame::Op(request), ClientFrame::Ranges(ranges)] {
        let header = frame.encode();
        assert_eq!((header[0] & SCOPED, header[1]), (SCOPED, 2));
        let mut decoded = ClientFrame::decode(&header).unwrap();
        assert_eq!(decoded.scopes_len(), 2 * SCOPE_LEN);
        let mut trailer = Vec::new();
        scopes.encode_into(&mut trailer);
        decoded.read_scopes(&trailer).unwrap();
        assert_eq!(decoded, frame);
        // A trailer of another length, or garbage, is a framing error.
        let error = Err(FrameError::BadScopes);
        assert_eq!(decoded.read_scopes(&trailer[..SCOPE_LEN]), error);
        trailer[16] = 7;
        assert_eq!(decoded.read_scopes(&trailer), error);
    }
    // The region's own token: the header as it always was.
    let plain = Request {
        scopes: Scopes::default(),
        ..request
    };
    assert_eq!(plain.encode()[..2], [RequestKind::Write as u8, 0]);
    assert_eq!(ClientFrame::Op(plain).scopes_len(), 0);
    // Counts out of range, and a scoped notification.
    let mut b = request.encode();
    for count in [0, MAX_SCOPES as u8 + 1] {
        b[1] = count;
        assert_eq!(
            ClientFrame::decode(&b),
            Err((7, FrameError::ScopeCount(count)))
        );
    }
    b[0] = NOTIFY_KIND | SCOPED;
    assert_eq!(
        ClientFrame::decode(&b),
        Err((7, FrameError::BadKind(NOTIFY_KIND | SCOPED)))
    );
}

#[test]
fn bad_frames_are_typed_errors() {
    let mut b = [0u8; REQUEST_LEN];
    b[0] = 9;
    b[8] = 42;
    assert_eq!(Request::decode(&b), Err((42, FrameError::BadKind(9))));
    b[0] = 1;
    b[32..40].copy_from_slice(&(MAX_CHUNK + 1).to_le_bytes());
    assert_eq!(
        Request::decode(&b),
        Err((42, FrameError::TooLong(MAX_CHUNK + 1)))
    );
    for count in [0, MAX_RANGES + 1] {
        b[0] = RANGES_KIND;
        b[20..24].copy_from_slice(&count.to_le_bytes());
        assert_eq!(
            ClientFrame::decode(&b),
            Err((42, FrameError::RangeCount(count)))
        );
    }
}

#[test]
fn range_tables_must_add_up() {
    let header = Ranges {
        kind: RequestKind::Write,
        id: 1,
        region: RegionId(0),
        generation: Generation(1),
        count: 2,
        len: 12,
        token: 0,
        scopes: Scopes::default(),
        tag: 0,
    };
    let table = |lens: &[u64]| -> Vec<u8> {
        let ranges = lens.iter().enumerate();
        ranges
            .flat_map(|(k, &len)| {
                Range {
                    addr: k as u64 * 100,
                    len,
                }
                .encode()
            })
            .collect()
    };
    let mut out = Vec::new();
    header.decode_table(&table(&[4, 8]), &mut out).unwrap();
    assert_eq!(
        out,
        [Range { addr: 0, len: 4 }, Range { addr: 100, len: 8 }]
    );
    for (lens, why) in [
        (&[4, 9][..], "lengths do not add up"),
        (&[12, 0], "an empty range"),
        (&[12], "wrong table length"),
        (&[u64::MAX, 13], "lengths do not add up"),
    ] {
        assert_eq!(
            header.decode_table(&table(lens), &mut out),
            Err(FrameError::RangeTable(why)),
            "{lens:?}"
        );
    }
}
