//! Typed errors. Plan-time errors ([`LayoutError`]) name the rank, tensor
//! and axis they are about, so that a mismatch between two frameworks'
//! published layouts can be found without reading strides; request-time
//! errors ([`RequestError`]) name the table, side and position.

use std::fmt;

/// Which side of a plan a request-time error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The rank the plan was built for.
    Local,
    /// The peer's ranks.
    Remote,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

/// Why a plan was refused. Nothing is planned when one is found.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// An element size of 0 bytes.
    #[error("rank {rank}, tensor {tensor:?}: element size 0")]
    ZeroElemSize {
        /// The rank whose layout says so.
        rank: u32,
        /// The tensor.
        tensor: String,
    },
    /// An axis of size 0.
    #[error("rank {rank}, tensor {tensor:?}: axis {axis:?} has size 0")]
    EmptyAxis {
        /// The rank.
        rank: u32,
        /// The tensor.
        tensor: String,
        /// The axis's name.
        axis: String,
    },
    /// The whole tensor has more than `u64::MAX` bytes.
    #[error("rank {rank}, tensor {tensor:?}: more than 2^64 bytes")]
    TooLarge {
        /// The rank.
        rank: u32,
        /// The tensor.
        tensor: String,
    },
    /// `parts` or `strides` does not have one entry per axis.
    #[error("rank {rank}, tensor {tensor:?}: {field} has {found} entries for {expected} axes")]
    WrongDims {
        /// The rank.
        rank: u32,
        /// The tensor.
        tensor: String,
        /// `"parts"` or `"strides"`.
        field: &'static str,
        /// Axes of the tensor.
        expected: usize,
        /// Entries found.
        found: usize,
    },
    /// A [`Part::Split`](crate::Part::Split) with 0 parts, an index past
    /// the parts, or parts that do not divide the axis.
    #[error(
        "rank {rank}, tensor {tensor:?}, axis {axis:?} of {size}: split {index} of {parts} is not an equal part"
    )]
    BadSplit {
        /// The rank.
        rank: u32,
        /// The tensor.
        tensor: String,
        /// The axis's name.
        axis: String,
        /// The axis's size.
        size: u64,
        /// Parts asked for.
        parts: u64,
        /// Index asked for.
        index: u64,
    },
    /// A [`Part::Range`](crate::Part::Range) that is empty or leaves the
    /// axis.
    #[error(
        "rank {rank}, tensor {tensor:?}, axis {axis:?} of {size}: range {start}+{len} is empty or leaves the axis"
    )]
    PartOutOfAxis {
        /// The rank.
        rank: u32,
        /// The tensor.
        tensor: String,
        /// The axis's name.
        axis: String,
        /// The axis's size.
        size: u64,
        /// First index of the range.
        start: u64,
        /// Its length.
        len: u64,
    },
    /// A region map or paged axis names an axis the tensor does not have.
    #[error("rank {rank}, tensor {tensor:?}: {what} names axis {axis} of {dims}")]
    NoSuchAxis {
        /// The rank.
        rank: u32,
        /// The tensor.
        tensor: String,
        /// `"region map"` or `"paged axis"`.
        what: &'static str,
        /// The axis index given.
        axis: u32,
        /// Axes of the tensor.
        dims: usize,
    },
    /// A region index not in the rank's region table.
    #[error("rank {rank}, tensor {tensor:?}: region {region} of {regions}")]
    NoSuchRegion {
        /// The rank.
        rank: u32,
        /// The tensor.
        tensor: String,
        /// The region index given.
        region: u32,
        /// Regions in the table.
        regions: usize,
    },
    /// A region map without one place per rank-local index of its axis.
    #[error(
        "rank {rank}, tensor {tensor:?}: region map of axis {axis:?} has {found} places for {expected} indices"
    )]
    RegionMapLen {
        /// The rank.
        rank: u32,
        /// The tensor.
        tensor: String,
        /// The mapped axis's name.
        axis: String,
        /// Rank-local indices of the axis.
        expected: u64,
        /// Places given.
        found: usize,
    },
    /// A paged axis that cannot be used: see `reason`.
    #[error("rank {rank}, tensor {tensor:?}: paged axis: {reason}")]
    BadPaging {
        /// The rank.
        rank: u32,
        /// The tensor.
        tensor: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// Two elements of one piece could share a byte: the stride of `axis`
    /// is smaller than the extent of the axes inside it. The check is
    /// sufficient, not exact: axes sorted by stride, each stride must be
    /// at least the byte extent of everything with a smaller stride (and
    /// places of a region map must not overlap).
    #[error("rank {rank}, tensor {tensor:?}: elements may share bytes (stride of {axis})")]
    Aliased {
        /// The rank.
        rank: u32,
        /// The tensor.
        tensor: String,
        /// The axis whose stride is too small (`"<axis> blocks"` for a
        /// paged axis's block stride, `"<axis> places"` for a region map).
        axis: String,
    },
    /// A byte of the piece (including the last physical block of a paged
    /// axis) lies past its region's end.
    #[error("rank {rank}, tensor {tensor:?}: bytes up to {end} in region {region} of {len} bytes")]
    OutOfRegion {
        /// The rank.
        rank: u32,
        /// The tensor.
        tensor: String,
        /// The region index.
        region: u32,
        /// One past the last byte the piece may touch (`u64::MAX` on
        /// overflow).
        end: u64,
        /// The region's length.
        len: u64,
    },
    /// One rank lists the same tensor twice.
    #[error("rank {rank} lists tensor {tensor:?} twice")]
    DuplicateTensor {
        /// The rank.
        rank: u32,
        /// The tensor.
        tensor: String,
    },
    /// Two ranks of one side have the same id.
    #[error("rank {rank} appears twice on one side")]
    DuplicateRank {
        /// The rank id.
        rank: u32,
    },
    /// Two layouts name the same tensor but describe different logical
    /// tensors.
    #[error("tensor {tensor:?}: rank {rank} and rank {other} disagree on its {what}")]
    TensorMismatch {
        /// The tensor.
        tensor: String,
        /// One rank (the local one when sides disagree).
        rank: u32,
        /// The other rank.
        other: u32,
        /// `"element size"`, `"axes"`.
        what: &'static str,
    },
    /// No remote rank holds this element of a tensor (a rank missing).
    #[error("tensor {tensor:?}: no remote rank holds element {index:?}")]
    Gap {
        /// The tensor.
        tensor: String,
        /// Global index of an element nobody holds.
        index: Vec<u64>,
    },
    /// Two ranks claim the same elements without both marking identical
    /// pieces as replicated.
    #[error("tensor {tensor:?}: ranks {rank} and {other} claim the same elements")]
    Overlap {
        /// The tensor.
        tensor: String,
        /// One rank.
        rank: u32,
        /// The other.
        other: u32,
    },
    /// The local rank holds a tensor the remote side does not have.
    #[error("local tensor {tensor:?} is not on the remote side")]
    MissingRemote {
        /// The tensor.
        tensor: String,
    },
    /// A remote rank holds a tensor the local rank does not (an error only
    /// with [`PlanOptions::every_remote_tensor`](crate::PlanOptions)).
    #[error("remote rank {rank}'s tensor {tensor:?} is not on the local rank")]
    MissingLocal {
        /// The tensor.
        tensor: String,
        /// The remote rank holding it.
        rank: u32,
    },
    /// The two sides page a tensor differently: one pages it and the other
    /// does not, or they page different axes or through different tables.
    #[error("tensor {tensor:?}: local rank {rank} and remote rank {other} page it differently")]
    PagingMismatch {
        /// The tensor.
        tensor: String,
        /// The local rank.
        rank: u32,
        /// The remote rank.
        other: u32,
    },
    /// Tensors paged through one table disagree, on one side, on the
    /// elements per block (one table cannot serve two block sizes).
    #[error("table {table:?}: {side} tensors use blocks of {block} and {other} elements")]
    TableMismatch {
        /// The table.
        table: String,
        /// The side.
        side: Side,
        /// One block size.
        block: u64,
        /// Another.
        other: u64,
    },
    /// The local rank appears in [`PlanOptions::local_peers`](crate::PlanOptions)
    /// with another layout.
    #[error("local rank {rank} appears among the local peers with another layout")]
    LocalPeerMismatch {
        /// The rank.
        rank: u32,
    },
    /// A helper was given an axis order that is not a permutation of the
    /// tensor's axis names.
    #[error("tensor {tensor:?}: axis order {order:?} is not a permutation of its axes")]
    BadAxisOrder {
        /// The tensor.
        tensor: String,
        /// The order given.
        order: Vec<String>,
    },
    /// A helper's tensor-parallel degree neither divides nor is a multiple
    /// of the axis size.
    #[error("axis of {size} cannot be shared by {tp} ranks")]
    BadTp {
        /// The axis size.
        size: u64,
        /// The degree.
        tp: u64,
    },
}

/// Why a request was refused. Nothing is appended when one is found.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The plan pages tensors through this table; the request gives none.
    #[error("table {table:?} is missing from the request")]
    MissingTable {
        /// The table.
        table: String,
    },
    /// The request names a table the plan does not use (a typo would
    /// otherwise move nothing, silently).
    #[error("table {table:?} is not used by this plan")]
    UnknownTable {
        /// The table.
        table: String,
    },
    /// The request names a table twice.
    #[error("table {table:?} appears twice in the request")]
    DuplicateTable {
        /// The table.
        table: String,
    },
    /// The range is reversed or leaves the paged axis.
    #[error("table {table:?}: range {start}..{end} leaves the paged axis of {size}")]
    RangeOutOfAxis {
        /// The table.
        table: String,
        /// Range start.
        start: u64,
        /// Range end.
        end: u64,
        /// Axis size.
        size: u64,
    },
    /// A block table has fewer entries than the range needs.
    #[error("table {table:?}: {side} block table has {len} entries, the range needs {needed}")]
    TableTooShort {
        /// The table.
        table: String,
        /// Which side's block table.
        side: Side,
        /// Entries given.
        len: usize,
        /// Entries needed.
        needed: u64,
    },
    /// A block id past the pool.
    #[error(
        "table {table:?}: {side} block table position {position} names block {block} of a pool of {blocks}"
    )]
    BlockOutOfPool {
        /// The table.
        table: String,
        /// Which side's block table.
        side: Side,
        /// Position in that block table.
        position: usize,
        /// The block id found there.
        block: u64,
        /// Blocks in the pool.
        blocks: u64,
    },
    /// NIXL index arrays address whole sub-blocks: the range must start
    /// and end on a multiple of `granule` (the greatest common divisor of
    /// both sides' block sizes), or at the axis end.
    #[error("table {table:?}: range {start}..{end} is not aligned to {granule} elements")]
    Unaligned {
        /// The table.
        table: String,
        /// Range start.
        start: u64,
        /// Range end.
        end: u64,
        /// The alignment needed.
        granule: u64,
    },
}
