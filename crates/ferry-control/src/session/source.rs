//! A session's incoming frames, read so that the session knows when it is
//! in the middle of one: a peer that begins a frame and then goes silent
//! holds a connection and a place under the endpoint's bounds, so every wait
//! for the rest of a frame is bounded ([`ConnectionLimits::frame_timeout`])
//! and, on an accepted session, evictable at a bound like an idle
//! connection ([`ConnectionPermit::while_mid_frame`]). Between frames the
//! session waits as long as the peer likes (it has its own liveness), but
//! an accepted one is evictable at a bound once it has waited
//! [`ConnectionLimits::session_evictable_after`] with nothing in flight
//! (see [`crate::limits`]).
//!
//! [`ConnectionLimits::session_evictable_after`]: crate::ConnectionLimits::session_evictable_after
//!
//! [`ConnectionLimits::frame_timeout`]: crate::ConnectionLimits::frame_timeout

use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::AsyncReadExt;
use tokio::net::tcp::OwnedReadHalf;
use tokio_util::codec::{Decoder, FramedRead};

use crate::ConnectionPermit;
use crate::frame::{ControlCodec, Frame, FrameError};

/// Room made in the buffer before each read, as `FramedRead` does.
const READ_RESERVE: usize = 8 * 1024;

/// Frames from the peer, one at a time.
pub(super) struct FrameSource {
    read: OwnedReadHalf,
    codec: ControlCodec,
    buf: BytesMut,
    /// The accepted connection's place, for eviction mid-frame; `None` on
    /// a session this node opened (only the bound applies there).
    permit: Option<Arc<ConnectionPermit>>,
    frame_timeout: Duration,
}

impl FrameSource {
    /// Takes over `framed` after the handshake, bytes it buffered included.
    pub(super) fn new(
        framed: FramedRead<OwnedReadHalf, ControlCodec>,
        permit: Option<Arc<ConnectionPermit>>,
        frame_timeout: Duration,
    ) -> Self {
        let parts = framed.into_parts();
        FrameSource {
            read: parts.io,
            codec: parts.codec,
            buf: parts.read_buf,
            permit,
            frame_timeout,
        }
    }

    /// The next frame; `None` when the stream ended between frames. A
    /// stream that ends inside a frame is `UnexpectedEof`, a peer silent
    /// inside one past the bound `TimedOut`. Cancel-safe: a dropped call
    /// loses no byte.
    pub(super) async fn next(&mut self) -> Option<Result<Frame, FrameError>> {
        loop {
            match self.codec.decode(&mut self.buf) {
                Ok(Some(frame)) => return Some(Ok(frame)),
                Ok(None) => {}
                Err(e) => return Some(Err(e)),
            }
            self.buf.reserve(READ_RESERVE);
            let mid_frame = !self.buf.is_empty();
            let read = self.read.read_buf(&mut self.buf);
            let read = if !mid_frame {
                match &self.permit {
                    // Between frames: evictable once idle long enough.
                    Some(permit) => permit.while_session_idle(read).await.unwrap_or_else(|e| {
                        Err(io::Error::new(
                            io::ErrorKind::ConnectionAborted,
                            e.to_string(),
                        ))
                    }),
                    None => read.await,
                }
            } else {
                match &self.permit {
                    Some(permit) => permit.while_mid_frame(read).await.unwrap_or_else(|e| {
                        Err(io::Error::new(io::ErrorKind::TimedOut, e.to_string()))
                    }),
                    None => tokio::time::timeout(self.frame_timeout, read)
                        .await
                        .unwrap_or_else(|_| {
                            let stalled = crate::IdleClose::Stalled(self.frame_timeout);
                            Err(io::Error::new(io::ErrorKind::TimedOut, stalled.to_string()))
                        }),
                }
            };
            match read {
                Ok(0) if !mid_frame => return None,
                Ok(0) => {
                    let eof = io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the stream ended inside a frame",
                    );
                    return Some(Err(eof.into()));
                }
                Ok(_) => {}
                Err(e) => return Some(Err(e.into())),
            }
        }
    }
}
