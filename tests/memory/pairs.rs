//! A request whose every region is same-host goes to the memory transport
//! as descriptor pairs, planned per region with no op made per pair: its
//! failures are still typed and at their position in the request (a slice
//! that starts on one region and ends on another), a refused slice moves
//! nothing, and a failed region leaves the other's bytes moved.

use ferry::prelude::*;
use ferry::{Descs, LocalDescList, PreparedRemote, RemoteDescList, SLICE_OPS, Xfer, XferError};

use crate::common::{PeerProcess, PeerRegion, pattern};
use crate::{DEADLINE, node, sharing_peer};

const BLOCK: u64 = 8192;
/// Pairs on the first peer region: a slice and a half, so that the second
/// slice starts on the first region and ends on the second.
const FIRST: usize = SLICE_OPS + SLICE_OPS / 2;
/// Pairs on the second peer region.
const SECOND: usize = SLICE_OPS;
const PAIRS: usize = FIRST + SECOND;

/// The peer's two regions as one prepared list: `FIRST` blocks of the
/// first, then `SECOND` of the second.
async fn two_regions(node: &Node, first: &PeerRegion, second: &PeerRegion) -> PreparedRemote {
    let mut descs = Descs::new();
    for i in 0..FIRST as u64 {
        descs.push(0, i * BLOCK, BLOCK);
    }
    for i in 0..SECOND as u64 {
        descs.push(1, i * BLOCK, BLOCK);
    }
    let handles = vec![first.handle.clone(), second.handle.clone()];
    let list = RemoteDescList::new(handles, descs).unwrap();
    let prepared = node.prepare_remote(list, DEADLINE).await.unwrap();
    assert_eq!(
        prepared.levels(),
        [RdmaTransportLevel::Memory, RdmaTransportLevel::Memory]
    );
    prepared
}

/// A local region of `PAIRS` blocks filled with `pattern(.., seed)`, and a
/// request of `kind` pairing its blocks in order with `remote`'s.
async fn request(node: &Node, kind: OpKind, remote: &PreparedRemote, seed: u8) -> (Region, Xfer) {
    let len = BLOCK * PAIRS as u64;
    let local = node.alloc(len, Access::ReadWrite).await.unwrap();
    local.write_at(0, &pattern(len as usize, seed)).unwrap();
    let blocks = Descs::strided(0, 0, BLOCK, BLOCK, PAIRS as u32);
    let list = LocalDescList::new(vec![local.clone()], blocks).unwrap();
    let xfer = node
        .make_xfer(kind, &list, 0..PAIRS, remote, 0..PAIRS)
        .unwrap();
    (local, xfer)
}

/// The failed op's position and error.
fn failed_op(result: Result<(), XferError>) -> (usize, OpError) {
    match result {
        Err(XferError::Submit(SubmitError::Op { index, error })) => (index, error),
        other => panic!("expected an op's error, got {other:?}"),
    }
}

/// Bytes `blocks` of `bytes`, in blocks.
fn blocks(bytes: &[u8], blocks: std::ops::Range<usize>) -> &[u8] {
    &bytes[blocks.start * BLOCK as usize..blocks.end * BLOCK as usize]
}

/// Writes whose second region is read-only fail at its first pair, in the
/// middle of a slice; that slice moves nothing (its pairs on the writable
/// region neither), the slice before it moves all its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_to_a_read_only_region_fails_at_its_first_pair_and_its_slice_moves_nothing() {
    let node = node().await;
    let mut peer = sharing_peer().await;
    let first = peer
        .alloc(FIRST * BLOCK as usize, Access::ReadWrite, 1)
        .await;
    let second = peer
        .alloc(SECOND * BLOCK as usize, Access::ReadOnly, 2)
        .await;
    let remote = two_regions(&node, &first, &second).await;
    let (local, xfer) = request(&node, OpKind::Write, &remote, 3).await;
    xfer.post(DEADLINE).unwrap();
    assert_eq!(failed_op(xfer.wait().await), (FIRST, OpError::ReadOnly));
    let written = local.to_vec();
    let landed = peer.contents(&first).await;
    assert!(blocks(&landed, 0..SLICE_OPS) == blocks(&written, 0..SLICE_OPS));
    assert!(
        blocks(&landed, SLICE_OPS..FIRST) == blocks(&first.original(), SLICE_OPS..FIRST),
        "the refused slice moved bytes"
    );
    assert!(peer.contents(&second).await == second.original());
}

/// Reads from a region the owner dropped (its slot reused since) fail
/// typed at the region's first pair, in the middle of a slice; the other
/// region's pairs, in that slice too, still move, and no byte of the
/// dropped one lands. For a memfd region and for one reached over
/// `process_vm`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_from_a_dropped_region_fails_typed_at_its_first_pair() {
    dropped_region(false).await;
    dropped_region(true).await;
}

async fn dropped_region(raw: bool) {
    let node = node().await;
    let mut peer = sharing_peer().await;
    let first = alloc(&mut peer, raw, FIRST, 1).await;
    let second = alloc(&mut peer, raw, SECOND, 2).await;
    let remote = two_regions(&node, &first, &second).await;
    let (local, xfer) = request(&node, OpKind::Read, &remote, 3).await;
    // Both regions mapped or granted here, and their bytes read.
    xfer.post(DEADLINE).unwrap();
    xfer.wait().await.unwrap();
    let mut expected = first.original();
    expected.extend(second.original());
    assert!(local.to_vec() == expected);

    let fresh = pattern(BLOCK as usize * PAIRS, 0xEE);
    local.write_at(0, &fresh).unwrap();
    peer.drop_region(&second).await;
    let mut reused = alloc(&mut peer, raw, SECOND, 5).await;
    for _ in 0..4 {
        if reused.handle.region() == second.handle.region() {
            break;
        }
        reused = alloc(&mut peer, raw, SECOND, 5).await;
    }
    assert_eq!(
        reused.handle.region(),
        second.handle.region(),
        "slot reused"
    );
    xfer.post(DEADLINE).unwrap();
    let (index, error) = failed_op(xfer.wait().await);
    assert_eq!(index, FIRST, "{error:?}");
    assert!(
        matches!(error, OpError::StaleGeneration { handle, current }
            if handle == second.handle.generation() && current == reused.handle.generation()),
        "{error:?}"
    );
    let read = local.to_vec();
    assert!(blocks(&read, 0..FIRST) == first.original(), "raw: {raw}");
    assert!(
        blocks(&read, FIRST..PAIRS) == blocks(&fresh, FIRST..PAIRS),
        "a byte of the dropped region landed (raw: {raw})"
    );
}

/// A writable peer region of `blocks` blocks filled with
/// `pattern(.., seed)`: a memfd, or (`raw`) memory reached over
/// `process_vm`.
async fn alloc(peer: &mut PeerProcess, raw: bool, blocks: usize, seed: u8) -> PeerRegion {
    let len = blocks * BLOCK as usize;
    if raw {
        peer.alloc_raw(len, Access::ReadWrite, seed).await
    } else {
        peer.alloc(len, Access::ReadWrite, seed).await
    }
}
