//! The bench's references (see its module docs): the same descriptor
//! pairs, and the same bytes in 1 MiB pieces, copied with `memcpy` on one
//! or two threads, or sent over loopback TCP with `writev` and `readv`
//! (`tcp.rs`: from the prefill process, as ferry's are).

use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::Instant;

use ferry::layout::Expansion;
use ferry::{LocalLayout, PeerLayout, TransferPlan};

use super::MIB;

/// Buffers laid out as a plan's regions on both sides, for the `memcpy`
/// reference (see the module docs).
pub struct MemcpyReference {
    local: Vec<Vec<u8>>,
    remote: Vec<Vec<u8>>,
    /// Each remote buffer's (rank, region) in the prefill process.
    origins: Vec<(u32, u32)>,
}

impl MemcpyReference {
    pub fn new(plan: &TransferPlan, local: &LocalLayout, peers: &[PeerLayout]) -> Self {
        let lens = local.layout().region_lens.clone();
        let local = (plan.plan().local_regions().iter())
            .map(|&i| vec![1u8; lens[i as usize] as usize])
            .collect();
        let remote = (plan.plan().remote_regions().iter())
            .map(|r| {
                let peer = peers.iter().find(|p| p.layout().rank == r.rank);
                let len = peer.map_or(0, |p| p.layout().region_lens[r.region as usize]);
                vec![2u8; len as usize]
            })
            .collect();
        let origins = (plan.plan().remote_regions().iter())
            .map(|r| (r.rank, r.region))
            .collect();
        MemcpyReference {
            local,
            remote,
            origins,
        }
    }

    /// Where `piece`'s source lies in the prefill process: rank, region
    /// and offset.
    pub fn origin(&self, piece: &Piece) -> (u32, u32, u64) {
        let (buffer, offset) = piece.source;
        let (rank, region) = self.origins[buffer];
        (rank, region, offset)
    }

    /// The copies of `expansion`'s pairs, remote to local.
    pub fn pairs(&mut self, expansion: &Expansion) -> Vec<Piece> {
        let mut pieces = Vec::with_capacity(expansion.len());
        for (l, r) in expansion.local().iter().zip(expansion.remote().iter()) {
            let (lo, ro, len) = (l.offset as usize, r.offset as usize, l.len as usize);
            let from = &self.remote[r.region as usize][ro..ro + len];
            let to = &mut self.local[l.region as usize][lo..lo + len];
            pieces.push(Piece {
                to: to.as_mut_ptr() as usize,
                from: from.as_ptr() as usize,
                len,
                source: (r.region as usize, r.offset),
            });
        }
        pieces
    }

    /// The copies of `bytes` as 1 MiB pieces, remote to local.
    pub fn blocks(&mut self, bytes: u64) -> Vec<Piece> {
        let piece = MIB as usize;
        let from = (self.remote.iter().enumerate()).flat_map(|(buffer, r)| {
            let chunks = r.chunks_exact(piece).enumerate();
            chunks.map(move |(i, chunk)| (chunk, (buffer, (i * piece) as u64)))
        });
        let to = (self.local.iter_mut()).flat_map(|l| l.chunks_exact_mut(piece));
        to.zip(from)
            .take((bytes / MIB) as usize)
            .map(|(to, (from, source))| Piece {
                to: to.as_mut_ptr() as usize,
                from: from.as_ptr() as usize,
                len: piece,
                source,
            })
            .collect()
    }
}

/// One copy of the reference: addresses in a [`MemcpyReference`]'s
/// buffers (or, in the prefill process, `from` in its regions).
pub struct Piece {
    pub to: usize,
    pub from: usize,
    pub len: usize,
    /// The source's remote buffer and offset in it.
    pub source: (usize, u64),
}

/// GB/s running `pieces` on `threads` threads, a contiguous share each.
/// The pieces come from one [`MemcpyReference`], borrowed mutably by the
/// caller for the call.
pub fn copy_pieces(pieces: &[Piece], threads: usize) -> f64 {
    let total: usize = pieces.iter().map(|p| p.len).sum();
    let share = pieces.len().div_ceil(threads).max(1);
    let start = Instant::now();
    std::thread::scope(|scope| {
        for run in pieces.chunks(share) {
            scope.spawn(move || {
                for p in run {
                    // SAFETY: both ranges lie in the reference's buffers,
                    // alive and not otherwise used during the call; no two
                    // pieces' destinations overlap (a plan writes each
                    // local byte once; 1 MiB pieces are disjoint chunks),
                    // and a source is never a destination (other buffers).
                    unsafe {
                        std::ptr::copy_nonoverlapping(p.from as *const u8, p.to as *mut u8, p.len)
                    };
                }
            });
        }
    });
    total as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// Connections of the TCP reference: as many as ferry's TCP transport
/// opens to a peer by default.
pub const CONNECTIONS: usize = 4;

/// Pieces per `writev`/`readv` call: Linux's `IOV_MAX`.
const IOVECS: usize = 1024;

/// Which end of a connection [`vectored_all`] is.
#[derive(Clone, Copy)]
pub enum Side {
    /// Gathers the pieces' sources with `writev`.
    Send,
    /// Scatters into the pieces' destinations with `readv`.
    Receive,
}

/// Moves every byte of `pieces` through `socket`, sent from or received
/// into them as `side` says, [`IOVECS`] at a time, resuming after short
/// transfers.
pub fn vectored_all(socket: &TcpStream, pieces: &[Piece], side: Side) -> std::io::Result<()> {
    let fd = socket.as_raw_fd();
    for group in pieces.chunks(IOVECS) {
        let mut iovs: Vec<libc::iovec> = (group.iter())
            .map(|p| libc::iovec {
                iov_base: match side {
                    Side::Send => p.from,
                    Side::Receive => p.to,
                } as *mut libc::c_void,
                iov_len: p.len,
            })
            .collect();
        let mut first = 0;
        while first < iovs.len() {
            let (iov, count) = (iovs[first..].as_ptr(), (iovs.len() - first) as i32);
            // SAFETY: the iovecs lie in the reference's buffers, alive
            // during the call (the caller borrows the reference mutably),
            // or, in the prefill process, in its regions, alive until it
            // exits; a sender's are only read, a receiver's destinations
            // are not otherwise used and no two overlap.
            let n = unsafe {
                match side {
                    Side::Send => libc::writev(fd, iov, count),
                    Side::Receive => libc::readv(fd, iov, count),
                }
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            // Past the iovecs done, into the one done in part.
            let mut n = n as usize;
            while first < iovs.len() && n >= iovs[first].iov_len {
                n -= iovs[first].iov_len;
                first += 1;
            }
            if n > 0 {
                let iov = &mut iovs[first];
                iov.iov_base = (iov.iov_base as usize + n) as *mut libc::c_void;
                iov.iov_len -= n;
            }
        }
    }
    Ok(())
}
