//! Layouts and plans, the facade's side: both sides declare how their
//! tensors lie in memory ([`ferry_layout`], re-exported as
//! [`crate::layout`]), the node compiles a plan once and prepares the
//! peers' memory once ([`Node::plan_transfer`]), and each request names
//! only block tables ([`TransferPlan::request`]). The expansion from block
//! tables to descriptors, the coalescing and the routing happen here, in
//! Rust: a connector's work per request is O(blocks), not O(layers × blocks
//! × heads).
//!
//! The same plan serves KV-cache hand-off (paged tensors, block tables per
//! request) and weight resharding (no paged tensor: every request moves
//! the same bytes).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ferry_core::{DescError, LocalDescList, OpKind, Region, RemoteBuffer, RemoteDescList};
use ferry_layout::{
    Direction, Expansion, LayoutError, Plan, PlanOptions, RankLayout, RequestError, TableRequest,
};

use crate::{Node, PrepareError, PreparedRemote, Xfer};

/// One rank's tensors in this node's memory: its layout, and the regions
/// the layout names, in the layout's region order (`regions[i]` is region
/// `i` of [`RankLayout::region_lens`]).
#[derive(Clone, Debug)]
pub struct LocalLayout {
    layout: RankLayout,
    regions: Vec<Region>,
}

/// Another rank's tensors: its layout (as it published it), and handles to
/// the regions the layout names, in its region order.
#[derive(Clone, Debug)]
pub struct PeerLayout {
    layout: RankLayout,
    regions: Vec<RemoteBuffer>,
}

/// Why a layout could not be used, a plan made, or a request built from it.
/// Nothing moved in any case.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The layouts do not describe one transfer (see [`LayoutError`]).
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A request's block tables do not fit the plan (see [`RequestError`]).
    #[error(transparent)]
    Request(#[from] RequestError),
    /// Rank `rank`'s layout names `expected` regions, and `given` came with
    /// it.
    #[error("rank {rank}'s layout names {expected} regions; {given} were given")]
    RegionCount {
        /// The rank.
        rank: u32,
        /// Regions its layout names.
        expected: usize,
        /// Regions given.
        given: usize,
    },
    /// Region `region` of rank `rank` is shorter than its layout says.
    #[error("region {region} of rank {rank} has {len} bytes; its layout says {declared}")]
    RegionTooShort {
        /// The rank.
        rank: u32,
        /// The region's index in the rank's layout.
        region: usize,
        /// Its length.
        len: u64,
        /// The length the layout declares.
        declared: u64,
    },
    /// Two of the peers given are the same rank.
    #[error("rank {0} is given twice")]
    DuplicateRank(u32),
    /// A peer's published layout is not the one the plan was made from:
    /// plan again.
    #[error("rank {rank}'s layout changed since the plan was made: plan again")]
    LayoutChanged {
        /// The rank.
        rank: u32,
    },
    /// A peer's published layout is not known here (see
    /// [`Node::peer_layout`]).
    #[error(transparent)]
    Lookup(#[from] ferry_discovery::LookupError),
    /// The peers' memory could not be prepared (see [`PrepareError`]).
    #[error(transparent)]
    Prepare(#[from] PrepareError),
    /// A descriptor the plan made was refused: a plan is checked against
    /// its regions when made, so this is a bug; nothing moved.
    #[error(transparent)]
    Desc(#[from] DescError),
}

/// Checks that `regions` (their lengths) match what `layout` declares.
fn check_regions(layout: &RankLayout, lens: &[u64]) -> Result<(), PlanError> {
    if lens.len() != layout.region_lens.len() {
        return Err(PlanError::RegionCount {
            rank: layout.rank,
            expected: layout.region_lens.len(),
            given: lens.len(),
        });
    }
    for (region, (&len, &declared)) in lens.iter().zip(&layout.region_lens).enumerate() {
        if len < declared {
            return Err(PlanError::RegionTooShort {
                rank: layout.rank,
                region,
                len,
                declared,
            });
        }
    }
    Ok(())
}

impl LocalLayout {
    /// `layout` over `regions`, each at least as long as the layout says.
    pub fn new(layout: RankLayout, regions: Vec<Region>) -> Result<Self, PlanError> {
        let lens: Vec<u64> = regions.iter().map(Region::len).collect();
        check_regions(&layout, &lens)?;
        Ok(LocalLayout { layout, regions })
    }

    /// The layout.
    pub fn layout(&self) -> &RankLayout {
        &self.layout
    }

    /// The regions, in the layout's order.
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    /// This rank as peers see it: the layout, with handles to its regions.
    pub fn remote(&self) -> PeerLayout {
        PeerLayout {
            layout: self.layout.clone(),
            regions: self.regions.iter().map(Region::remote).collect(),
        }
    }
}

impl PeerLayout {
    /// `layout` over the regions `regions` names, each at least as long as
    /// the layout says.
    pub fn new(layout: RankLayout, regions: Vec<RemoteBuffer>) -> Result<Self, PlanError> {
        let lens: Vec<u64> = regions.iter().map(RemoteBuffer::len).collect();
        check_regions(&layout, &lens)?;
        Ok(PeerLayout { layout, regions })
    }

    /// The layout.
    pub fn layout(&self) -> &RankLayout {
        &self.layout
    }

    /// The handles, in the layout's order.
    pub fn regions(&self) -> &[RemoteBuffer] {
        &self.regions
    }
}

/// A plan compiled once, over memory prepared once: each request gives only
/// block tables ([`TransferPlan::request`]). Cheap to clone.
#[derive(Clone)]
pub struct TransferPlan {
    node: Node,
    plan: Arc<Plan>,
    kind: OpKind,
    /// The local regions the plan's descriptors name, in its order.
    local: Vec<Region>,
    /// The remote regions the plan's descriptors name, routed and
    /// connected.
    prepared: PreparedRemote,
    /// Pairs in the last request expanded: the next one's arrays start at
    /// that size.
    last_len: Arc<AtomicUsize>,
}

impl std::fmt::Debug for TransferPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferPlan")
            .field("kind", &self.kind)
            .field("segments", &self.plan.segment_count())
            .field("local_regions", &self.local.len())
            .field("remote_regions", &self.prepared.list().regions().len())
            .finish_non_exhaustive()
    }
}

/// A request's block table, kept until its descriptors are expanded.
struct OwnedTable {
    table: String,
    range: std::ops::Range<u64>,
    local: Vec<u64>,
    remote: Vec<u64>,
}

impl OwnedTable {
    fn from(request: &TableRequest<'_>) -> Self {
        OwnedTable {
            table: request.table.to_owned(),
            range: request.range.clone(),
            local: request.local.to_vec(),
            remote: request.remote.to_vec(),
        }
    }

    fn borrow(&self) -> TableRequest<'_> {
        TableRequest {
            table: &self.table,
            range: self.range.clone(),
            local: &self.local,
            remote: &self.remote,
        }
    }
}

impl Node {
    /// Compiles the plan that moves, for every tensor `local` holds, its
    /// bytes between this node's memory and the ranks of `remote`
    /// ([`ferry_layout::plan`]: READs for [`Direction::Pull`], WRITEs for
    /// [`Direction::Push`]), and prepares the peers' memory within
    /// `timeout` ([`Node::prepare_remote`]: routed, connected, mapped).
    /// Bad layouts are refused here, with what is wrong; nothing moves.
    pub async fn plan_transfer(
        &self,
        local: &LocalLayout,
        remote: &[PeerLayout],
        options: PlanOptions<'_>,
        timeout: Duration,
    ) -> Result<TransferPlan, PlanError> {
        let mut ranks: Vec<u32> = remote.iter().map(|p| p.layout.rank).collect();
        ranks.sort_unstable();
        if let Some(pair) = ranks.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(PlanError::DuplicateRank(pair[0]));
        }
        let layouts: Vec<RankLayout> = remote.iter().map(|p| p.layout.clone()).collect();
        let plan = ferry_layout::plan(&local.layout, &layouts, options)?;
        let local_regions = plan
            .local_regions()
            .iter()
            .map(|&i| local.regions[i as usize].clone())
            .collect();
        let handles: Vec<RemoteBuffer> = plan
            .remote_regions()
            .iter()
            .map(|r| {
                let peer = remote
                    .iter()
                    .find(|p| p.layout.rank == r.rank)
                    .expect("the plan names only the ranks it was given");
                peer.regions[r.region as usize].clone()
            })
            .collect();
        // One descriptor over each whole region: preparing maps same-host
        // regions and starts filling in their pages.
        let mut whole = ferry_core::Descs::with_capacity(handles.len());
        for (i, handle) in handles.iter().enumerate() {
            whole.push(i as u32, 0, handle.len());
        }
        let list = RemoteDescList::new(handles, whole)?;
        let prepared = self.prepare_remote(list, timeout).await?;
        let kind = match plan.direction() {
            Direction::Pull => OpKind::Read,
            Direction::Push => OpKind::Write,
        };
        Ok(TransferPlan {
            node: self.clone(),
            plan: Arc::new(plan),
            kind,
            local: local_regions,
            prepared,
            last_len: Arc::default(),
        })
    }
}

impl TransferPlan {
    /// The request for `tables` (for a plan without paged tensors: none),
    /// ready to post ([`Xfer::post`]): every descriptor it moves, expanded
    /// from the plan and coalesced where both sides continue. Notify it
    /// with [`Xfer::with_notification`]: every source (or destination) rank
    /// gets the notification once its bytes have moved. A block table that
    /// does not fit the plan is refused, naming the table, the side and
    /// the position; nothing moves.
    ///
    /// The caller's thread only checks the tables and keeps a copy of
    /// them: O(blocks). The descriptors (O(layers × blocks × heads)) are
    /// expanded by the node's runtime at the first post, once: a
    /// scheduler's step pays microseconds per request, not the
    /// milliseconds a large hand-off's tens of thousands of descriptors
    /// take to make.
    pub fn request(&self, tables: &[TableRequest<'_>]) -> Result<Xfer, PlanError> {
        self.plan.check(tables)?;
        let tables: Vec<OwnedTable> = tables.iter().map(OwnedTable::from).collect();
        let (plan, local) = (self.plan.clone(), self.local.clone());
        let prepared = self.prepared.clone();
        let last_len = self.last_len.clone();
        let expand = move || {
            let tables: Vec<TableRequest<'_>> = tables.iter().map(OwnedTable::borrow).collect();
            let mut expansion = Expansion::with_capacity(last_len.load(Ordering::Relaxed));
            plan.expand(&tables, &mut expansion)
                .expect("tables checked when the request was made");
            last_len.store(expansion.len(), Ordering::Relaxed);
            let (local_descs, remote_descs, _) = expansion.into_parts();
            let local = LocalDescList::new(local.clone(), local_descs)?;
            Ok((local, prepared.with_descs(remote_descs)?))
        };
        Ok(self
            .node
            .deferred_xfer(self.kind, &self.prepared, Arc::new(expand)))
    }

    /// The descriptors a request for `tables` moves, without making it:
    /// to inspect a plan, or to hand the descriptors to another engine.
    pub fn expand(&self, tables: &[TableRequest<'_>]) -> Result<Expansion, PlanError> {
        let mut expansion = Expansion::new();
        self.plan.expand(tables, &mut expansion)?;
        Ok(expansion)
    }

    /// The compiled plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// READ (the plan pulls) or WRITE (it pushes).
    pub fn kind(&self) -> OpKind {
        self.kind
    }

    /// Whether the plan still matches the peers' layouts as they are now
    /// (fetched again, say): a peer whose layout changed fails with
    /// [`PlanError::LayoutChanged`], and the plan must be made again.
    pub fn check_current(&self, peers: &[PeerLayout]) -> Result<(), PlanError> {
        for &(rank, fingerprint) in self.plan.remote_fingerprints() {
            let now = peers.iter().find(|p| p.layout.rank == rank);
            if now.is_none_or(|p| p.layout.fingerprint() != fingerprint) {
                return Err(PlanError::LayoutChanged { rank });
            }
        }
        Ok(())
    }
}
