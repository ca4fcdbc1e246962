//! Descriptor lists end to end, checked the same way over each transport:
//! requests of 100,000 descriptors of 4 KiB between two processes (10,000
//! under soft-RoCE emulation), built
//! from prepared lists (a strided remote one and an explicit one, an
//! explicit local one) with index arrays that reverse, repeat and
//! interleave, verified byte for byte; and the same ops as one `submit`.

use std::time::Duration;

use ferry::prelude::*;
use ferry::{Descs, LocalDescList, RemoteDescList, XferStatus, ops_between};

use crate::common::{PeerProcess, digest, pattern};

const BLOCK: u64 = 4096;
const DEADLINE: Duration = Duration::from_secs(120);

/// Writes every local block to the peer's region in reverse order, checks
/// the peer's bytes, then reads every other remote block back twice over
/// and checks the local bytes. `route` is the transport the ops must take.
pub async fn descriptors_round_trip(
    node: &Node,
    peer: &mut PeerProcess,
    route: RdmaTransportLevel,
    blocks: u32,
) {
    let len = BLOCK as usize * blocks as usize;
    let target = peer.alloc(len, Access::ReadWrite, 1).await;
    let local = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    let data = pattern(len, 2);
    local.write_at(0, &data).unwrap();

    // Remote: strided, four numbers. Local: explicit, block i at i * BLOCK.
    let remotes = RemoteDescList::new(
        vec![target.handle.clone()],
        Descs::strided(0, 0, BLOCK, BLOCK, blocks),
    )
    .unwrap();
    let mut descs = Descs::with_capacity(blocks as usize);
    for i in 0..u64::from(blocks) {
        descs.push(0, i * BLOCK, BLOCK);
    }
    let locals = LocalDescList::new(vec![local.clone()], descs).unwrap();

    let reversed: Vec<u32> = (0..blocks).rev().collect();
    // The same ops as one submit first: a baseline the request must match.
    let ops = ops_between(
        OpKind::Write,
        &locals,
        0..blocks as usize,
        &remotes,
        &reversed,
    )
    .unwrap();
    assert_eq!(ops.len(), blocks as usize);
    assert_eq!(node.route(&ops[0]), Some(route));
    node.submit(ops, DEADLINE).await.unwrap();
    // Then as a request on the prepared list, after scribbling over the
    // peer's bytes with a write of zeros from an explicit remote list.
    let prepared = node.prepare_remote(remotes, DEADLINE).await.unwrap();
    assert_eq!(prepared.levels(), [route]);
    let zeros = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    let zero_list =
        LocalDescList::new(vec![zeros], Descs::strided(0, 0, BLOCK, BLOCK, blocks)).unwrap();
    let explicit = RemoteDescList::new(
        vec![target.handle.clone()],
        Descs::from_triples(
            &(0..u64::from(blocks))
                .map(|i| [0, i * BLOCK, BLOCK])
                .collect::<Vec<_>>(),
        )
        .unwrap(),
    )
    .unwrap();
    let explicit = node.prepare_remote(explicit, DEADLINE).await.unwrap();
    let clear = node
        .make_xfer(
            OpKind::Write,
            &zero_list,
            0..blocks as usize,
            &explicit,
            0..blocks as usize,
        )
        .unwrap();
    clear.post(DEADLINE).unwrap();
    clear.wait().await.unwrap();
    assert_eq!(peer.digest(&target).await, digest(&vec![0; len]), "cleared");
    let xfer = node
        .make_xfer(
            OpKind::Write,
            &locals,
            0..blocks as usize,
            &prepared,
            &reversed,
        )
        .unwrap();
    assert_eq!((xfer.len(), xfer.bytes()), (blocks as usize, len as u64));
    xfer.post(DEADLINE).unwrap();
    xfer.wait().await.unwrap();
    assert_eq!(xfer.status(), XferStatus::Done);
    let block =
        |bytes: &[u8], i: usize| bytes[i * BLOCK as usize..(i + 1) * BLOCK as usize].to_vec();
    let expected: Vec<u8> = (0..blocks as usize)
        .rev()
        .flat_map(|i| block(&data, i))
        .collect();
    assert_eq!(
        peer.digest(&target).await,
        digest(&expected),
        "written blocks"
    );

    // Read back: remote blocks 0, 2, 4, ... each into two local blocks
    // (repeats on the remote side, interleaved on the local one).
    let half = blocks as usize / 2;
    let remote_idx: Vec<u32> = (0..half as u32).flat_map(|k| [2 * k, 2 * k]).collect();
    let local_idx: Vec<u32> = (0..half as u32)
        .flat_map(|k| [k, k + half as u32])
        .collect();
    local.write_at(0, &vec![0; len]).unwrap();
    let read = node
        .make_xfer(OpKind::Read, &locals, &local_idx, &prepared, &remote_idx)
        .unwrap();
    read.post(DEADLINE).unwrap();
    read.wait().await.unwrap();
    let back = local.to_vec();
    for k in 0..half {
        let want = block(&expected, 2 * k);
        assert!(block(&back, k) == want, "block {k}");
        assert!(block(&back, k + half) == want, "block {}", k + half);
    }
    peer.drop_region(&target).await;
}
