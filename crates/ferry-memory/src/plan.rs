//! Planning a batch's copies: each op's link and where its remote bytes
//! are, looked up once per owner and, for a run of ops on one region (a
//! prepared request's usual slice), once per run.

use std::sync::Arc;

use ferry_core::{Generation, NodeId, OpError, OpKind, RdmaOp, RegionId};

use crate::{MemoryBackend, copy, peer};

impl MemoryBackend {
    /// `op`'s link, and where its remote bytes are; `None` for an empty
    /// op. `seen` holds what this batch already looked up: each owner is
    /// looked up and checked once per batch, and a run of ops on one
    /// region (a prepared request's usual slice) takes its mapping without
    /// the link's lock and table.
    pub(crate) async fn plan(
        &self,
        op: &RdmaOp,
        seen: &mut Seen,
    ) -> Result<Option<(Arc<peer::Link>, copy::Located)>, OpError> {
        match self.plan_known(op, seen)? {
            Step::Planned(planned) => Ok(planned),
            Step::Ask(link, key) => {
                let target = link.mapping(op).await?;
                seen.last = Some(LastTarget {
                    key,
                    target: target.clone(),
                });
                Ok(Some((link, locate(target, op)?)))
            }
        }
    }

    /// [`plan`](Self::plan) from what is known here, without waiting:
    /// `Ask` when the owner must be asked for the op's region first.
    pub(crate) fn plan_known(&self, op: &RdmaOp, seen: &mut Seen) -> Result<Step, OpError> {
        if op.is_empty() {
            return Ok(Step::Planned(None));
        }
        let owner = op.remote.owner();
        let link = match seen.links.iter().find(|(id, _)| *id == owner.id) {
            Some((_, link)) => link.clone()?,
            None => {
                let link = self.link_to(owner);
                seen.links.push((owner.id, link.clone()));
                link?
            }
        };
        let key = LastTarget::key_of(op);
        let target = match &seen.last {
            Some(last) if last.serves(&key, op) => last.target.clone(),
            _ => match link.cached_mapping(&op.remote, op.kind == OpKind::Write) {
                None => return Ok(Step::Ask(link, key)),
                Some(target) => {
                    let target = target?;
                    seen.last = Some(LastTarget {
                        key,
                        target: target.clone(),
                    });
                    target
                }
            },
        };
        Ok(Step::Planned(Some((link, locate(target, op)?))))
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

/// Where `op`'s remote bytes are in `target`, after checking they lie in
/// its region.
fn locate(target: peer::Target, op: &RdmaOp) -> Result<copy::Located, OpError> {
    Ok(match target {
        peer::Target::Mapped(mapping) => {
            let remote = mapping.locate(op)?;
            copy::Located::Mapped { mapping, remote }
        }
        peer::Target::ProcessVm(grant) => {
            let remote = grant.locate(op)?;
            copy::Located::ProcessVm { grant, remote }
        }
    })
}

/// What [`MemoryBackend::plan_known`] found.
pub(crate) enum Step {
    /// The op's link and where its bytes are (`None`: an empty op).
    Planned(Option<(Arc<peer::Link>, copy::Located)>),
    /// The op's link, whose owner must map or grant its region first, and
    /// the op's target key.
    Ask(Arc<peer::Link>, TargetKey),
}

/// What a batch's planning already looked up ([`MemoryBackend::plan`]).
#[derive(Default)]
pub(crate) struct Seen {
    /// Each owner's link, or why there is none.
    links: Vec<(NodeId, Result<Arc<peer::Link>, OpError>)>,
    /// The last mapping or grant taken, for the ops after it on the same
    /// region.
    last: Option<LastTarget>,
}

/// A mapping or grant, and the handle fields it was granted for: an op
/// whose handle has the same ones gets the same answer from the link's
/// table (which checks generation, token and access), so it is not asked.
struct LastTarget {
    key: TargetKey,
    target: peer::Target,
}

/// An op's owner, region, generation and memory token.
type TargetKey = (NodeId, RegionId, Generation, u128);

impl LastTarget {
    fn key_of(op: &RdmaOp) -> TargetKey {
        let remote = &op.remote;
        let token = remote.transports().memory.map_or(0, |m| m.token);
        (
            remote.owner().id,
            remote.region(),
            remote.generation(),
            token,
        )
    }

    /// Whether `op`, whose key is `key`, may use this target.
    fn serves(&self, key: &TargetKey, op: &RdmaOp) -> bool {
        self.key == *key && (op.kind == OpKind::Read || self.target.writable())
    }
}
