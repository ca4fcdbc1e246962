//! Descriptor lists end to end, checked the same way over each transport:
//! a request of 100,000 descriptors of 4 KiB between two processes, built
//! from a strided remote list and an explicit local one, with index arrays
//! that reverse, repeat and interleave, verified byte for byte.

use std::time::Duration;

use ferry::prelude::*;
use ferry::{Descs, LocalDescList, RemoteDescList, ops_between};

use crate::common::{PeerProcess, digest, pattern};

const BLOCK: u64 = 4096;
const BLOCKS: u32 = 100_000;
const DEADLINE: Duration = Duration::from_secs(120);

/// Writes every local block to the peer's region in reverse order, checks
/// the peer's bytes, then reads every other remote block back twice over
/// and checks the local bytes. `route` is the transport the ops must take.
pub async fn hundred_thousand_descriptors(
    node: &Node,
    peer: &mut PeerProcess,
    route: RdmaTransportLevel,
) {
    let len = BLOCK as usize * BLOCKS as usize;
    let target = peer.alloc(len, Access::ReadWrite, 1).await;
    let local = node.alloc(len as u64, Access::ReadWrite).await.unwrap();
    let data = pattern(len, 2);
    local.write_at(0, &data).unwrap();

    // Remote: strided, four numbers. Local: explicit, block i at i * BLOCK.
    let remotes = RemoteDescList::new(
        vec![target.handle.clone()],
        Descs::strided(0, 0, BLOCK, BLOCK, BLOCKS),
    )
    .unwrap();
    let mut descs = Descs::with_capacity(BLOCKS as usize);
    for i in 0..u64::from(BLOCKS) {
        descs.push(0, i * BLOCK, BLOCK);
    }
    let locals = LocalDescList::new(vec![local.clone()], descs).unwrap();

    let reversed: Vec<u32> = (0..BLOCKS).rev().collect();
    let ops = ops_between(
        OpKind::Write,
        &locals,
        0..BLOCKS as usize,
        &remotes,
        &reversed,
    )
    .unwrap();
    assert_eq!(ops.len(), BLOCKS as usize);
    assert_eq!(node.route(&ops[0]), Some(route));
    node.submit(ops, DEADLINE).await.unwrap();
    let block =
        |bytes: &[u8], i: usize| bytes[i * BLOCK as usize..(i + 1) * BLOCK as usize].to_vec();
    let expected: Vec<u8> = (0..BLOCKS as usize)
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
    let half = BLOCKS as usize / 2;
    let remote_idx: Vec<u32> = (0..half as u32).flat_map(|k| [2 * k, 2 * k]).collect();
    let local_idx: Vec<u32> = (0..half as u32)
        .flat_map(|k| [k, k + half as u32])
        .collect();
    local.write_at(0, &vec![0; len]).unwrap();
    let ops = ops_between(OpKind::Read, &locals, &local_idx, &remotes, &remote_idx).unwrap();
    node.submit(ops, DEADLINE).await.unwrap();
    let back = local.to_vec();
    for k in 0..half {
        let want = block(&expected, 2 * k);
        assert!(block(&back, k) == want, "block {k}");
        assert!(block(&back, k + half) == want, "block {}", k + half);
    }
    peer.drop_region(&target).await;
}
