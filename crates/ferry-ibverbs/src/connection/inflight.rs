//! The record book of a queue pair's posted work requests: which op each
//! belongs to and what local memory it pins, retired in post order as
//! completions are polled. Kept apart from `PeerQp`, which posts and polls,
//! because this is the part that decides when a pin may drop: see the
//! parent module's "Memory safety" section for the invariant it upholds.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use ferry_core::{BatchProgress, OpError, Region};
use tokio::sync::Notify;

use super::FOREIGN_WR_ID_BIT;
use crate::notify::SendSlot;
use crate::verbs::{Completion, PostBuffers, WorkRequest};

/// One piece of an op (or a batch's notification), ready to post.
pub(crate) struct Piece {
    pub op: usize,
    pub wr: WorkRequest,
    pub pin: Pin,
    /// Where the piece goes if its queue pair fails under it, to be posted
    /// again on another rail pair; `None` fails its op instead.
    pub rescue: Option<Arc<Rescue>>,
}

/// Pieces of one batch whose queue pair failed under them (flushed, or
/// retries exhausted), waiting for the batch to post them again on a pair
/// that still works. A one-sided READ or WRITE of unchanged source bytes
/// may run twice: the second run leaves the same bytes.
#[derive(Default)]
pub(crate) struct Rescue {
    pieces: Mutex<Vec<Piece>>,
    /// Wakes the batch once pieces wait here.
    pub wake: Notify,
}

impl Rescue {
    /// Keeps `piece` for the batch, and wakes it.
    pub fn push(&self, piece: Piece) {
        self.pieces
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(piece);
        self.wake.notify_one();
    }

    /// The pieces waiting, in the order they failed.
    pub fn take(&self) -> Vec<Piece> {
        std::mem::take(&mut *self.pieces.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// What keeps a work request's local memory registered until the NIC is
/// done with it: held only to be dropped then.
#[expect(dead_code, reason = "never read: it is held for its drop")]
pub(crate) enum Pin {
    /// An op's local region.
    Region(Region),
    /// The send buffer a notification was copied into.
    Notification(SendSlot),
}

pub(super) struct Posted {
    /// The request as posted (its id, and what a rescue posts again).
    pub(super) wr: WorkRequest,
    pub(super) op: usize,
    pub(super) progress: Arc<BatchProgress>,
    /// Keeps the local memory registered while the NIC may touch it.
    pub(super) pin: Pin,
    pub(super) rescue: Option<Arc<Rescue>>,
}

#[derive(Default)]
pub(super) struct Inflight {
    pub(super) records: VecDeque<Posted>,
    /// Set when the QP failed; it then only drains.
    pub(super) broken: Option<OpError>,
    /// Bytes of the records not yet finished.
    pub(super) bytes: u64,
    /// Reused by every post, which happens under this lock: posting does not
    /// allocate.
    pub(super) wrs: Vec<WorkRequest>,
    pub(super) buffers: PostBuffers,
}

impl Inflight {
    /// Finishes the records `wc` covers: every one up to and including its
    /// request (RC completes in order), which fails with `error` (and, for a
    /// flush, so do the ones before it). Returns how many were finished, each
    /// releasing its memory pin. A completion ferry did not post, or one whose
    /// request a later completion already covered, finishes none: two
    /// pollers (the poller task and a submitter polling inline) may apply
    /// completions out of order, and a stale one must not finish requests
    /// still in flight.
    pub(super) fn retire(&mut self, wc: &Completion, error: Option<&OpError>) -> usize {
        if wc.wr_id & FOREIGN_WR_ID_BIT != 0 {
            return 0;
        }
        let queued = self.records.partition_point(|r| r.wr.wr_id < wc.wr_id);
        if self
            .records
            .get(queued)
            .is_none_or(|r| r.wr.wr_id != wc.wr_id)
        {
            return 0;
        }
        for record in self.records.drain(..=queued) {
            self.bytes -= u64::from(record.wr.len);
            let target = record.wr.wr_id == wc.wr_id;
            // Before an error completion, earlier requests succeeded; before
            // a flush, they were flushed too.
            let result = match error {
                Some(e) if target || wc.is_flush() => Err(e.clone()),
                _ => Ok(()),
            };
            match (result, record.rescue) {
                // The path failed, not the op: an access error would fail
                // on every pair alike. A notification is never sent twice.
                (Err(e), Some(rescue))
                    if !matches!(e, OpError::AccessDenied)
                        && !matches!(record.pin, Pin::Notification(_)) =>
                {
                    // Without its rescue: the rescue holds it, and the
                    // batch attaches it again when it posts it.
                    rescue.push(Piece {
                        op: record.op,
                        wr: record.wr,
                        pin: record.pin,
                        rescue: None,
                    });
                }
                (result, _) => record.progress.piece_done(record.op, result),
            }
        }
        queued + 1
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use ferry_core::{
        Access, MemoryBlock, NodeAddr, NodeId, RegionIds, RegionParts, RemoteTransports,
        SubmitError,
    };
    use rdma_sys::ibv_wc_status;

    use super::*;

    /// Sets its flag when dropped: stands for the MR a region's pin keeps.
    struct Registration(Arc<AtomicBool>);

    impl Drop for Registration {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// One record per id in `ids`, each pinning a region of its own, all ops
    /// of one batch; returns the batch and each pin's "deregistered" flag.
    fn posted(inflight: &mut Inflight, ids: &[u64]) -> (Arc<BatchProgress>, Vec<Arc<AtomicBool>>) {
        let progress = Arc::new(BatchProgress::new(ids.iter().map(|_| 1)));
        let owner = NodeAddr {
            id: NodeId(1),
            endpoint: "127.0.0.1:1".parse().unwrap(),
        };
        let slots = RegionIds::new();
        let mut released = Vec::new();
        for (op, &wr_id) in ids.iter().enumerate() {
            let flag = Arc::new(AtomicBool::new(false));
            released.push(flag.clone());
            let pin = RegionParts {
                slot: slots.allocate(),
                memory: Arc::new(MemoryBlock::alloc(64).unwrap()),
                access: Access::ReadWrite,
                owner,
                transports: RemoteTransports::default(),
                registrations: vec![Box::new(Registration(flag))],
            }
            .into_region();
            inflight.records.push_back(Posted {
                wr: WorkRequest::empty_write(wr_id),
                op,
                progress: progress.clone(),
                pin: Pin::Region(pin),
                rescue: None,
            });
        }
        (progress, released)
    }

    fn completion(wr_id: u64, status: u32) -> Completion {
        Completion {
            wr_id,
            status,
            qp_num: 7,
            ..Completion::default()
        }
    }

    fn is_released(flags: &[Arc<AtomicBool>]) -> Vec<bool> {
        flags.iter().map(|f| f.load(Ordering::SeqCst)).collect()
    }

    /// The race two pollers can run: one applies the completion of request
    /// 13 (covering 10..=13), new requests are posted, then the other applies
    /// the older completion of 11. The stale one must finish nothing — it
    /// would otherwise release the memory of requests still in flight.
    #[test]
    fn a_stale_completion_finishes_nothing_and_keeps_later_pins() {
        let ok = ibv_wc_status::IBV_WC_SUCCESS;
        let mut inflight = Inflight::default();
        let (first, first_pins) = posted(&mut inflight, &[10, 11, 12, 13]);
        assert_eq!(inflight.retire(&completion(13, ok), None), 4);
        assert!(first.is_done());
        assert_eq!(first.outcome(), Ok(()));
        assert_eq!(is_released(&first_pins), [true; 4]);

        let (second, second_pins) = posted(&mut inflight, &[14, 15]);
        assert_eq!(inflight.retire(&completion(11, ok), None), 0);
        assert_eq!(inflight.records.len(), 2);
        assert_eq!(is_released(&second_pins), [false, false]);
        assert!(!second.is_done());

        // Not ferry's, and not any record's: nothing either.
        let foreign = completion(FOREIGN_WR_ID_BIT | 15, ok);
        assert_eq!(inflight.retire(&foreign, None), 0);
        assert_eq!(inflight.retire(&completion(99, ok), None), 0);

        assert_eq!(inflight.retire(&completion(14, ok), None), 1);
        assert_eq!(is_released(&second_pins), [true, false]);
        assert_eq!(inflight.retire(&completion(15, ok), None), 1);
        assert!(second.is_done());
        assert!(inflight.records.is_empty());
    }

    /// An error completion fails its own request, after earlier ones
    /// succeeded; a flush fails everything it covers.
    #[test]
    fn errors_fail_their_request_and_flushes_fail_all_they_cover() {
        let mut inflight = Inflight::default();
        let (batch, pins) = posted(&mut inflight, &[1, 2, 3, 4, 5]);
        let denied = OpError::AccessDenied;
        let access = completion(2, ibv_wc_status::IBV_WC_REM_ACCESS_ERR);
        assert_eq!(inflight.retire(&access, Some(&denied)), 2);
        let lost = OpError::Protocol("flushed".into());
        let flush = completion(5, ibv_wc_status::IBV_WC_WR_FLUSH_ERR);
        assert_eq!(inflight.retire(&flush, Some(&lost)), 3);
        assert!(batch.is_done());
        assert_eq!(is_released(&pins), [true; 5]);
        // Op 0 succeeded; the lowest failure is op 1's own error.
        assert_eq!(
            batch.outcome(),
            Err(SubmitError::Op {
                index: 1,
                error: denied
            })
        );
    }
}
