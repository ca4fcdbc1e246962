//! Completion channels and completion queues.

use std::ffi::CStr;
use std::io;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use super::sys::*;

use super::{Context, VerbsError, call_error, check_rc};

/// A completion event channel: a file descriptor that becomes readable when
/// an armed completion queue gets a completion.
pub struct CompletionChannel {
    pub(super) raw: NonNull<ibv_comp_channel>,
    _context: Arc<Context>,
}

// SAFETY: completion channels are thread safe; freed only in Drop.
unsafe impl Send for CompletionChannel {}
// SAFETY: as above.
unsafe impl Sync for CompletionChannel {}

impl CompletionChannel {
    /// Creates a channel on `context` (`ibv_create_comp_channel`).
    pub fn new(context: &Arc<Context>) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: the context is open.
        let raw = unsafe { ibv_create_comp_channel(context.raw.as_ptr()) };
        let raw = NonNull::new(raw).ok_or_else(|| call_error("ibv_create_comp_channel"))?;
        Ok(Arc::new(CompletionChannel {
            raw,
            _context: context.clone(),
        }))
    }

    /// The file descriptor to wait on; owned by the channel, do not close it.
    pub fn fd(&self) -> i32 {
        // SAFETY: the channel is alive until Drop.
        unsafe { self.raw.as_ref().fd }
    }

    /// Makes `take_event` return instead of blocking when no event is pending,
    /// so the fd can be driven by an async reactor.
    pub fn set_nonblocking(&self) -> Result<(), VerbsError> {
        let fd = self.fd();
        // SAFETY: fcntl on a file descriptor this channel owns; only the
        // O_NONBLOCK status flag is changed.
        let rc = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags < 0 {
                flags
            } else {
                libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK)
            }
        };
        if rc < 0 {
            Err(call_error("fcntl(O_NONBLOCK)"))
        } else {
            Ok(())
        }
    }
}

impl Drop for CompletionChannel {
    fn drop(&mut self) {
        // SAFETY: every CQ using this channel holds an Arc to it.
        unsafe { ibv_destroy_comp_channel(self.raw.as_ptr()) };
    }
}

/// One work completion, decoded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Completion {
    /// The `wr_id` the work request was posted with.
    pub wr_id: u64,
    /// `ibv_wc_status` value; 0 is success.
    pub status: u32,
    /// Number of the local queue pair the request was posted on.
    pub qp_num: u32,
    /// For a receive: how many bytes the peer's SEND placed in the buffer.
    pub byte_len: u32,
}

impl Completion {
    /// Whether the work request succeeded.
    pub fn is_success(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_SUCCESS
    }

    /// The peer's NIC refused the access: a wrong rkey, a range outside the
    /// memory region, or an access its registration does not grant.
    pub fn is_remote_access_error(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_REM_ACCESS_ERR
    }

    /// The request was flushed because its queue pair went to the error
    /// state; it may have run partly, and its memory is no longer touched.
    pub fn is_flush(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_WR_FLUSH_ERR
    }

    /// The peer stopped answering (transport or RNR retries exhausted).
    pub fn is_retry_exceeded(&self) -> bool {
        self.status == ibv_wc_status::IBV_WC_RETRY_EXC_ERR
            || self.status == ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR
    }

    /// The status as libibverbs describes it, for error messages.
    pub fn status_str(&self) -> String {
        // SAFETY: returns a static NUL-terminated string for any status.
        unsafe { CStr::from_ptr(ibv_wc_status_str(self.status)) }
            .to_string_lossy()
            .into_owned()
    }
}

/// A completion queue, optionally raising events on a
/// [`CompletionChannel`]. Keeps its context and channel alive.
pub struct CompletionQueue {
    pub(super) raw: NonNull<ibv_cq>,
    _context: Arc<Context>,
    channel: Option<Arc<CompletionChannel>>,
    entries: u32,
}

// SAFETY: CQs are thread safe; freed only in Drop.
unsafe impl Send for CompletionQueue {}
// SAFETY: as above.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// Creates a queue with room for at least `entries` completions; an armed
    /// queue signals `channel`, if given.
    pub fn new(
        context: &Arc<Context>,
        entries: u32,
        channel: Option<Arc<CompletionChannel>>,
    ) -> Result<Arc<Self>, VerbsError> {
        let channel_ptr = channel.as_ref().map_or(ptr::null_mut(), |c| c.raw.as_ptr());
        // SAFETY: the context is open; the channel (if any) is held by the CQ.
        let raw = unsafe {
            ibv_create_cq(
                context.raw.as_ptr(),
                entries as i32,
                ptr::null_mut(),
                channel_ptr,
                0,
            )
        };
        let raw = NonNull::new(raw).ok_or_else(|| call_error("ibv_create_cq"))?;
        // SAFETY: the CQ was just created; `cqe` is the real capacity.
        let entries = unsafe { raw.as_ref().cqe }.max(0) as u32;
        Ok(Arc::new(CompletionQueue {
            raw,
            _context: context.clone(),
            channel,
            entries,
        }))
    }

    /// Real capacity (at least what was asked for).
    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// The channel its events go to, if it was created with one.
    pub fn channel(&self) -> Option<&Arc<CompletionChannel>> {
        self.channel.as_ref()
    }

    /// The raw `ibv_cq*`.
    ///
    /// # Safety
    ///
    /// Valid while this CQ lives; the caller must not destroy it.
    pub unsafe fn raw(&self) -> *mut ibv_cq {
        self.raw.as_ptr()
    }

    /// Fills `out` with up to `out.len()` completions; returns how many.
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize, VerbsError> {
        const BATCH: usize = 32;
        // Not zeroed: this runs in busy-poll loops, and the provider writes
        // every entry it reports.
        let mut wcs = [const { std::mem::MaybeUninit::<ibv_wc>::uninit() }; BATCH];
        let mut total = 0;
        while total < out.len() {
            let want = (out.len() - total).min(BATCH);
            // SAFETY: `wcs` has room for `want` entries; the CQ is alive.
            let n = unsafe { ibv_poll_cq(self.raw.as_ptr(), want as i32, wcs[0].as_mut_ptr()) };
            if n < 0 {
                return Err(VerbsError::Call {
                    call: "ibv_poll_cq",
                    source: io::Error::from_raw_os_error(-n),
                });
            }
            let n = n as usize;
            for (slot, wc) in out[total..total + n].iter_mut().zip(&wcs) {
                // SAFETY: ibv_poll_cq filled the first `n` entries.
                let wc = unsafe { wc.assume_init_ref() };
                *slot = Completion {
                    wr_id: wc.wr_id,
                    status: wc.status,
                    qp_num: wc.qp_num,
                    byte_len: wc.byte_len,
                };
            }
            total += n;
            if n < want {
                break;
            }
        }
        Ok(total)
    }

    /// Asks for an event on the channel at the next completion.
    pub fn arm(&self) -> Result<(), VerbsError> {
        // SAFETY: the CQ is alive.
        check_rc("ibv_req_notify_cq", unsafe {
            ibv_req_notify_cq(self.raw.as_ptr(), 0)
        })
    }

    /// Consumes one pending event from the channel (non-blocking when the
    /// channel fd is non-blocking) and acknowledges it. Returns whether there
    /// was one.
    pub fn take_event(&self) -> Result<bool, VerbsError> {
        let Some(channel) = &self.channel else {
            return Ok(false);
        };
        let mut cq = ptr::null_mut();
        let mut context = ptr::null_mut();
        // SAFETY: the channel is alive; out-pointers are valid.
        let rc = unsafe { ibv_get_cq_event(channel.raw.as_ptr(), &mut cq, &mut context) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock => Ok(false),
                _ => Err(VerbsError::Call {
                    call: "ibv_get_cq_event",
                    source: e,
                }),
            };
        }
        // SAFETY: `cq` is the CQ the event was for (this one, as the channel is
        // used by this CQ only); one event is acknowledged.
        unsafe { ibv_ack_cq_events(cq, 1) };
        Ok(true)
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: every QP using this CQ holds an Arc to it.
        unsafe { ibv_destroy_cq(self.raw.as_ptr()) };
    }
}
