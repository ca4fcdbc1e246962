//! Socket options every connection of the endpoint gets, both directions.

use std::io;
use std::os::fd::AsRawFd;

use tokio::net::TcpStream;

/// Idle seconds before the first keepalive probe, seconds between probes,
/// and unanswered probes before the kernel declares the peer dead.
pub const KEEPALIVE: (libc::c_int, libc::c_int, libc::c_int) = (10, 5, 3);

/// Sets TCP_NODELAY and aggressive keepalive.
///
/// A peer host that vanishes without a reset (power loss, partition) would
/// otherwise leave the connection, and whatever it holds (memory pins of
/// chunks in flight, a queue pair bound to a control session), in place
/// forever; with these timers the kernel fails the connection about 25 s
/// after the last sign of life, which releases them.
pub fn configure(stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let fd = stream.as_raw_fd();
    let (idle, interval, count) = KEEPALIVE;
    for (level, name, value) in [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, idle),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, interval),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, count),
    ] {
        // SAFETY: `fd` is a live socket owned by `stream`; the option value is
        // a c_int on the stack, and its size is passed alongside.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The soft limit on open file descriptors of this process, if it has one.
pub fn fd_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable rlimit for the call to fill.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    (rc == 0 && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn option(stream: &TcpStream, level: libc::c_int, name: libc::c_int) -> libc::c_int {
        let mut value: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: the fd is live; `value` and `len` are valid for writes.
        let rc = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                level,
                name,
                (&mut value as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
        value
    }

    #[tokio::test]
    async fn connections_use_nodelay_and_keepalive() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        configure(&stream).unwrap();
        assert!(stream.nodelay().unwrap());
        assert_eq!(option(&stream, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        assert_eq!(
            option(&stream, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE),
            KEEPALIVE.0
        );
        assert_eq!(
            option(&stream, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL),
            KEEPALIVE.1
        );
        assert_eq!(
            option(&stream, libc::IPPROTO_TCP, libc::TCP_KEEPCNT),
            KEEPALIVE.2
        );
    }

    #[test]
    fn the_fd_limit_is_read() {
        let limit = fd_limit().expect("test processes have a finite fd limit");
        assert!(limit >= 3, "{limit}");
    }
}
