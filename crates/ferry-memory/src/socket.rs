//! Unix-domain `SOCK_SEQPACKET` sockets in the abstract namespace, with a
//! descriptor passed alongside a message (`SCM_RIGHTS`).
//!
//! Seqpacket keeps message boundaries: every request and reply is one
//! packet, never split or merged. Abstract names belong to a network
//! namespace and leave nothing in the filesystem: a node in another network
//! namespace cannot connect, so it is not taken for a same-host peer.

use std::io;
use std::mem::{size_of, zeroed};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// The socket address of abstract name `name`, and its length.
fn address(name: &str) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = name.as_bytes();
    // sun_path[0] = 0 marks the abstract namespace; the name follows.
    if bytes.len() + 1 > addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket name too long",
        ));
    }
    for (slot, &b) in addr.sun_path[1..].iter_mut().zip(bytes) {
        *slot = b as libc::c_char;
    }
    let len = size_of::<libc::sa_family_t>() + 1 + bytes.len();
    Ok((addr, len as libc::socklen_t))
}

fn socket() -> io::Result<OwnedFd> {
    // SAFETY: a plain syscall; failure is -1.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: socket() just returned it; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Registers `fd` with the runtime's reactor.
fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an OwnedFd is open until dropped, which the AsyncFd does,
    // and its as_raw_fd always returns the same descriptor.
    unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)
}

/// A listening socket.
pub struct Listener(AsyncFd<OwnedFd>);

impl Listener {
    /// Listens on abstract name `name`.
    pub fn bind(name: &str) -> io::Result<Self> {
        let fd = socket()?;
        let (addr, len) = address(name)?;
        // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
        let bound = unsafe {
            libc::bind(fd.as_raw_fd(), (&raw const addr).cast(), len) == 0
                && libc::listen(fd.as_raw_fd(), 128) == 0
        };
        if !bound {
            return Err(io::Error::last_os_error());
        }
        Ok(Listener(register(fd)?))
    }

    /// The next connection.
    pub async fn accept(&self) -> io::Result<Packets> {
        let fd = self
            .0
            .async_io(Interest::READABLE, |fd| {
                // SAFETY: a plain syscall; no peer address is asked for.
                let raw = unsafe {
                    libc::accept4(
                        fd.as_raw_fd(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                    )
                };
                if raw < 0 {
                    return Err(io::Error::last_os_error());
                }
                // SAFETY: accept4 just returned it.
                Ok(unsafe { OwnedFd::from_raw_fd(raw) })
            })
            .await?;
        Ok(Packets(register(fd)?))
    }
}

/// A connected socket: packets out and in, each optionally with a
/// descriptor.
pub struct Packets(AsyncFd<OwnedFd>);

impl Packets {
    /// Connects to abstract name `name`: succeeds at once or fails (a Unix
    /// socket connect does not wait for a network).
    pub fn connect(name: &str) -> io::Result<Self> {
        let fd = socket()?;
        let (addr, len) = address(name)?;
        // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
        if unsafe { libc::connect(fd.as_raw_fd(), (&raw const addr).cast(), len) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Packets(register(fd)?))
    }

    /// Sends one packet, with `fd` attached when given.
    pub async fn send(&self, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
        self.0
            .async_io(Interest::WRITABLE, |sock| send(sock.as_raw_fd(), bytes, fd))
            .await
    }

    /// Sends one packet at once, without a descriptor: `WouldBlock` when
    /// the socket's buffer is full.
    pub fn try_send(&self, bytes: &[u8]) -> io::Result<()> {
        send(self.0.as_raw_fd(), bytes, None)
    }

    /// Receives one packet into `buf`: its length (0: the peer closed) and
    /// the descriptor attached to it, if any. A packet longer than `buf`
    /// is an error, not a truncation.
    pub async fn recv(&self, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
        self.0
            .async_io(Interest::READABLE, |sock| recv(sock.as_raw_fd(), buf))
            .await
    }

    /// Whether the peer has closed its end (or the socket broke): one
    /// non-blocking peek, for a liveness check before a copy.
    pub fn is_closed(&self) -> bool {
        let mut byte = 0u8;
        // SAFETY: a one-byte peek into a local buffer.
        let n = unsafe {
            libc::recv(
                self.0.as_raw_fd(),
                (&raw mut byte).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => true,
            n if n > 0 => false,
            _ => io::Error::last_os_error().kind() != io::ErrorKind::WouldBlock,
        }
    }

    /// Shuts the socket both ways: the peer sees it closed at once, and
    /// [`Packets::is_closed`] says so here.
    pub fn shutdown(&self) {
        // SAFETY: a plain syscall on the socket's open descriptor.
        unsafe { libc::shutdown(self.0.as_raw_fd(), libc::SHUT_RDWR) };
    }

    /// The socket's descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.0.get_ref().as_fd()
    }

    /// The peer's process id (`SO_PEERCRED`) as the kernel saw it when the
    /// connection was made, in this process's pid namespace (0 where the
    /// peer is outside it): a peer's word is never taken for it.
    pub fn peer_pid(&self) -> Option<i32> {
        // SAFETY: ucred is plain data.
        let mut cred: libc::ucred = unsafe { zeroed() };
        let mut len = size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `cred`.
        let ok = unsafe {
            libc::getsockopt(
                self.0.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                (&raw mut cred).cast(),
                &mut len,
            )
        } == 0;
        ok.then_some(cred.pid)
    }
}

/// Control-message space for one descriptor, 8-byte aligned.
#[repr(C, align(8))]
struct FdSpace([u8; 32]);

fn send(sock: RawFd, bytes: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    let mut space = FdSpace([0; 32]);
    // SAFETY: msghdr is plain data; all zeroes is a valid empty header.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if let Some(fd) = fd {
        // SAFETY: CMSG_* compute sizes and walk the buffer set up here,
        // which holds CMSG_SPACE(one fd) (24 bytes) within its 32.
        unsafe {
            msg.msg_control = space.0.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(size_of::<RawFd>() as u32) as usize;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<RawFd>() as u32) as usize;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd.as_raw_fd());
        }
    }
    // SAFETY: msg points at iov and space, both alive for the call.
    let sent = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    // A seqpacket send is all or nothing.
    Ok(())
}

fn recv(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut space = FdSpace([0; 32]);
    // SAFETY: msghdr is plain data; all zeroes is a valid empty header.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = space.0.as_mut_ptr().cast();
    msg.msg_controllen = space.0.len();
    // SAFETY: msg points at iov (into buf) and space, both alive.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // Take ownership of every descriptor that came, so none leaks, before
    // judging the packet.
    let mut fds = Vec::new();
    // SAFETY: the kernel filled msg_control; CMSG_* walk what it wrote.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let bytes = (*cmsg).cmsg_len - (data as usize - cmsg as usize);
                for i in 0..bytes / size_of::<RawFd>() {
                    let raw = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    fds.push(OwnedFd::from_raw_fd(raw));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 || fds.len() > 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a packet larger than expected, or more than one descriptor",
        ));
    }
    Ok((n as usize, fds.pop()))
}
