//! Gathering a batch's consecutive small ops on one region into one
//! [`Ranges`] request: a prepared request of thousands of 64-byte
//! descriptors then costs the connection a request header, a pending entry,
//! a window permit and a response per thousand descriptors, not per one.

use std::sync::Arc;

use ferry_core::{BatchProgress, Generation, NodeAddr, OpKind, RdmaOp, Region, RegionId, Scopes};

use crate::chunk::{Chunk, Local, LocalRange};
use crate::frame::{ClientFrame, MAX_RANGES, Ranges, Request, RequestKind};

/// Consecutive ops of a batch, each whole and small, to one region of one
/// owner in one direction, from one local region.
pub(crate) struct Gather {
    /// Index of the first op in the batch.
    first: usize,
    owner: NodeAddr,
    kind: OpKind,
    region: RegionId,
    generation: Generation,
    token: u128,
    /// The scopes `token` was narrowed through: an op with the same token
    /// has the same ones, unless one of them was forged, and then the
    /// owner checks both against the first's.
    scopes: Scopes,
    local: Region,
    ranges: Vec<LocalRange>,
    bytes: u64,
}

impl Gather {
    /// A gather of op `index` alone; `token` is the op's TCP token.
    pub(crate) fn start(index: usize, op: &RdmaOp, token: u128) -> Self {
        let mut gather = Gather {
            first: index,
            owner: op.remote.owner(),
            kind: op.kind,
            region: op.remote.region(),
            generation: op.remote.generation(),
            token,
            scopes: *op.remote.scopes(),
            local: op.local.region().clone(),
            ranges: Vec::new(),
            bytes: 0,
        };
        gather.push(op);
        gather
    }

    /// Whether op `index` may join: it follows the last op, goes where the
    /// others go with the same rights, and keeps the gather within
    /// `max_bytes` and [`MAX_RANGES`].
    pub(crate) fn takes(&self, index: usize, op: &RdmaOp, token: u128, max_bytes: u64) -> bool {
        let local = op.local.region();
        index == self.first + self.ranges.len()
            && self.ranges.len() < MAX_RANGES as usize
            && self.bytes + op.len() <= max_bytes
            && op.kind == self.kind
            && op.remote.region() == self.region
            && op.remote.generation() == self.generation
            && token == self.token
            && op.remote.owner() == self.owner
            // One registration: its clone pins every range's bytes.
            && local.id() == self.local.id()
            && local.generation() == self.local.generation()
    }

    /// Adds `op`, which [`Gather::takes`] accepted.
    pub(crate) fn push(&mut self, op: &RdmaOp) {
        self.ranges.push(LocalRange {
            remote: op.remote.addr(),
            // Inside the local region, whose length fits usize.
            offset: op.local.offset() as usize,
            len: op.len() as usize,
        });
        self.bytes += op.len();
    }

    /// The request that carries the gathered ops, and its bytes: a plain
    /// request for one op, a [`Ranges`] request for more.
    pub(crate) fn into_chunk(
        self,
        tag: u64,
        state: &Arc<BatchProgress>,
        endpoint: std::net::SocketAddr,
    ) -> (Chunk, u64) {
        let kind = match self.kind {
            OpKind::Read => RequestKind::Read,
            OpKind::Write => RequestKind::Write,
        };
        let (frame, local) = match self.ranges.as_slice() {
            [one] => {
                let request = Request {
                    kind,
                    id: 0,
                    region: self.region,
                    generation: self.generation,
                    addr: one.remote,
                    len: self.bytes,
                    token: self.token,
                    scopes: self.scopes,
                    tag,
                };
                let local = Local::Region {
                    region: self.local,
                    offset: one.offset,
                };
                (ClientFrame::Op(request), local)
            }
            _ => {
                let request = Ranges {
                    kind,
                    id: 0,
                    region: self.region,
                    generation: self.generation,
                    // At most MAX_RANGES (`takes`).
                    count: self.ranges.len() as u32,
                    len: self.bytes,
                    token: self.token,
                    scopes: self.scopes,
                    tag,
                };
                let local = Local::Ranges {
                    region: self.local,
                    ranges: self.ranges.into(),
                };
                (ClientFrame::Ranges(request), local)
            }
        };
        let chunk = Chunk::new(self.first, frame, local, state, endpoint);
        (chunk, self.bytes)
    }
}
