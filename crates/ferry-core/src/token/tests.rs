use super::*;

const TOKEN: u128 = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210;
const REGION: Scope = Scope {
    addr: 0x7f00_0000_0000,
    len: 1 << 20,
    access: Access::ReadWrite,
};

fn scope(addr: u64, len: u64, access: Access) -> Scope {
    Scope { addr, len, access }
}

#[test]
fn the_derivation_is_hmac_sha256_of_the_scope_under_the_token() {
    // Computed independently (Python's hmac and hashlib): handles in
    // flight between two versions must derive alike.
    let outer = scope(0x7f00_0000_1000, 4096, Access::ReadOnly);
    assert_eq!(
        scope_token(TOKEN, &outer),
        0x7d74_79a2_2733_012e_f90a_893e_86bf_b663
    );
    let inner = scope(0x7f00_0000_1800, 16, Access::ReadOnly);
    let chain = Scopes::new(&[outer, inner]).unwrap();
    assert_eq!(
        chain.token(TOKEN),
        0xbdc4_d7a3_6b12_d070_4c47_83b3_a982_c2dd
    );
    assert_eq!(Scopes::default().token(TOKEN), TOKEN);
}

#[test]
fn the_owner_opens_the_innermost_scope_of_an_honest_chain() {
    let none = Scopes::default();
    assert_eq!(none.open(REGION, TOKEN, TOKEN), Some(REGION));
    assert_eq!(none.open(REGION, TOKEN, TOKEN ^ 1), None);

    let slice = scope(REGION.addr + 4096, 4096, Access::ReadWrite);
    let one = Scopes::new(&[slice]).unwrap();
    let t1 = one.token(TOKEN);
    assert_eq!(one.open(REGION, TOKEN, t1), Some(slice));
    assert_eq!(one.open(REGION, TOKEN, t1 ^ 1), None);
    // The narrowed token does not open the region as a whole.
    assert_eq!(none.open(REGION, TOKEN, t1), None);

    // Narrowed again, to reads: derived from the narrowed token alone.
    let sub = scope(slice.addr + 100, 10, Access::ReadOnly);
    let two = one.with(sub).unwrap();
    assert_eq!(two.token(TOKEN), scope_token(t1, &sub));
    assert_eq!(two.open(REGION, TOKEN, two.token(TOKEN)), Some(sub));

    // A scope that says it writes after one that reads only still reads
    // only; so does any scope of a read-only region.
    let rw_again = two.with(scope(sub.addr, 5, Access::ReadWrite)).unwrap();
    let opened = rw_again.open(REGION, TOKEN, rw_again.token(TOKEN)).unwrap();
    assert_eq!(opened.access, Access::ReadOnly);
    let ro_region = Scope {
        access: Access::ReadOnly,
        ..REGION
    };
    assert_eq!(
        one.open(ro_region, TOKEN, t1).map(|s| s.access),
        Some(Access::ReadOnly)
    );
}

#[test]
fn edited_or_widened_chains_are_refused() {
    let slice = scope(REGION.addr + 4096, 4096, Access::ReadOnly);
    let one = Scopes::new(&[slice]).unwrap();
    let t1 = one.token(TOKEN);
    // The scope edited in the handle: the token no longer matches.
    for edited in [
        scope(REGION.addr, REGION.len, Access::ReadOnly),
        scope(slice.addr, slice.len + 1, Access::ReadOnly),
        scope(slice.addr - 1, slice.len, Access::ReadOnly),
        scope(slice.addr, slice.len, Access::ReadWrite),
    ] {
        let chain = Scopes::new(&[edited]).unwrap();
        assert_eq!(chain.open(REGION, TOKEN, t1), None, "{edited:?}");
    }
    // A holder of the slice derives a wider scope from its own token: a
    // valid link, but outside the scope before it.
    for wider in [
        scope(REGION.addr, REGION.len, Access::ReadOnly),
        scope(slice.addr, slice.len + 1, Access::ReadOnly),
        scope(slice.addr - 1, 1, Access::ReadOnly),
    ] {
        let chain = one.with(wider).unwrap();
        let token = chain.token(TOKEN);
        assert_eq!(scope_token(t1, &wider), token, "anyone with t1 can");
        assert_eq!(chain.open(REGION, TOKEN, token), None, "{wider:?}");
    }
    // A first scope outside the region.
    let outside = Scopes::new(&[scope(REGION.addr + REGION.len, 1, Access::ReadOnly)]).unwrap();
    assert_eq!(outside.open(REGION, TOKEN, outside.token(TOKEN)), None);
    // Ranges that would overflow are outside, not wrapped.
    let huge = Scopes::new(&[scope(u64::MAX, 2, Access::ReadOnly)]).unwrap();
    assert_eq!(huge.open(REGION, TOKEN, huge.token(TOKEN)), None);
}

#[test]
fn chains_travel_as_bytes_and_as_json_and_refuse_garbage() {
    let a = scope(0x1000, 4096, Access::ReadWrite);
    let b = scope(0x1100, 16, Access::ReadOnly);
    let chain = Scopes::new(&[a, b]).unwrap();
    let mut bytes = Vec::new();
    chain.encode_into(&mut bytes);
    assert_eq!(bytes.len(), 2 * SCOPE_LEN);
    assert_eq!(Scopes::decode(&bytes), Some(chain));
    assert_eq!(Scopes::decode(&[]), None);
    assert_eq!(Scopes::decode(&bytes[..SCOPE_LEN + 1]), None);
    let mut bad = bytes.clone();
    bad[16] = 2;
    assert_eq!(Scopes::decode(&bad), None);
    let mut bad = bytes.clone();
    bad[23] = 1;
    assert_eq!(Scopes::decode(&bad), None);
    let five = bytes.repeat(3);
    assert_eq!(Scopes::decode(&five[..5 * SCOPE_LEN]), None, "too many");

    let json = serde_json::to_value(chain).unwrap();
    assert_eq!(
        json,
        serde_json::json!([
            {"addr": 0x1000, "len": 4096, "access": "ReadWrite"},
            {"addr": 0x1100, "len": 16, "access": "ReadOnly"},
        ])
    );
    assert_eq!(serde_json::from_value::<Scopes>(json).unwrap(), chain);
    let five = serde_json::to_value([a; MAX_SCOPES + 1]).unwrap();
    let error = serde_json::from_value::<Scopes>(five).unwrap_err();
    assert!(error.to_string().contains("at most 4 times"), "{error}");
    assert!(Scopes::new(&[a; MAX_SCOPES]).unwrap().with(a).is_none());
}
