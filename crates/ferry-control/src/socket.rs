//! Socket options every connection of the endpoint gets, both directions:
//! among them, how a dead peer is told from a slow one (see [`set_liveness`]).

use std::io;
use std::os::fd::AsRawFd;
use std::time::Duration;

use tokio::net::TcpStream;

/// How long a peer may acknowledge nothing before its connections are
/// failed, unless a node is configured otherwise
/// ([`crate::EndpointConfig::peer_timeout`]).
pub const DEFAULT_PEER_TIMEOUT: Duration = Duration::from_secs(20);

/// How long a data plane may go on with work it had under way when its
/// control session went silent, while that work keeps completing, unless a
/// node is configured otherwise ([`crate::EndpointConfig::silent_grace`]):
/// three default peer timeouts.
pub const DEFAULT_SILENT_GRACE: Duration = Duration::from_secs(60);

/// Sets TCP_NODELAY and the default liveness ([`set_liveness`] with
/// [`DEFAULT_PEER_TIMEOUT`]).
pub fn configure(stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    set_liveness(stream, DEFAULT_PEER_TIMEOUT)
}

/// The keepalive timers of a connection whose peer counts as dead once it
/// has acknowledged nothing, neither data nor a keepalive probe, for
/// `peer_timeout`.
///
/// A peer host that vanishes without a reset (power loss, partition) would
/// otherwise leave the connection, and whatever it holds (memory pins of
/// chunks in flight, a queue pair bound to a control session), in place
/// for the kernel's retransmission timeout, about 15 minutes.
///
/// TCP_USER_TIMEOUT bounds both cases: unacknowledged data, and probes of
/// an idle connection. Probes go out every fifth of the bound (at least
/// every second), so that a lossy link must lose all of them, about five
/// in a row, to fail a healthy connection; with a probe count of three
/// instead, 10 % loss did so within a minute (issue 12).
pub fn set_liveness(stream: &TcpStream, peer_timeout: Duration) -> io::Result<()> {
    let (interval, count, user_timeout) = keepalive_timers(peer_timeout);
    let fd = stream.as_raw_fd();
    for (level, name, value) in [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, interval),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, interval),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, count),
        (libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, user_timeout),
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

/// Seconds idle before the first probe and between probes, the probe
/// count, and TCP_USER_TIMEOUT in milliseconds, for `peer_timeout`.
fn keepalive_timers(peer_timeout: Duration) -> (libc::c_int, libc::c_int, libc::c_int) {
    let secs = peer_timeout.as_secs().clamp(1, 3600) as libc::c_int;
    let interval = (secs / 5).max(1);
    let millis = peer_timeout.as_millis().clamp(1000, 3_600_000) as libc::c_int;
    // The user timeout decides; the count only has to outlast it.
    (interval, secs / interval + 1, millis)
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
    async fn connections_use_nodelay_and_keepalive_bounded_by_the_peer_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        configure(&stream).unwrap();
        assert!(stream.nodelay().unwrap());
        assert_eq!(option(&stream, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        assert_eq!(option(&stream, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 4);
        assert_eq!(option(&stream, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), 4);
        assert_eq!(
            option(&stream, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT),
            20_000
        );
        set_liveness(&stream, Duration::from_secs(3)).unwrap();
        assert_eq!(option(&stream, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), 1);
        assert_eq!(
            option(&stream, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT),
            3_000
        );
    }

    #[test]
    fn the_fd_limit_is_read() {
        let limit = fd_limit().expect("test processes have a finite fd limit");
        assert!(limit >= 3, "{limit}");
    }
}
