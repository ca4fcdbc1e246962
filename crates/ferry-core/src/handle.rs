use std::ops::Range;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::{Generation, NodeAddr, OpError, RegionId};

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
/// The fields are private so that code holding a handle can only narrow it
/// (sub-slice, drop write access). A handle forged or altered on the wire is
/// still checked by the owner against the region's real bounds and access.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "HandleFields", into = "HandleFields")]
pub struct RemoteBuffer {
    /// What every view of one registration shares, counted rather than
    /// copied: a prepared request slices a handle per descriptor, and the
    /// copies of these 150-odd bytes were a fifth of a small descriptor's
    /// cost on the initiator (callgrind).
    shared: Arc<Registration>,
    addr: u64,
    len: u64,
}

/// The part of a handle that slicing does not change.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Registration {
    owner: NodeAddr,
    region: RegionId,
    generation: Generation,
    access: Access,
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
}

impl From<HandleFields> for RemoteBuffer {
    fn from(f: HandleFields) -> Self {
        RemoteBuffer::new(
            f.owner,
            f.region,
            f.generation,
            f.addr,
            f.len,
            f.access,
            f.transports,
        )
    }
}

impl From<RemoteBuffer> for HandleFields {
    fn from(h: RemoteBuffer) -> Self {
        let Registration {
            owner,
            region,
            generation,
            access,
            ref transports,
        } = *h.shared;
        HandleFields {
            owner,
            region,
            generation,
            addr: h.addr,
            len: h.len,
            access,
            transports: transports.clone(),
        }
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
            .field("access", &self.shared.access)
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
            transports,
        };
        RemoteBuffer {
            shared: Arc::new(shared),
            addr,
            len,
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
    /// What the handle allows. The owner checks it against the region's own
    /// access, so a forged handle gains nothing.
    pub fn access(&self) -> Access {
        self.shared.access
    }
    /// The credentials per transport; one that is `None` cannot reach the
    /// region.
    pub fn transports(&self) -> &RemoteTransports {
        &self.shared.transports
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
    /// inside it.
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
        })
    }

    /// The same view without write access: its TCP and same-host tokens
    /// are replaced by read-only ones ([`crate::read_only_token`]), which
    /// their owner accepts for reads only, so that editing the handle's
    /// access back does not let it write. Over ibverbs the handle still
    /// carries the region's rkey, which the NIC accepts for writes too.
    /// A handle already without write access is returned as it is.
    pub fn read_only(&self) -> RemoteBuffer {
        if !self.access().allows_write() {
            return self.clone();
        }
        let mut transports = self.transports().clone();
        if let Some(tcp) = &mut transports.tcp {
            tcp.token = crate::read_only_token(tcp.token);
        }
        if let Some(memory) = &mut transports.memory {
            memory.token = crate::read_only_token(memory.token);
        }
        let shared = Registration {
            access: Access::ReadOnly,
            transports,
            ..(*self.shared).clone()
        };
        RemoteBuffer {
            shared: Arc::new(shared),
            addr: self.addr,
            len: self.len,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NodeId;

    fn handle() -> RemoteBuffer {
        RemoteBuffer::new(
            NodeAddr {
                id: NodeId(1),
                endpoint: "127.0.0.1:1".parse().unwrap(),
            },
            RegionId(3),
            Generation(1),
            0x1000,
            100,
            Access::ReadWrite,
            RemoteTransports {
                tcp: Some(TcpRemote { token: 42 }),
                ibverbs: None,
                memory: None,
            },
        )
    }

    #[test]
    fn slicing_narrows_and_never_widens() {
        let h = handle();
        let s = h.slice(10..30).unwrap();
        assert_eq!((s.addr(), s.len()), (0x1000 + 10, 20));
        let t = s.slice(5..20).unwrap();
        assert_eq!((t.addr(), t.len()), (0x1000 + 15, 15));
        assert!(matches!(
            s.slice(0..21),
            Err(OpError::OutOfBounds { bound: 20, .. })
        ));
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = s.slice(5..4);
        assert_eq!(reversed, Err(OpError::InvertedRange { start: 5, end: 4 }));
        assert_eq!(h.read_only().access(), Access::ReadOnly);
    }

    #[test]
    fn a_read_only_handle_carries_read_only_tokens_once() {
        let mut h = handle();
        Arc::make_mut(&mut h.shared).transports.memory = Some(MemRemote {
            boot_id: 7,
            token: 43,
            process_vm: false,
        });
        let ro = h.read_only();
        let tcp = ro.transports().tcp.unwrap().token;
        let memory = ro.transports().memory.unwrap();
        assert_eq!(tcp, crate::read_only_token(42));
        assert_eq!(memory.token, crate::read_only_token(43));
        assert_eq!(memory.boot_id, 7);
        // Narrowing again changes nothing: the owner still accepts it.
        assert_eq!(ro.read_only(), ro);
        assert_eq!(ro.slice(0..10).unwrap().transports(), ro.transports());
    }

    #[test]
    fn bad_ranges_get_errors_that_say_what_is_wrong() {
        #[allow(clippy::reversed_empty_ranges)]
        let inverted = handle().slice(10..5).unwrap_err();
        assert_eq!(inverted, OpError::InvertedRange { start: 10, end: 5 });
        assert_eq!(
            inverted.to_string(),
            "range 10..5 is inverted: its end comes before its start"
        );
        // A real out-of-bounds range keeps its own error.
        assert_eq!(
            handle().slice(90..110),
            Err(OpError::OutOfBounds {
                offset: 90,
                len: 20,
                bound: 100
            })
        );
    }

    #[test]
    fn forged_handles_that_wrap_the_address_space_are_refused() {
        let forged = |addr: u64, len: u64| {
            let mut json = serde_json::to_value(handle()).unwrap();
            json["addr"] = addr.into();
            json["len"] = len.into();
            serde_json::from_value::<RemoteBuffer>(json).unwrap()
        };
        let huge = forged(0x1000, u64::MAX);
        let expected = OpError::AddressOverflow {
            addr: 0x1000,
            len: u64::MAX,
        };
        assert_eq!(huge.check_address_range(), Err(expected.clone()));
        // Slicing it refuses before looking at the range, even one that
        // lies inside the forged length.
        assert_eq!(huge.slice(0..10), Err(expected.clone()));
        // Errors a peer reports travel as serde; the forged values survive.
        let json = serde_json::to_string(&expected).unwrap();
        assert_eq!(serde_json::from_str::<OpError>(&json).unwrap(), expected);
        assert_eq!(
            expected.to_string(),
            "handle range 0x1000+18446744073709551615 wraps around the address space: \
             forged or corrupt handle"
        );

        let near_end = forged(u64::MAX - 10, 100);
        assert_eq!(
            near_end.slice(20..30),
            Err(OpError::AddressOverflow {
                addr: u64::MAX - 10,
                len: 100
            })
        );
        // Ending exactly at the top of the address space does not wrap.
        let at_end = forged(u64::MAX - 100, 100);
        assert_eq!(at_end.check_address_range(), Ok(()));
        assert_eq!(at_end.slice(90..100).unwrap().addr(), u64::MAX - 10);
    }

    #[test]
    fn rail_keys_travel_as_a_short_list_and_refuse_too_many() {
        let keys = RailKeys::new(&[0x11, 0x22]).unwrap();
        assert_eq!(
            (keys.get(1), keys.get(2), keys.len()),
            (Some(0x22), None, 2)
        );
        let json = serde_json::to_value(IbvRemote { rkeys: keys }).unwrap();
        assert_eq!(json, serde_json::json!({"rkeys": [0x11, 0x22]}));
        assert_eq!(
            serde_json::from_value::<IbvRemote>(json).unwrap().rkeys,
            keys
        );
        assert!(RailKeys::new(&[0; MAX_RAILS + 1]).is_none());
        let too_many = serde_json::json!({"rkeys": vec![1; MAX_RAILS + 1]});
        let error = serde_json::from_value::<IbvRemote>(too_many).unwrap_err();
        assert!(error.to_string().contains("at most 8 rails"), "{error}");
    }

    #[test]
    fn handle_round_trips_through_serde() {
        let h = handle();
        let json = serde_json::to_value(&h).unwrap();
        // 128-bit values travel as hex strings, which every JSON reader keeps exact.
        assert_eq!(
            json["transports"]["tcp"]["token"],
            "0000000000000000000000000000002a"
        );
        assert_eq!(serde_json::from_value::<RemoteBuffer>(json).unwrap(), h);
        let bad = serde_json::json!({"token": "not hex"});
        assert!(serde_json::from_value::<TcpRemote>(bad).is_err());
    }
}
