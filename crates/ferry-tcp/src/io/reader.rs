//! [`FrameReader`]: a connection's receiving side, headers through a
//! buffer, payloads straight into region memory.

use std::io;
use std::time::Duration;

use ferry_control::ConnectionPermit;
use ferry_control::auth::{FRAME_TAG_LEN, FrameMac};
use tokio::net::TcpStream;

use super::{IoVecs, open_tag, recv_exact_raw, recv_raw, recv_vectored_raw};

/// Header bytes are read through this buffer; payloads bypass it once the
/// bytes already buffered are used up.
const READ_BUF: usize = 64 * 1024;

/// Buffered reading of fixed-size headers, with payloads received directly
/// into their destination.
///
/// A buffered header read may also pull in the start of the payload behind
/// it, which then costs an extra copy. That is the right trade for streams of
/// small frames, but not for large payloads; so after a large payload the next
/// header is read with an exact-length `recv`.
///
/// On the owner's side every read inside a frame (payloads, tables,
/// discarded bytes) waits as [`ConnectionPermit::while_mid_frame`] says;
/// a header is read mid-frame only once its first bytes are buffered, and
/// the wait for a header's first byte is the caller's (idle) to bound.
pub struct FrameReader {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    after_large_payload: bool,
    /// Bytes that follow every header on this stream (a sealed response's
    /// tag): an exact-length header read takes them in the same `recv`.
    trailer: usize,
    /// How long each read polls before it sleeps (see `recv_raw`).
    busy_poll: Duration,
    /// The accepted connection's place (owner side only).
    permit: Option<std::sync::Arc<ConnectionPermit>>,
}

/// Payloads at least this long switch the next header read to exact length.
pub const LARGE_PAYLOAD: usize = 16 * 1024;

/// On a runtime of several workers, a wait for this many bytes or more is
/// not polled for (see `recv_raw` and [`poll_for`]): they take longer to
/// come than a poll window (256 KiB is 25 µs at 10 GB/s), and the poll
/// burns a core that another worker, moving another connection's bytes,
/// could use. On a 2-core host, `bench --threads 2` moving 4 MiB blocks
/// over four connections went from 4.1-5.1 to 5.7-6.2 GB/s, 0.91-1.03 of
/// four process pairs doing the same sends and receives with no protocol.
/// On a runtime of one worker the poll keeps nothing else from running,
/// and sleeping instead cost 1 MiB blocks about 15% of their rate there:
/// it polls as for any other wait.
pub const BULK: usize = 256 * 1024;

/// How long a wait for `bytes` polls: `busy_poll`, or zero for a [`BULK`]
/// wait on a runtime whose other workers could use the core.
pub fn poll_for(bytes: usize, busy_poll: Duration) -> Duration {
    let shared = tokio::runtime::Handle::try_current()
        .is_ok_and(|runtime| runtime.metrics().num_workers() > 1);
    if bytes >= BULK && shared {
        Duration::ZERO
    } else {
        busy_poll
    }
}

impl FrameReader {
    /// A reader whose every read polls for up to `busy_poll` before it sleeps.
    pub fn new(busy_poll: Duration) -> Self {
        FrameReader {
            buf: vec![0; READ_BUF].into_boxed_slice(),
            start: 0,
            end: 0,
            after_large_payload: false,
            trailer: 0,
            busy_poll,
            permit: None,
        }
    }

    /// The same reader, for a stream whose every header is followed by
    /// `len` bytes of its own (a sealed connection's responses, each with
    /// its tag): a header read after a large payload asks for them too, so
    /// that the tag's check finds it buffered instead of waiting on the
    /// socket once more (a `recv` and often a sleep in `epoll_wait`).
    pub fn with_trailer(mut self, len: usize) -> Self {
        self.trailer = len;
        self
    }

    /// How long each read polls from now on (see [`poll_for`]).
    pub fn set_busy_poll(&mut self, busy_poll: Duration) {
        self.busy_poll = busy_poll;
    }

    /// The same reader, its waits mid-frame bounded by `permit`.
    pub fn mid_frame_bound(mut self, permit: std::sync::Arc<ConnectionPermit>) -> Self {
        self.permit = Some(permit);
        self
    }

    /// The bound on a wait inside a frame (owner side).
    fn stall(&self) -> Option<&ConnectionPermit> {
        self.permit.as_deref()
    }

    pub fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Reads one `N`-byte header. `Ok(None)` means the stream ended cleanly
    /// before its first byte; a stream ending inside it is an error.
    pub async fn header<const N: usize>(
        &mut self,
        stream: &TcpStream,
    ) -> io::Result<Option<[u8; N]>> {
        while self.buffered() < N {
            if self.buf.len() - self.start < N {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            let missing = N - self.buffered();
            let spare = &mut self.buf[self.end..];
            let want = if self.after_large_payload {
                (missing + self.trailer).min(spare.len())
            } else {
                spare.len()
            };
            // Mid-frame once the header's first bytes are in; before them
            // the wait is the caller's (idle) to bound.
            let stall = self.permit.as_deref().filter(|_| self.end > self.start);
            let n = recv_raw(
                stream,
                spare.as_mut_ptr() as usize,
                want,
                self.busy_poll,
                stall,
            )
            .await?;
            if n == 0 {
                return if self.buffered() == 0 {
                    Ok(None)
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "stream ended inside a frame header",
                    ))
                };
            }
            self.end += n;
        }
        let header = self.buf[self.start..self.start + N].try_into().unwrap();
        self.start += N;
        self.after_large_payload = false;
        Ok(Some(header))
    }

    /// Moves the next `len` stream bytes to `dst`: a large payload straight
    /// from the socket, a small one through the buffer. A run of small
    /// payloads (a ranges request's) then costs one `recv` per buffer
    /// filled, not one per payload.
    ///
    /// A large payload's rest, once the buffer is drained, goes straight to
    /// `dst` whatever its size, and nothing past it is read: reading ahead
    /// there took most of the next payload into the buffer, whose own rest
    /// was then short and read ahead in turn, so that every 64 KiB range of
    /// a request was copied twice (22% of the owner's CPU in `memmove`).
    ///
    /// # Safety
    ///
    /// `dst..dst+len` must be valid for writes until the future finishes or is
    /// dropped.
    pub unsafe fn payload<'a>(
        &'a mut self,
        stream: &'a TcpStream,
        dst: *mut u8,
        len: usize,
    ) -> impl Future<Output = io::Result<()>> + Send + 'a {
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.take(stream, dst, len, len >= LARGE_PAYLOAD) }
    }

    /// Moves the next `len` stream bytes to `dst`, reading nothing past
    /// them: for a small frame part followed by payloads that may be large
    /// (a ranges request's table), which then go straight to their places.
    ///
    /// # Safety
    ///
    /// As for [`payload`](Self::payload).
    pub unsafe fn exact<'a>(
        &'a mut self,
        stream: &'a TcpStream,
        dst: *mut u8,
        len: usize,
    ) -> impl Future<Output = io::Result<()>> + Send + 'a {
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.take(stream, dst, len, true) }
    }

    /// Moves the next stream bytes into `iov`'s ranges, in order, reading
    /// nothing past them, and clears `iov`: the buffered bytes first, then
    /// the rest straight from the socket, up to [`MAX_IOV`](super::MAX_IOV) ranges per
    /// `recvmsg`. For a ranges request's many small payloads, which
    /// [`payload`](Self::payload) would take through the buffer (a second
    /// copy of every byte: 6-10% of all CPU samples of 4 KiB writes).
    ///
    /// # Safety
    ///
    /// Every range of `iov` must be valid for writes until the future
    /// finishes or is dropped (see [`IoVecs::push_mut`]).
    pub async unsafe fn scatter(&mut self, stream: &TcpStream, iov: &mut IoVecs) -> io::Result<()> {
        let total = iov.len();
        let mut first = 0;
        while first < iov.0.len() && self.buffered() > 0 {
            let v = iov.0[first];
            let n = v.iov_len.min(self.buffered());
            // SAFETY: the range is writable (caller) for `iov_len >= n`
            // bytes; the read buffer is a separate allocation.
            unsafe {
                let from = self.buf[self.start..].as_ptr();
                std::ptr::copy_nonoverlapping(from, v.iov_base.cast::<u8>(), n);
            }
            self.start += n;
            first = iov.advance(first, n);
        }
        let mut left = iov.0[first..].iter().map(|v| v.iov_len).sum::<usize>();
        while first < iov.0.len() {
            let stall = self.stall();
            let poll = poll_for(left, self.busy_poll);
            let at = iov.0[first..].as_mut_ptr() as usize;
            let count = iov.0.len() - first;
            let n = recv_vectored_raw(stream, at, count, poll, stall).await?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            first = iov.advance(first, n);
            left -= n;
        }
        iov.clear();
        self.after_large_payload = total >= LARGE_PAYLOAD;
        Ok(())
    }

    /// [`payload`](Self::payload) and [`exact`](Self::exact): the buffered
    /// bytes first, then the rest straight from the socket if it is large
    /// or `direct`, else through the buffer, refilled.
    ///
    /// # Safety
    ///
    /// As for [`payload`](Self::payload).
    unsafe fn take<'a>(
        &'a mut self,
        stream: &'a TcpStream,
        dst: *mut u8,
        len: usize,
        direct: bool,
    ) -> impl Future<Output = io::Result<()>> + Send + 'a {
        // An integer, so that the future stays `Send`.
        let dst = dst as usize;
        async move {
            let mut done = 0;
            loop {
                let from_buf = (len - done).min(self.buffered());
                // SAFETY: `dst` is valid for `len` bytes (caller), of which
                // `done + from_buf` are used; the read buffer is a separate
                // allocation.
                unsafe {
                    let to = (dst as *mut u8).add(done);
                    std::ptr::copy_nonoverlapping(self.buf[self.start..].as_ptr(), to, from_buf);
                }
                self.start += from_buf;
                done += from_buf;
                let rest = len - done;
                if rest == 0 {
                    break;
                }
                if direct || rest >= LARGE_PAYLOAD {
                    // SAFETY: as above, for the rest of the range.
                    let to = unsafe { (dst as *mut u8).add(done) };
                    let stall = self.stall();
                    let poll = poll_for(rest, self.busy_poll);
                    unsafe { recv_exact_raw(stream, to, rest, poll, stall) }.await?;
                    break;
                }
                self.refill(stream).await?;
            }
            self.after_large_payload = len >= LARGE_PAYLOAD;
            Ok(())
        }
    }

    /// Receives what the socket has into the (empty) buffer, at least one
    /// byte; the end of the stream here is an error.
    async fn refill(&mut self, stream: &TcpStream) -> io::Result<()> {
        debug_assert_eq!(self.buffered(), 0);
        self.start = 0;
        self.end = 0;
        let spare = self.buf.as_mut_ptr() as usize;
        let stall = self.stall();
        let n = recv_raw(stream, spare, self.buf.len(), self.busy_poll, stall).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.end = n;
        Ok(())
    }

    /// Reads the [`FRAME_TAG_LEN`]-byte tag that follows a sealed frame's
    /// `parts` and checks it with `mac` (the connection's receiving
    /// direction): a tag that fails is an `InvalidData` error ([`forged`](super::forged)),
    /// which ends the connection.
    pub async fn check_tag(
        &mut self,
        stream: &TcpStream,
        mac: &mut FrameMac,
        parts: &[&[u8]],
    ) -> io::Result<()> {
        let mut tag = [0u8; FRAME_TAG_LEN];
        // SAFETY: `tag` is FRAME_TAG_LEN bytes on this frame, alive across
        // the call.
        unsafe { self.exact(stream, tag.as_mut_ptr(), FRAME_TAG_LEN).await? };
        open_tag(mac, parts, &tag)
    }

    /// Skips the next `len` stream bytes (the payload of a refused write).
    pub async fn discard(&mut self, stream: &TcpStream, mut len: usize) -> io::Result<()> {
        let from_buf = len.min(self.buffered());
        self.start += from_buf;
        len -= from_buf;
        if len > 0 {
            // The buffer is empty now; use it as scratch space.
            self.start = 0;
            self.end = 0;
        }
        while len > 0 {
            let n = recv_raw(
                stream,
                self.buf.as_mut_ptr() as usize,
                len.min(self.buf.len()),
                self.busy_poll,
                self.stall(),
            )
            .await?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            len -= n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::MAX_IOV;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap());
        let (client, accepted) = tokio::join!(client, listener.accept());
        (client.unwrap(), accepted.unwrap().0)
    }

    /// Bytes that come within the polling window, after it, and with polling
    /// off all arrive whole: header first, then a payload straight into
    /// place, then the end of the stream.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_frames_whether_they_come_while_polling_or_after() {
        let payload: Vec<u8> = (0..(1 << 20) + 7).map(|i| (i % 251) as u8).collect();
        for (busy_poll, delay) in [
            (Duration::from_millis(50), Duration::ZERO),
            (Duration::from_millis(1), Duration::from_millis(20)),
            (Duration::ZERO, Duration::from_millis(5)),
        ] {
            let (mut writer, reader_stream) = pair().await;
            let sent = payload.clone();
            let sending = tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                writer.write_all(b"HEADER!!").await.unwrap();
                tokio::time::sleep(delay).await;
                writer.write_all(&sent).await.unwrap();
            });
            let mut reader = FrameReader::new(busy_poll);
            let header = reader.header::<8>(&reader_stream).await.unwrap();
            assert_eq!(header.as_ref(), Some(b"HEADER!!"), "{busy_poll:?}");
            let mut got = vec![0u8; payload.len()];
            // SAFETY: `got` is payload.len() bytes long and outlives the call.
            unsafe { reader.payload(&reader_stream, got.as_mut_ptr(), got.len()) }
                .await
                .unwrap();
            assert!(got == payload, "payload differs with {busy_poll:?}");
            sending.await.unwrap();
            assert_eq!(reader.header::<8>(&reader_stream).await.unwrap(), None);
        }
    }

    /// A stream read as many payloads of every size, small ones through the
    /// buffer (refilled as it runs dry, mid-payload too) and large ones
    /// straight from the socket, arrives whole and in order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn small_and_large_payloads_interleave_whole() {
        let mut sizes: Vec<usize> = (1..=300).map(|k| (k * 37) % 700 + 1).collect();
        sizes.extend([LARGE_PAYLOAD - 1, LARGE_PAYLOAD, 3, READ_BUF + 5, 64, 1]);
        sizes.extend((1..=200).map(|k| k * 13 % 97 + 1));
        let total: usize = sizes.iter().sum();
        let stream: Vec<u8> = (0..total).map(|i| (i % 253) as u8).collect();
        let (mut writer, reader_stream) = pair().await;
        let sent = stream.clone();
        let sending = tokio::spawn(async move {
            // In pieces with pauses, so that reads find the socket both
            // full and empty.
            for piece in sent.chunks(9_999) {
                writer.write_all(piece).await.unwrap();
                tokio::time::sleep(Duration::from_micros(300)).await;
            }
        });
        let mut reader = FrameReader::new(Duration::from_micros(20));
        let mut got = vec![0u8; total];
        let mut at = 0;
        for len in sizes {
            // SAFETY: `got[at..at + len]` is in bounds and outlives the call.
            unsafe { reader.payload(&reader_stream, got.as_mut_ptr().add(at), len) }
                .await
                .unwrap();
            at += len;
        }
        assert!(got == stream, "payloads differ");
        sending.await.unwrap();
        assert_eq!(reader.header::<8>(&reader_stream).await.unwrap(), None);
    }

    /// A ranges request's payloads scattered straight into their places:
    /// more ranges than one `recvmsg` takes, the first ones partly buffered
    /// behind the header, each range in its place (the gaps between them
    /// untouched) and the next header whole after them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn scattered_payloads_land_in_place_and_the_next_header_follows() {
        let sizes: Vec<usize> = (0..MAX_IOV + 300).map(|k| (k * 61) % 5000 + 1).collect();
        let total: usize = sizes.iter().sum();
        let body: Vec<u8> = (0..total).map(|i| (i % 239) as u8).collect();
        let mut stream = b"HEADER!!".to_vec();
        stream.extend_from_slice(&body);
        stream.extend_from_slice(b"NEXT-ONE");
        let (mut writer, reader_stream) = pair().await;
        let sending = tokio::spawn(async move {
            // In pieces with pauses, so that reads find the socket both
            // full and empty.
            for piece in stream.chunks(7_777) {
                writer.write_all(piece).await.unwrap();
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
        });
        let mut reader = FrameReader::new(Duration::from_micros(20));
        let header = reader.header::<8>(&reader_stream).await.unwrap();
        assert_eq!(header.as_ref(), Some(b"HEADER!!"));
        // Range k lands k bytes further than the one before it ends.
        let mut got = vec![0xEEu8; total + sizes.len()];
        let mut places = Vec::new();
        let mut iov = IoVecs::default();
        let mut at = 0;
        for (k, &len) in sizes.iter().enumerate() {
            at += k.min(1);
            places.push(at);
            // SAFETY: `got[at..at + len]` is in bounds and outlives the call.
            unsafe { iov.push_mut(got.as_mut_ptr().add(at), len) };
            at += len;
        }
        // SAFETY: as above, for every range.
        unsafe { reader.scatter(&reader_stream, &mut iov) }
            .await
            .unwrap();
        let mut from = 0;
        for (&place, &len) in places.iter().zip(&sizes) {
            assert!(
                got[place..place + len] == body[from..from + len],
                "range at {place}"
            );
            if place > 0 {
                assert_eq!(got[place - 1], 0xEE, "the gap before {place}");
            }
            from += len;
        }
        let next = reader.header::<8>(&reader_stream).await.unwrap();
        assert_eq!(next.as_ref(), Some(b"NEXT-ONE"));
        sending.await.unwrap();
        assert_eq!(reader.header::<8>(&reader_stream).await.unwrap(), None);
    }

    /// Nothing is read past a large payload, whose start came through the
    /// buffer, nor past an exact read (a ranges request's table): the large
    /// payloads behind them go straight to their places, and every byte
    /// still arrives in order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn large_payloads_and_exact_reads_leave_nothing_buffered() {
        let parts = [100, 64 << 10, 300, 64 << 10, 20_000];
        let total: usize = parts.iter().sum::<usize>() + 8;
        let stream: Vec<u8> = (0..total).map(|i| (i % 241) as u8).collect();
        let (mut writer, reader_stream) = pair().await;
        let sent = stream.clone();
        // From a task: more than the socket buffers may hold.
        let sending = tokio::spawn(async move { writer.write_all(&sent).await.unwrap() });
        let mut reader = FrameReader::new(Duration::ZERO);
        let mut got = vec![0u8; total];
        let mut at = 0;
        for (k, len) in parts.into_iter().enumerate() {
            // SAFETY: `got[at..at + len]` is in bounds and outlives the call.
            unsafe {
                let dst = got.as_mut_ptr().add(at);
                if len == 300 {
                    reader.exact(&reader_stream, dst, len).await.unwrap();
                } else {
                    reader.payload(&reader_stream, dst, len).await.unwrap();
                }
            }
            at += len;
            if k > 0 {
                // The first, small, payload read ahead into the second.
                assert_eq!(reader.buffered(), 0, "read past part {k} ({len} bytes)");
            }
        }
        let tail = reader.header::<8>(&reader_stream).await.unwrap().unwrap();
        got[at..].copy_from_slice(&tail);
        assert!(got == stream, "bytes differ");
        sending.await.unwrap();
        assert_eq!(reader.header::<8>(&reader_stream).await.unwrap(), None);
    }
}
