//! Spreading a peer's share of a batch over its rail pairs, and posting
//! again what a failed pair gave back (see the `batch` module docs for the
//! rules).

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use ferry_core::{BatchProgress, OpError, RailKeys, RdmaOp, Region};
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::batch::{PeerGroup, Shared};
use crate::connection::{PeerQp, Piece, Pin, Rescue};
use crate::notify::attach_notification;
use crate::peers::Link;
use crate::placement::{RailPair, RailPairs, Route};
use crate::qp_session::QpSession;
use crate::verbs::{RdmaOpcode, WorkRequest};

impl Shared {
    /// Splits `group`'s ops into pieces over `link`'s usable pairs (see the
    /// `batch` module docs), counting each op's pieces in `progress`, and puts its
    /// notification behind them when the peer has one pair (with several,
    /// it is not sent on the data path). With several, every piece can be
    /// rescued into `rescue`.
    pub(crate) fn spread(
        &self,
        group: &mut PeerGroup,
        link: &Link,
        progress: &BatchProgress,
        sent: &AtomicBool,
        rescue: &Arc<Rescue>,
    ) {
        let pairs = link.usable();
        let several = pairs.len() > 1;
        let mut lanes: Vec<Lane> = pairs
            .into_iter()
            .map(|qp| Lane {
                // Only compared with other pairs' loads.
                load: if several { qp.outstanding_bytes() } else { 0 },
                session: QpSession::new(qp),
                pieces: Vec::new(),
                rescue: several.then(|| rescue.clone()),
            })
            .collect();
        let plans = std::mem::take(&mut group.plans);
        // Only a piece that can be rescued is keyed again.
        if several {
            group.keys = plans.iter().map(|p| (p.op, p.keys)).collect();
        }
        let share: u64 = plans.iter().map(|p| p.len).sum();
        let stripe_min = self.fabric.stripe_min;
        // A share under the threshold goes whole to one pair.
        let whole = (share < stripe_min)
            .then(|| (0..lanes.len()).min_by_key(|&i| lanes[i].load))
            .flatten();
        for plan in plans {
            if plan.len == 0 {
                continue;
            }
            // Pairs whose two ends the op has keys for (a handle from this
            // owner has a key for each of its rails) on a rail it may take;
            // of those, the ones on its preferred rails if any.
            let reach = |lane: &Lane| pair_keys(lane.session.qp(), &plan.keys).is_some();
            let mut eligible: Vec<usize> = (0..lanes.len()).filter(|&i| reach(&lanes[i])).collect();
            plan.keys
                .route
                .narrow(&mut eligible, |&i| lanes[i].session.qp().rail().index);
            let pieces = if eligible.is_empty() {
                progress.piece_done(plan.op, Err(OpError::NoSharedTransport));
                continue;
            } else if eligible.len() > 1 && share >= stripe_min && plan.len >= stripe_min {
                // Equal parts, page-aligned, one per pair.
                let part = plan
                    .len
                    .div_ceil(eligible.len() as u64)
                    .next_multiple_of(4096);
                let mut pieces = 0;
                for (k, &i) in eligible.iter().enumerate() {
                    let at = (k as u64 * part).min(plan.len);
                    let len = part.min(plan.len - at);
                    pieces += lanes[i].push(&plan, at, len);
                }
                pieces
            } else {
                let i = match whole {
                    Some(i) if eligible.contains(&i) => i,
                    _ => *eligible
                        .iter()
                        .min_by_key(|&&i| lanes[i].load)
                        .expect("eligible is not empty"),
                };
                lanes[i].push(&plan, 0, plan.len)
            };
            progress.add_pieces(plan.op, pieces.saturating_sub(1));
        }
        if let Some(notification) = group.notification.take() {
            match &mut lanes[..] {
                // One pair: behind the data on it. A notification alone
                // (`run`'s after-reads case) has only that pair too.
                [lane] => {
                    group.notification = Some(notification);
                    attach_notification(
                        &mut group.notification,
                        &mut lane.pieces,
                        lane.session.qp(),
                        progress,
                        sent,
                    );
                }
                // Several pairs (see the module docs), or none: not sent
                // on the data path.
                _ => progress.piece_done(notification.index, Ok(())),
            }
        }
        lanes.retain(|lane| !lane.pieces.is_empty());
        group.lanes = lanes;
    }

    /// The rail pairs `spread` would put `op` on now, its load aside: the
    /// usable pairs to its peer on rails it may take, those on its
    /// preferred rails if any. Empty when the peer's link is not connected.
    pub(crate) fn pairs_for(&self, op: &RdmaOp) -> RailPairs {
        let region = op.local.region();
        let (Some(remote), Some(local)) = (
            op.remote.transports().ibverbs,
            self.registry
                .lock()
                .get(&(region.id(), region.generation()))
                .copied(),
        ) else {
            return RailPairs::default();
        };
        let keys = OpKeys {
            lkeys: local.lkeys,
            rkeys: remote.rkeys,
            route: local.route,
        };
        let Some(link) = self.peers.connected(op.remote.owner()) else {
            return RailPairs::default();
        };
        let mut pairs: Vec<RailPair> = link
            .usable()
            .iter()
            .filter(|qp| pair_keys(qp, &keys).is_some())
            .map(|qp| RailPair {
                rail: qp.rail().index,
                remote_rail: qp.remote_rail(),
            })
            .collect();
        keys.route.narrow(&mut pairs, |p| p.rail);
        pairs.into_iter().collect()
    }

    /// Posts the pieces waiting in `rescue` again, each on a usable pair
    /// to its peer with keys for it, with the fewest bytes outstanding;
    /// fails those whose peer has no pair left.
    pub(crate) async fn post_again(
        &self,
        groups: &[PeerGroup],
        rescue: &Arc<Rescue>,
        progress: &Arc<BatchProgress>,
        deadline: Instant,
    ) {
        let mut lanes: Vec<Lane> = Vec::new();
        for mut piece in rescue.take() {
            let found = groups.iter().find_map(|g| {
                let at = g.keys.binary_search_by_key(&piece.op, |k| k.0).ok()?;
                Some((g, g.keys[at]))
            });
            let Some((group, (_, keys))) = found else {
                progress.piece_done(piece.op, Err(OpError::NoSharedTransport));
                continue;
            };
            let keyed = |qp: &PeerQp| pair_keys(qp, &keys);
            let link = self.peers.connected(group.peer);
            let pairs = link.as_ref().map(|l| l.usable()).unwrap_or_default();
            let Some((qp, (lkey, rkey))) = pairs
                .iter()
                .filter_map(|qp| Some((qp, keyed(qp)?)))
                .min_by_key(|(qp, _)| qp.outstanding_bytes())
            else {
                warn!(peer = %group.peer.endpoint, "no rail pair to the peer works any more: the batch fails");
                let rails = link
                    .iter()
                    .flat_map(|l| l.all())
                    .map(|qp| qp.pair_name())
                    .collect();
                progress.piece_done(
                    piece.op,
                    Err(OpError::ConnectionLost {
                        endpoint: group.peer.endpoint,
                        rails,
                    }),
                );
                continue;
            };
            piece.wr.lkey = lkey;
            piece.wr.rkey = rkey;
            piece.wr.signaled = false;
            piece.rescue = Some(rescue.clone());
            match lanes.iter_mut().find(|l| Arc::ptr_eq(l.session.qp(), qp)) {
                Some(lane) => lane.pieces.push(piece),
                None => lanes.push(Lane {
                    session: QpSession::new(qp.clone()),
                    pieces: vec![piece],
                    load: 0,
                    rescue: Some(rescue.clone()),
                }),
            }
        }
        for lane in &lanes {
            debug!(rail = %lane.session.qp().rail().name(), pieces = lane.pieces.len(), "posting pieces of a failed rail pair again");
        }
        let posting = lanes.into_iter().map(|mut lane| async move {
            let pieces = std::mem::take(&mut lane.pieces);
            lane.session
                .post_all(pieces, progress, Instant::now(), deadline)
                .await;
        });
        futures_util::future::join_all(posting).await;
    }
}

/// The (offset, length) pieces an op of `len` bytes is posted as, each at
/// most `max` bytes: `len.div_ceil(max)` of them.
/// The (local, remote) keys `qp` carries an op with: `None` when the op
/// may not take its rail, or has no key at one of its ends.
fn pair_keys(qp: &PeerQp, keys: &OpKeys) -> Option<(u32, u32)> {
    let rail = qp.rail().index;
    if !keys.route.allowed.contains(rail) {
        return None;
    }
    Some((
        keys.lkeys.get(usize::from(rail))?,
        keys.rkeys.get(usize::from(qp.remote_rail()))?,
    ))
}

/// An op's keys on every rail at both ends, and the rails it may take.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OpKeys {
    /// The local region's, by this node's rail.
    pub(crate) lkeys: RailKeys,
    /// The handle's, by the owner's rail.
    pub(crate) rkeys: RailKeys,
    /// The local region's route.
    pub(crate) route: Route,
}

pub(crate) fn pieces_of(len: usize, max: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..len).step_by(max).map(move |at| (at, max.min(len - at)))
}

/// One op of a batch, checked, with its keys on every rail at both ends:
/// what `spread` splits into pieces once the peer's pairs are known.
pub(crate) struct OpPlan {
    pub(crate) op: usize,
    pub(crate) opcode: RdmaOpcode,
    pub(crate) local_addr: u64,
    pub(crate) remote_addr: u64,
    pub(crate) len: u64,
    pub(crate) keys: OpKeys,
    /// Pinned by every piece.
    pub(crate) region: Region,
}

/// The pieces of a peer's share that go to one of its rail pairs.
pub(crate) struct Lane {
    pub(crate) session: QpSession,
    pub(crate) pieces: Vec<Piece>,
    /// Bytes outstanding on the pair, plus those assigned to it here.
    pub(crate) load: u64,
    /// Given to each piece when the peer has several pairs.
    pub(crate) rescue: Option<Arc<Rescue>>,
}

impl Lane {
    /// Appends the pieces of `len` bytes of `plan` from `at`, with the
    /// keys of this lane's rails; returns how many.
    pub(crate) fn push(&mut self, plan: &OpPlan, at: u64, len: u64) -> u32 {
        let qp = self.session.qp();
        let max = qp.rail().max_msg as usize;
        // `spread` gives a lane only ops it has keys for.
        let (lkey, rkey) = pair_keys(qp, &plan.keys).unwrap_or((0, 0));
        let before = self.pieces.len();
        // An op's length is its local slice's, which fits usize.
        for (off, piece) in pieces_of(len as usize, max) {
            let off = at + off as u64;
            self.pieces.push(Piece {
                op: plan.op,
                wr: WorkRequest {
                    wr_id: 0,
                    opcode: plan.opcode,
                    local_addr: plan.local_addr + off,
                    len: piece as u32,
                    lkey,
                    remote_addr: plan.remote_addr + off,
                    rkey,
                    signaled: false,
                    fence: false,
                },
                pin: Pin::Region(plan.region.clone()),
                rescue: self.rescue.clone(),
            });
        }
        self.load += len;
        (self.pieces.len() - before) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::pieces_of;

    #[test]
    fn ops_split_into_pieces_that_cover_them_exactly() {
        assert_eq!(
            pieces_of(10, 4).collect::<Vec<_>>(),
            [(0, 4), (4, 4), (8, 2)]
        );
        assert_eq!(pieces_of(8, 4).collect::<Vec<_>>(), [(0, 4), (4, 4)]);
        assert_eq!(pieces_of(3, 4).collect::<Vec<_>>(), [(0, 3)]);
        assert_eq!(pieces_of(0, 4).count(), 0);
        for len in [1, 4095, 4096, 4097, (1 << 20) + 3] {
            let pieces: Vec<_> = pieces_of(len, 4096).collect();
            assert_eq!(pieces.len(), len.div_ceil(4096));
            let mut next = 0;
            for (at, piece) in pieces {
                assert_eq!(at, next);
                assert!((1..=4096).contains(&piece));
                next += piece;
            }
            assert_eq!(next, len);
        }
    }
}
