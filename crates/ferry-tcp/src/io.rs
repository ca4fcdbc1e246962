//! Socket I/O that moves payload bytes straight between the kernel and region
//! memory.
//!
//! Region memory is shared with other transfers and with the remote peer (it
//! behaves like DMA memory), so it is never borrowed as `&[u8]`/`&mut [u8]`:
//! payloads are passed to `recv`/`sendmsg` as raw pointers. This is the only
//! module of the crate that dereferences region pointers. Callers guarantee
//! that the memory stays alive across each call by holding a `Region` clone or
//! an upgraded `Arc<MemoryBlock>`.

use std::io;
use std::os::fd::AsRawFd;
use std::time::Duration;

use ferry_control::auth::FrameMac;
use ferry_control::{ConnectionPermit, IdleClose};
use tokio::io::Interest;
use tokio::net::TcpStream;

/// Most iovecs handed to one `sendmsg`: well under every kernel's IOV_MAX.
pub const MAX_IOV: usize = 512;

/// One `recv` into `addr..addr+len` (an address as an integer, so that the
/// future stays `Send`). Returns 0 at end of stream. The caller guarantees the
/// range is writable and alive across the call.
///
/// For up to `busy_poll` it asks the socket again and again, yielding to the
/// runtime's other tasks between asks, before it sleeps until the socket is
/// readable. On a virtual machine waking a sleeping thread costs 20-30 µs,
/// more than a loopback round trip: an answer or a next request that comes
/// within the window is taken without that wake-up. After the window the
/// task sleeps, so an idle connection costs no CPU.
///
/// With a `stall` permit the sleep is a wait mid-frame
/// ([`ConnectionPermit::while_mid_frame`]): evictable at a bound, and
/// `TimedOut` once the peer has sent nothing for the frame timeout.
async fn recv_raw(
    stream: &TcpStream,
    addr: usize,
    len: usize,
    busy_poll: Duration,
    stall: Option<&ConnectionPermit>,
) -> io::Result<usize> {
    let fd = stream.as_raw_fd();
    // SAFETY: the caller guarantees `addr..addr+len` is writable memory that
    // stays alive for this call; the fd is owned by `stream`.
    let recv = |flags| match unsafe { libc::recv(fd, addr as *mut libc::c_void, len, flags) } {
        n if n < 0 => Err(io::Error::last_os_error()),
        n => Ok(n as usize),
    };
    receive_with(stream, recv, busy_poll, stall).await
}

/// One `recvmsg` into the `count` iovecs at `iov` (an address as an
/// integer, so that the future stays `Send`), at most [`MAX_IOV`] of them,
/// waiting as [`recv_raw`] does. The caller guarantees every range is
/// writable and alive across the call, and the iovecs too.
async fn recv_vectored_raw(
    stream: &TcpStream,
    iov: usize,
    count: usize,
    busy_poll: Duration,
    stall: Option<&ConnectionPermit>,
) -> io::Result<usize> {
    let fd = stream.as_raw_fd();
    let recv = |flags| {
        // SAFETY: a zeroed msghdr is valid; only the iovec fields are set.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov as *mut libc::iovec;
        msg.msg_iovlen = count.min(MAX_IOV) as _;
        // SAFETY: the caller guarantees the iovecs and the ranges they
        // name; the fd is owned by `stream`.
        match unsafe { libc::recvmsg(fd, &mut msg, flags) } {
            n if n < 0 => Err(io::Error::last_os_error()),
            n => Ok(n as usize),
        }
    };
    receive_with(stream, recv, busy_poll, stall).await
}

/// Runs `recv` (given its flags) until it returns bytes, the end of the
/// stream or an error: polling, then sleeping, as [`recv_raw`] says.
async fn receive_with(
    stream: &TcpStream,
    recv: impl Fn(libc::c_int) -> io::Result<usize>,
    busy_poll: Duration,
    stall: Option<&ConnectionPermit>,
) -> io::Result<usize> {
    let again = |e: &io::Error| {
        matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
        )
    };
    if !busy_poll.is_zero() {
        let start = std::time::Instant::now();
        loop {
            match recv(libc::MSG_DONTWAIT) {
                Err(e) if again(&e) => {}
                done => return done,
            }
            if start.elapsed() >= busy_poll {
                break;
            }
            tokio::task::yield_now().await;
        }
    }
    loop {
        match stall {
            None => stream.readable().await?,
            Some(permit) => permit
                .while_mid_frame(stream.readable())
                .await
                .map_err(stalled)??,
        }
        match stream.try_io(Interest::READABLE, || recv(0)) {
            Err(e) if again(&e) => continue,
            done => return done,
        }
    }
}

/// A sealed frame whose tag failed its check: altered, injected, replayed
/// or reordered on the way. The connection ends; nothing after it can be
/// trusted. Carried inside an `InvalidData` I/O error ([`forged`],
/// [`is_forged`]).
#[derive(Debug, thiserror::Error)]
#[error("a frame's authentication tag is wrong: altered or injected on the way")]
pub struct ForgedFrame;

/// Checks `tag`, read with the frame's last part, over `parts` with `mac`
/// (the connection's receiving direction): a tag that fails is a
/// [`forged`] error, which ends the connection.
pub fn open_tag(mac: &mut FrameMac, parts: &[&[u8]], tag: &[u8]) -> io::Result<()> {
    if mac.open(parts, tag) {
        Ok(())
    } else {
        Err(forged())
    }
}

/// The I/O error of a [`ForgedFrame`].
pub fn forged() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, ForgedFrame)
}

/// Whether `error` is a [`ForgedFrame`]'s.
pub fn is_forged(error: &io::Error) -> bool {
    error
        .get_ref()
        .is_some_and(|inner| inner.is::<ForgedFrame>())
}

/// A connection closed for its peer's silence (or evicted) mid-frame, as
/// the I/O error that ends its serving loop.
fn stalled(close: IdleClose) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, close)
}

/// Fills `ptr..ptr+len` completely from the socket, each wait bounded by
/// `stall` as in [`recv_raw`].
///
/// # Safety
///
/// `ptr..ptr+len` must be valid for writes until the returned future finishes
/// or is dropped.
unsafe fn recv_exact_raw<'a>(
    stream: &'a TcpStream,
    ptr: *mut u8,
    mut len: usize,
    busy_poll: Duration,
    stall: Option<&'a ConnectionPermit>,
) -> impl Future<Output = io::Result<()>> + Send + 'a {
    let mut addr = ptr as usize;
    async move {
        while len > 0 {
            let n = recv_raw(stream, addr, len, busy_poll, stall).await?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            // n <= len, so the address stays within the caller's range.
            addr += n;
            len -= n;
        }
        Ok(())
    }
}

/// Appends the `len` bytes at `ptr` to `buf`.
///
/// # Safety
///
/// `ptr..ptr+len` must be valid for reads for the call.
pub unsafe fn extend_from_raw(buf: &mut Vec<u8>, ptr: *const u8, len: usize) {
    buf.reserve(len);
    // SAFETY: the caller vouches for the source; `reserve` made room for
    // `len` bytes past the end, which `set_len` then covers, and a Vec's
    // buffer never overlaps region memory.
    unsafe {
        std::ptr::copy_nonoverlapping(ptr, buf.as_mut_ptr().add(buf.len()), len);
        buf.set_len(buf.len() + len);
    }
}

/// A list of raw byte ranges to send with one `sendmsg` each round.
#[derive(Default)]
pub struct IoVecs(Vec<libc::iovec>);

// SAFETY: the iovecs are plain pointers; whoever pushes a range guarantees it
// stays alive until `send_all` returns (see `IoVecs::push`).
unsafe impl Send for IoVecs {}

impl IoVecs {
    /// # Safety
    ///
    /// `ptr..ptr+len` must stay valid for reads until the next `clear` or
    /// `send_all` of this list has returned or been dropped.
    pub unsafe fn push(&mut self, ptr: *const u8, len: usize) {
        if len > 0 {
            self.0.push(libc::iovec {
                iov_base: ptr as *mut _,
                iov_len: len,
            });
        }
    }

    /// # Safety
    ///
    /// `ptr..ptr+len` must stay valid for writes until the next `clear` or
    /// [`FrameReader::scatter`] of this list has returned or been dropped.
    pub unsafe fn push_mut(&mut self, ptr: *mut u8, len: usize) {
        // SAFETY: the caller's guarantee covers reads as well.
        unsafe { self.push(ptr, len) }
    }

    pub fn clear(&mut self) {
        self.0.clear();
    }

    /// Bytes in all the ranges.
    pub fn len(&self) -> usize {
        self.0.iter().map(|v| v.iov_len).sum()
    }

    /// Steps past `n` bytes from the `first` range on (the kernel took or
    /// filled them), possibly inside one range; returns the new first.
    fn advance(&mut self, mut first: usize, mut n: usize) -> usize {
        while n > 0 {
            let v = &mut self.0[first];
            if n >= v.iov_len {
                n -= v.iov_len;
                first += 1;
            } else {
                // SAFETY: `n < iov_len`, so the new base stays in range.
                v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
                v.iov_len -= n;
                n = 0;
            }
        }
        first
    }

    /// Sends every range, in order, then clears the list. With a `stall`
    /// permit, each wait for room in the socket is a wait on the peer
    /// ([`ConnectionPermit::while_mid_frame`]): a peer that stops reading
    /// what it asked for is cut like one that stops sending.
    pub async fn send_all(
        &mut self,
        stream: &TcpStream,
        stall: Option<&ConnectionPermit>,
    ) -> io::Result<()> {
        let fd = stream.as_raw_fd();
        let mut first = 0;
        while first < self.0.len() {
            match stall {
                None => stream.writable().await?,
                Some(permit) => permit
                    .while_mid_frame(stream.writable())
                    .await
                    .map_err(stalled)??,
            }
            let iov = &self.0[first..];
            let res = stream.try_io(Interest::WRITABLE, || {
                // SAFETY: a zeroed msghdr is valid; we set only the iovec fields.
                let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
                msg.msg_iov = iov.as_ptr() as *mut _;
                msg.msg_iovlen = iov.len().min(MAX_IOV) as _;
                // SAFETY: every iovec points to memory the pusher keeps alive
                // (see `push`); MSG_NOSIGNAL turns a dead peer into EPIPE
                // instead of killing the process with SIGPIPE.
                let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            let sent = match res {
                Ok(n) => n,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) =>
                {
                    continue;
                }
                Err(e) => return Err(e),
            };
            first = self.advance(first, sent);
        }
        self.0.clear();
        Ok(())
    }
}

mod reader;

pub use reader::{FrameReader, LARGE_PAYLOAD, poll_for};
