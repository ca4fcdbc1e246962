//! What the initiator sends as one request: a piece of an op, a run of
//! small ops of one region, or a notification; and how each one finishes
//! its part of a batch exactly once.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use ferry_core::{BatchProgress, OpError, Region};

use crate::client::NotificationResult;
use crate::frame::{ClientFrame, RequestKind};

/// What a chunk moves on the initiator's side.
#[derive(Clone)]
pub(crate) enum Local {
    /// An op's local bytes, from `offset`: the region clone keeps them
    /// registered and allocated.
    Region { region: Region, offset: usize },
    /// The local bytes of a [`crate::frame::Ranges`] request's ops, one
    /// entry per range of its table, in order; shared, so that the writer's
    /// pin is a reference count, not a copy.
    Ranges {
        region: Region,
        ranges: Arc<[LocalRange]>,
    },
    /// A notification's body, and where the owner's answer goes.
    Notification {
        body: Bytes,
        outcome: Arc<OnceLock<NotificationResult>>,
    },
}

/// One op of a [`crate::frame::Ranges`] request: `len` bytes at `offset` in
/// the local region, to or from `remote` on the owner.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LocalRange {
    /// Virtual address of the range in the owner's process.
    pub remote: u64,
    /// Offset of the range in the local region.
    pub offset: usize,
    /// Bytes; at least 1.
    pub len: usize,
}

/// A piece of one op, at most `chunk_size` bytes, a run of whole small ops
/// of one region ([`Local::Ranges`]), or a batch's notification, travelling
/// as one request.
///
/// It holds what it moves (see [`Local`]) for as long as it exists, whichever
/// task holds it. Dropping a chunk without `finish` counts it as lost, so a
/// submit can never wait on a chunk that no longer exists.
///
/// Boxed: a chunk is moved a dozen times between the batch that makes it
/// and the response that finishes it (queue, send batch, pending table),
/// and those moves of its 220 bytes cost more than the rest of a small
/// chunk's bookkeeping (callgrind); a box moves as one pointer.
pub(crate) struct Chunk(Box<Piece>);

/// What a [`Chunk`] holds.
pub(crate) struct Piece {
    /// Index of its op in the batch's progress (a notification's comes
    /// after the ops); of the first of its ops, for [`Local::Ranges`].
    pub(crate) op: usize,
    pub(crate) frame: ClientFrame,
    pub(crate) local: Local,
    /// The window bytes it takes while in flight; fixed at creation, so
    /// that what is taken is what is given back.
    pub(crate) cost: u64,
    pub(crate) submit: Option<Arc<BatchProgress>>,
    pub(crate) endpoint: SocketAddr,
    /// Sent again once already, on a new connection, after the owner
    /// closed the one it went on unread (see `connection.rs`): never twice.
    pub(crate) resent: bool,
}

impl std::ops::Deref for Chunk {
    type Target = Piece;

    fn deref(&self) -> &Piece {
        &self.0
    }
}

impl std::ops::DerefMut for Chunk {
    fn deref_mut(&mut self) -> &mut Piece {
        &mut self.0
    }
}

impl Chunk {
    pub(crate) fn new(
        op: usize,
        frame: ClientFrame,
        local: Local,
        submit: &Arc<BatchProgress>,
        endpoint: SocketAddr,
    ) -> Self {
        Chunk(Box::new(Piece {
            op,
            cost: frame.bytes(),
            frame,
            local,
            submit: Some(submit.clone()),
            endpoint,
            resent: false,
        }))
    }

    /// What the chunk takes of its connection's window while in flight: its
    /// bytes, capped at the window so that any chunk fits on its own.
    pub(crate) fn cost(&self, window: u32) -> u32 {
        self.cost.min(window.into()).max(1) as u32
    }

    /// The request kind of an op's chunk.
    pub(crate) fn op_kind(&self) -> Option<RequestKind> {
        match self.frame {
            ClientFrame::Op(request) => Some(request.kind),
            ClientFrame::Ranges(ranges) => Some(ranges.kind),
            ClientFrame::Notify(_) => None,
        }
    }

    /// The local ranges of a [`Local::Ranges`] chunk: empty for any other.
    pub(crate) fn ranges(&self) -> &[LocalRange] {
        match &self.local {
            Local::Ranges { ranges, .. } => ranges,
            _ => &[],
        }
    }

    /// The first byte of local range `range`.
    pub(crate) fn range_ptr(&self, range: &LocalRange) -> *mut u8 {
        match &self.local {
            // SAFETY: `offset + len` lies within the region (each range is
            // an op's bounds-checked local slice).
            Local::Ranges { region, .. } => unsafe { region.memory().as_ptr().add(range.offset) },
            _ => unreachable!("only a ranges chunk has ranges"),
        }
    }

    /// First byte of the local range this chunk reads from or writes to.
    pub(crate) fn local_ptr(&self) -> *mut u8 {
        match &self.local {
            // SAFETY: `offset + len` lies within the region (the op's local
            // slice was bounds-checked and chunks partition it).
            Local::Region { region, offset } => unsafe { region.memory().as_ptr().add(*offset) },
            // Its bytes are at each range's own pointer (`range_ptr`).
            Local::Ranges { region, .. } => region.memory().as_ptr(),
            // Only ever sent from, never written to.
            Local::Notification { body, .. } => body.as_ptr().cast_mut(),
        }
    }

    /// The chunk as it may still go once its submit was answered: an op's
    /// chunk never goes on the wire (it is finished here); a notification
    /// goes as a discard, so that the owner forgets the batch.
    pub(crate) fn unless_abandoned(mut self) -> Option<Self> {
        if !self.submit.as_ref().is_some_and(|s| s.is_abandoned()) {
            return Some(self);
        }
        let piece = &mut *self.0;
        match (&mut piece.frame, &mut piece.local) {
            (ClientFrame::Notify(notify), Local::Notification { body, .. }) => {
                notify.discard = true;
                notify.len = 0;
                *body = Bytes::new();
                Some(self)
            }
            _ => {
                self.finish(Ok(()));
                None
            }
        }
    }

    pub(crate) fn finish(mut self, result: Result<(), OpError>) {
        self.settle(result.map_err(|e| (0, e)));
    }

    /// Finishes a [`Local::Ranges`] chunk whose `range`-th op failed with
    /// `error`, none of them having moved.
    pub(crate) fn finish_at(mut self, range: usize, error: OpError) {
        self.settle(Err((range, error)));
    }

    /// Records the outcome once; later calls (and the drop) do nothing. An
    /// error names the op within the chunk, for a ranges chunk.
    fn settle(&mut self, result: Result<(), (usize, OpError)>) {
        let Some(submit) = self.submit.take() else {
            return;
        };
        match &self.local {
            Local::Ranges { ranges, .. } => submit.ops_done(self.op, ranges.len(), result),
            Local::Notification { outcome, .. } => {
                if let Err((_, e)) = &result {
                    _ = outcome.set(Err(e.clone()));
                }
                submit.piece_done(self.op, result.map_err(|(_, e)| e));
            }
            Local::Region { .. } => submit.piece_done(self.op, result.map_err(|(_, e)| e)),
        }
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        let endpoint = self.endpoint;
        self.settle(Err((0, OpError::connection_lost(endpoint))));
    }
}
