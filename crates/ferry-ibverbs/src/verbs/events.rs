//! A device's asynchronous events (`ibv_get_async_event`): the ones ferry
//! acts on are a port going down or coming back.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::RawFd;

use super::sys::*;

use super::{Context, VerbsError};

/// An asynchronous event of a device, as ferry tells them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceEvent {
    /// The port's link went down (`IBV_EVENT_PORT_ERR`).
    PortDown(u8),
    /// The port is active again (`IBV_EVENT_PORT_ACTIVE`).
    PortUp(u8),
    /// The device failed as a whole (`IBV_EVENT_DEVICE_FATAL`).
    DeviceFatal,
    /// Any other event (a queue pair's, a GID change, ...), by its number.
    Other(u32),
}

const PORT_ACTIVE: u32 = ibv_event_type::IBV_EVENT_PORT_ACTIVE as u32;
const PORT_ERR: u32 = ibv_event_type::IBV_EVENT_PORT_ERR as u32;
const DEVICE_FATAL: u32 = ibv_event_type::IBV_EVENT_DEVICE_FATAL as u32;

impl Context {
    /// The file descriptor that turns readable when the device has an
    /// event, switched to non-blocking so that [`Context::next_event`]
    /// never waits. Valid for as long as the context is open.
    pub fn event_fd(&self) -> Result<RawFd, VerbsError> {
        // SAFETY: the context is open (`raw` is valid while `self` lives);
        // `async_fd` is a plain field libibverbs set at open.
        let fd = unsafe { (*self.raw.as_ptr()).async_fd };
        // SAFETY: fcntl on a descriptor the context owns; only its status
        // flags change.
        let set = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if set {
            Ok(fd)
        } else {
            Err(VerbsError::Call {
                call: "fcntl(async_fd, O_NONBLOCK)",
                source: io::Error::last_os_error(),
            })
        }
    }

    /// The device's next event, acknowledged, or `None` if it has none now
    /// (the descriptor of [`Context::event_fd`] is non-blocking).
    pub fn next_event(&self) -> Result<Option<DeviceEvent>, VerbsError> {
        let mut event = MaybeUninit::<ibv_async_event>::uninit();
        // SAFETY: the context is open; `event` has room for one event,
        // which libibverbs fills when it returns 0.
        if unsafe { ibv_get_async_event(self.raw.as_ptr(), event.as_mut_ptr()) } != 0 {
            let error = io::Error::last_os_error();
            return match error.kind() {
                io::ErrorKind::WouldBlock => Ok(None),
                _ => Err(VerbsError::Call {
                    call: "ibv_get_async_event",
                    source: error,
                }),
            };
        }
        let event = event.as_mut_ptr();
        // SAFETY: filled above. The type is read as the integer the C side
        // wrote, not as the Rust enum, which a newer libibverbs's event
        // number would not fit; the port number is the union's member for
        // port events.
        let (kind, port) = unsafe {
            (
                std::ptr::addr_of!((*event).event_type).cast::<u32>().read(),
                std::ptr::addr_of!((*event).element.port_num).read(),
            )
        };
        // SAFETY: every event got must be acknowledged once, or closing the
        // context blocks; nothing of it is read after this.
        unsafe { ibv_ack_async_event(event) };
        let port = u8::try_from(port).unwrap_or(0);
        Ok(Some(match kind {
            PORT_ERR => DeviceEvent::PortDown(port),
            PORT_ACTIVE => DeviceEvent::PortUp(port),
            DEVICE_FATAL => DeviceEvent::DeviceFatal,
            other => DeviceEvent::Other(other),
        }))
    }
}
