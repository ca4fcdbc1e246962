//! Planning a batch's copies: each op's mapping or grant and where its
//! remote bytes are in it, looked up once per owner and, for a run of ops
//! on one region (a prepared request's usual slice), once per run. A
//! batch's mappings and grants are kept once each in its [`Seen`], which
//! its planned ops name by index: no reference count moves per op.

use std::sync::Arc;

use ferry_core::{Generation, NodeId, OpError, OpKind, RdmaOp, RegionId, RemoteBuffer};

use crate::target::Target;
use crate::{MemoryBackend, peer};

impl MemoryBackend {
    /// Where `op`'s remote bytes are: its target's index in `seen` and the
    /// address there ([`Seen::locate`]); `None` for an empty op. Each
    /// owner is looked up and checked once per batch, and a run of ops on
    /// one region (a prepared request's usual slice) takes its mapping
    /// without the link's lock and table.
    pub(crate) async fn plan(
        &self,
        op: &RdmaOp,
        seen: &mut Seen,
    ) -> Result<Option<(u32, u64)>, OpError> {
        if op.is_empty() {
            return Ok(None);
        }
        let target = self.target(&op.remote, op.kind, seen).await?;
        Ok(Some((
            target,
            seen.locate(target, op.remote.addr(), op.len())?,
        )))
    }

    /// [`plan`](Self::plan) from what is known here, without waiting:
    /// `None` when the owner must be asked for the op's region first.
    pub(crate) fn plan_known(
        &self,
        op: &RdmaOp,
        seen: &mut Seen,
    ) -> Result<Option<Option<(u32, u64)>>, OpError> {
        if op.is_empty() {
            return Ok(Some(None));
        }
        let Known::Target(target) = self.known_target(&op.remote, op.kind, seen)? else {
            return Ok(None);
        };
        let remote = seen.locate(target, op.remote.addr(), op.len())?;
        Ok(Some(Some((target, remote))))
    }

    /// The mapping or grant that serves `kind` ops on `remote`'s region,
    /// as its index in `seen`, asking the owner if it must.
    pub(crate) async fn target(
        &self,
        remote: &RemoteBuffer,
        kind: OpKind,
        seen: &mut Seen,
    ) -> Result<u32, OpError> {
        match self.known_target(remote, kind, seen)? {
            Known::Target(target) => Ok(target),
            Known::Ask(link, key) => {
                let target = link.mapping_for(remote, kind == OpKind::Write).await?;
                Ok(seen.add(key, link, target))
            }
        }
    }

    /// [`target`](Self::target) from what is known here, without waiting.
    fn known_target(
        &self,
        remote: &RemoteBuffer,
        kind: OpKind,
        seen: &mut Seen,
    ) -> Result<Known, OpError> {
        let key = key_of(remote);
        if let Some(last) = &seen.last
            && last.key == key
            && (kind == OpKind::Read || seen.targets[last.target as usize].1.writable())
        {
            return Ok(Known::Target(last.target));
        }
        let owner = remote.owner();
        let link = match seen.links.iter().find(|(id, _)| *id == owner.id) {
            Some((_, link)) => link.clone()?,
            None => {
                let link = self.link_to(owner);
                seen.links.push((owner.id, link.clone()));
                link?
            }
        };
        match link.cached_mapping(remote, kind == OpKind::Write) {
            None => Ok(Known::Ask(link, key)),
            Some(target) => Ok(Known::Target(seen.add(key, link, target?))),
        }
    }

    /// The link to a live `owner`.
    fn link_to(&self, owner: ferry_core::NodeAddr) -> Result<Arc<peer::Link>, OpError> {
        let Some(link) = self.0.links.get(owner) else {
            return Err(OpError::PeerUnreachable {
                endpoint: owner.endpoint,
                reason: "not reachable over the same-host socket".into(),
            });
        };
        // `get` replaced a link the owner had closed while it still
        // listens, and remembered an owner that stopped as unreachable. A
        // link closed since (the owner refused it at its bound, or just
        // stopped) fails this op only: the next one connects afresh, or
        // finds the owner gone. One peek, no round trip.
        if !link.is_alive() {
            tracing::debug!(owner = %owner.endpoint, "memory transport: the owner closed its socket");
            return Err(OpError::connection_lost(owner.endpoint));
        }
        Ok(link)
    }
}

/// What [`MemoryBackend::known_target`] found.
enum Known {
    /// The target's index in the batch's [`Seen`].
    Target(u32),
    /// The region's link, whose owner must map or grant it first, and
    /// the region's target key.
    Ask(Arc<peer::Link>, TargetKey),
}

/// What a batch's planning looked up ([`MemoryBackend::plan`]): its links
/// and, once each, the mappings and grants its ops copy through.
#[derive(Default)]
pub(crate) struct Seen {
    /// Each owner's link, or why there is none.
    links: Vec<(NodeId, Result<Arc<peer::Link>, OpError>)>,
    /// The batch's mappings and grants, each with its link: planned ops
    /// name them by index.
    targets: Vec<(Arc<peer::Link>, Target)>,
    /// The last target taken, for the ops after it on the same region.
    last: Option<LastTarget>,
}

impl Seen {
    /// Keeps `target` (once: a target already kept keeps its index) as
    /// the last one taken, for `key`; its index.
    fn add(&mut self, key: TargetKey, link: Arc<peer::Link>, target: Target) -> u32 {
        let index = match self.targets.iter().position(|(_, t)| t.same(&target)) {
            Some(i) => i,
            None => {
                self.targets.push((link, target));
                self.targets.len() - 1
            }
        };
        let index = u32::try_from(index).expect("a batch names fewer than 2^32 regions");
        self.last = Some(LastTarget { key, target: index });
        index
    }

    /// Where the `len` bytes at the owner's address `addr` are in target
    /// `target`, after checking they lie in its region.
    pub(crate) fn locate(&self, target: u32, addr: u64, len: u64) -> Result<u64, OpError> {
        self.targets[target as usize].1.locate(addr, len)
    }

    /// The targets, in index order, and their links.
    pub(crate) fn into_targets(self) -> Vec<(Arc<peer::Link>, Target)> {
        self.targets
    }
}

/// The last target taken, and the handle fields it was granted for: an op
/// whose handle has the same ones gets the same answer from the link's
/// table (which checks generation, token and access), so it is not asked.
struct LastTarget {
    key: TargetKey,
    target: u32,
}

/// An op's owner, region, generation and memory token.
type TargetKey = (NodeId, RegionId, Generation, u128);

fn key_of(remote: &RemoteBuffer) -> TargetKey {
    let token = remote.transports().memory.map_or(0, |m| m.token);
    (
        remote.owner().id,
        remote.region(),
        remote.generation(),
        token,
    )
}
