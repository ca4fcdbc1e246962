use std::ops::Range;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::{Generation, NodeAddr, OpError, RegionId, Scope, Scopes, scope_token};

/// What a remote handle allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Access {
    /// Peers may read; writes fail with [`OpError::ReadOnly`] (or, over
    /// ibverbs with a forged handle, are refused by the NIC).
    ReadOnly,
    /// Peers may read and write.
    ReadWrite,
}

impl Access {
    /// Whether a remote write is allowed.
    pub fn allows_write(self) -> bool {
        self == Access::ReadWrite
    }
}

/// What the TCP fallback needs to reach a region: an unguessable token that
/// proves the holder was given a handle by the owner.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TcpRemote {
    /// Random per registration ([`crate::random_u128`]); the owner compares
    /// it in constant time. Never logged: `Debug` redacts it.
    #[serde(with = "crate::ids::hex_u128")]
    pub token: u128,
}

impl std::fmt::Debug for TcpRemote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TcpRemote { token: <redacted> }")
    }
}

/// What the ibverbs backend needs to reach a region: the rkey of its memory
/// region on each of the owner's rails (a rail is one port of one RDMA
/// device; see `ferry_ibverbs`). The queue-pair exchange carries the
/// addresses; a handle carries only keys, a few bytes per rail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IbvRemote {
    /// The remote key on each of the owner's rails, by rail index.
    pub rkeys: RailKeys,
}

/// Most rails one node uses: more than the 8 NICs of today's largest GPU
/// servers, few enough for a key per rail to stay in a handle by value.
pub const MAX_RAILS: usize = 8;

/// One memory key per rail, by rail index: what a region's registration is
/// called on each of a node's rails (rails of one device share a key).
/// Serialized as a list of the keys.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct RailKeys {
    len: u8,
    keys: [u32; MAX_RAILS],
}

impl RailKeys {
    /// The keys, rail 0 first; `None` if there are more than [`MAX_RAILS`].
    pub fn new(keys: &[u32]) -> Option<Self> {
        let mut out = RailKeys {
            len: u8::try_from(keys.len()).ok()?,
            keys: [0; MAX_RAILS],
        };
        out.keys.get_mut(..keys.len())?.copy_from_slice(keys);
        Some(out)
    }

    /// The key on `rail`, if the registration has that rail.
    pub fn get(&self, rail: usize) -> Option<u32> {
        self.as_slice().get(rail).copied()
    }

    /// All keys, rail 0 first.
    pub fn as_slice(&self) -> &[u32] {
        &self.keys[..usize::from(self.len)]
    }

    /// How many rails have a key.
    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// Whether no rail has a key.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::fmt::Debug for RailKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.as_slice().iter().map(|k| format!("{k:#x}")))
            .finish()
    }
}

impl Serialize for RailKeys {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.as_slice().serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for RailKeys {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let keys = Vec::<u32>::deserialize(deserializer)?;
        RailKeys::new(&keys).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "{} rail keys: a node has at most {MAX_RAILS} rails",
                keys.len()
            ))
        })
    }
}

/// What the same-host memory transport needs to reach a region: the owner's
/// boot (a peer on another boot, i.e. another host or kernel, never tries
/// it), an unguessable token the owner checks before it hands out the
/// region's memory, and how that memory is reached: a memfd the peer maps
/// (memory ferry allocated), or `process_vm_readv`/`process_vm_writev`
/// (any other memory, e.g. `MemoryBlock::from_raw`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MemRemote {
    /// The owner's kernel boot id (`/proc/sys/kernel/random/boot_id`).
    #[serde(with = "crate::ids::hex_u128")]
    pub boot_id: u128,
    /// Random per registration; the owner compares it in constant time.
    /// Never logged: `Debug` redacts it.
    #[serde(with = "crate::ids::hex_u128")]
    pub token: u128,
    /// The region is reached with `process_vm_readv`/`process_vm_writev`
    /// rather than by mapping it. Absent from the JSON when false, so
    /// handles of memfd regions read the same as before it existed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub process_vm: bool,
}

impl std::fmt::Debug for MemRemote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MemRemote {{ boot_id: {:032x}, token: <redacted>, process_vm: {} }}",
            self.boot_id, self.process_vm
        )
    }
}

/// Per-transport credentials a region was registered with. A transport that is
/// `None` here cannot reach the region.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteTransports {
    /// Set when the owner's TCP backend registered the region.
    #[serde(default)]
    pub tcp: Option<TcpRemote>,
    /// Set when the owner's ibverbs backend registered the region.
    #[serde(default)]
    pub ibverbs: Option<IbvRemote>,
    /// Set when the owner's memory backend registered the region (memory
    /// ferry allocated, shared as a memfd; or other memory, reached with
    /// `process_vm_*` where the kernel permits).
    #[serde(default)]
    pub memory: Option<MemRemote>,
}

/// Serializable handle through which another node reads or writes (part of) a
/// region. It is also the remote half of an op: slice it to the bytes you want.
///
/// **A handle's view and its credentials.** A handle is a view (`addr`,
/// `len`, [`access`](Self::access)) and the credentials it was made or
/// received with: the region's own tokens, or tokens narrowed to a
/// [`Scope`] (see [`crate::scope_token`]). [`slice`](Self::slice) and
/// [`read_only`](Self::read_only) narrow the view only, which costs
/// nothing: an op through a view presents the credentials it came with,
/// and the owner checks the op against what they open. Serializing a
/// handle, the only way it leaves the process, narrows its credentials to
/// its view: the JSON of a slice carries TCP and same-host tokens that
/// open that slice and no more (and, for reads only, reads only), so
/// whoever receives it cannot widen it by editing the JSON. Over RDMA it
/// still carries the region's rkey, which the NIC checks against the
/// whole registration: there a slice is no boundary (see
/// `docs/security.md`).
///
/// The fields are private so that code holding a handle can only narrow it
/// (sub-slice, drop write access). A handle forged or altered on the wire is
/// still checked by the owner against the region's real bounds and access.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(from = "HandleFields")]
pub struct RemoteBuffer {
    /// What every view of one registration shares, counted rather than
    /// copied: a prepared request slices a handle per descriptor, and the
    /// copies of these 150-odd bytes were a fifth of a small descriptor's
    /// cost on the initiator (callgrind).
    shared: Arc<Registration>,
    addr: u64,
    len: u64,
    /// What this view allows: the credentials' access, or read-only.
    access: Access,
}

/// The part of a handle that slicing does not change: the credentials.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Registration {
    owner: NodeAddr,
    region: RegionId,
    generation: Generation,
    /// What the credentials allow, as far as the handle knows (the owner
    /// checks the region's own access too).
    access: Access,
    /// The range the credentials open: the innermost scope's, or for the
    /// region's own tokens the range the handle covered when it was made
    /// or received. A view that differs is narrowed when serialized.
    extent: (u64, u64),
    /// The scopes the credentials were narrowed through; empty for the
    /// region's own tokens.
    scopes: Scopes,
    transports: RemoteTransports,
}

/// A handle as serialized: flat, its fields in this order.
#[derive(Serialize, Deserialize)]
struct HandleFields {
    owner: NodeAddr,
    region: RegionId,
    generation: Generation,
    addr: u64,
    len: u64,
    access: Access,
    transports: RemoteTransports,
    /// Absent for the region's own tokens: such handles read as before
    /// scopes existed.
    #[serde(default, skip_serializing_if = "Scopes::is_empty")]
    scopes: Scopes,
}

impl From<HandleFields> for RemoteBuffer {
    fn from(f: HandleFields) -> Self {
        let extent = f.scopes.last().map_or((f.addr, f.len), |s| (s.addr, s.len));
        let narrowest = f.scopes.as_slice().iter().map(|s| s.access).min();
        let shared = Registration {
            owner: f.owner,
            region: f.region,
            generation: f.generation,
            access: narrowest.map_or(f.access, |a| a.min(f.access)),
            extent,
            scopes: f.scopes,
            transports: f.transports,
        };
        RemoteBuffer {
            shared: Arc::new(shared),
            addr: f.addr,
            len: f.len,
            // As the JSON says, even if more than its scopes allow: the
            // owner refuses what they do not.
            access: f.access,
        }
    }
}

impl Serialize for RemoteBuffer {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.fields()
            .map_err(serde::ser::Error::custom)?
            .serialize(serializer)
    }
}

impl std::fmt::Debug for RemoteBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteBuffer")
            .field("owner", &self.shared.owner)
            .field("region", &self.shared.region)
            .field("generation", &self.shared.generation)
            .field("addr", &self.addr)
            .field("len", &self.len)
            .field("access", &self.access)
            .field("scopes", &self.shared.scopes)
            .field("transports", &self.shared.transports)
            .finish()
    }
}

impl RemoteBuffer {
    pub(crate) fn new(
        owner: NodeAddr,
        region: RegionId,
        generation: Generation,
        addr: u64,
        len: u64,
        access: Access,
        transports: RemoteTransports,
    ) -> Self {
        let shared = Registration {
            owner,
            region,
            generation,
            access,
            extent: (addr, len),
            scopes: Scopes::default(),
            transports,
        };
        RemoteBuffer {
            shared: Arc::new(shared),
            addr,
            len,
            access,
        }
    }

    /// The node that registered the region, and where to reach it.
    pub fn owner(&self) -> NodeAddr {
        self.shared.owner
    }
    /// The region's slot on its owner.
    pub fn region(&self) -> RegionId {
        self.shared.region
    }
    /// The region's generation when the handle was made; the owner refuses
    /// the handle once the region is gone.
    pub fn generation(&self) -> Generation {
        self.shared.generation
    }
    /// Virtual address of the first byte of this view in the owner's process.
    pub fn addr(&self) -> u64 {
        self.addr
    }
    /// Length of this view in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the view is zero bytes long.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// What the view allows. The owner checks writes against the region's
    /// own access and the credentials' scopes, so a forged handle gains
    /// nothing.
    pub fn access(&self) -> Access {
        self.access
    }
    /// The credentials per transport; one that is `None` cannot reach the
    /// region. The TCP and same-host tokens open what [`scopes`](Self::scopes)
    /// says, which requests present beside them.
    pub fn transports(&self) -> &RemoteTransports {
        &self.shared.transports
    }
    /// The scopes the TCP and same-host credentials were narrowed through,
    /// outermost first: empty when they are the region's own. Not this
    /// view's range, which may be narrower (until serialized).
    pub fn scopes(&self) -> &Scopes {
        &self.shared.scopes
    }

    /// Fails if the view's address range wraps around the end of the address
    /// space — only a forged handle can; refusing it here means no later
    /// address arithmetic on the view can overflow.
    pub fn check_address_range(&self) -> Result<(), OpError> {
        match self.addr.checked_add(self.len) {
            Some(_) => Ok(()),
            None => Err(OpError::AddressOverflow {
                addr: self.addr,
                len: self.len,
            }),
        }
    }

    /// A narrower view: `range` (byte offsets, `u64`, `usize` or a literal:
    /// see [`crate::ByteOffset`]) is relative to this view and must lie
    /// inside it. Cheap (no hashing): the credentials narrow to the view
    /// when the handle is serialized.
    pub fn slice<T: crate::ByteOffset>(&self, range: Range<T>) -> Result<RemoteBuffer, OpError> {
        self.check_address_range()?;
        let range = crate::offset::byte_range(range)?;
        if range.end > self.len {
            return Err(OpError::OutOfBounds {
                offset: range.start,
                len: range.end - range.start,
                bound: self.len,
            });
        }
        Ok(RemoteBuffer {
            shared: self.shared.clone(),
            addr: self.addr + range.start,
            len: range.end - range.start,
            access: self.access,
        })
    }

    /// The same view without write access: writes through it fail here
    /// with [`OpError::ReadOnly`], and serialized, its TCP and same-host
    /// credentials open the view for reads only, so that editing the
    /// handle's access back does not let it write. Over ibverbs the handle
    /// still carries the region's rkey, which the NIC accepts for writes
    /// too.
    pub fn read_only(&self) -> RemoteBuffer {
        RemoteBuffer {
            access: Access::ReadOnly,
            ..self.clone()
        }
    }

    /// The handle as serialized: credentials narrowed to the view when it
    /// covers less than they open (a range inside, or reads only). The
    /// narrowed tokens are derived from the ones held ([`scope_token`]);
    /// a memfd region's same-host credentials are left out of a handle
    /// narrowed to part of its range, since what they open is the region's
    /// whole memfd: such a slice goes over another transport. Fails when
    /// the chain of scopes is full ([`crate::MAX_SCOPES`]).
    fn fields(&self) -> Result<HandleFields, String> {
        let r = &*self.shared;
        let range = (self.addr, self.len);
        let access = self.access.min(r.access);
        let mut fields = HandleFields {
            owner: r.owner,
            region: r.region,
            generation: r.generation,
            addr: self.addr,
            len: self.len,
            access: self.access,
            transports: r.transports.clone(),
            scopes: r.scopes,
        };
        if range == r.extent && access == r.access {
            return Ok(fields);
        }
        let scope = Scope {
            addr: self.addr,
            len: self.len,
            access,
        };
        fields.scopes = r.scopes.with(scope).ok_or_else(|| {
            format!(
                "a handle narrowed {} times cannot be narrowed again",
                crate::MAX_SCOPES
            )
        })?;
        let transports = &mut fields.transports;
        if let Some(tcp) = &mut transports.tcp {
            tcp.token = scope_token(tcp.token, &scope);
        }
        match &mut transports.memory {
            Some(memory) if !memory.process_vm && range != r.extent => transports.memory = None,
            Some(memory) => memory.token = scope_token(memory.token, &scope),
            None => {}
        }
        Ok(fields)
    }
}

#[cfg(test)]
mod tests;
