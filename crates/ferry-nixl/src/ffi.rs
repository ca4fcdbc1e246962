//! The C functions the C++ engine calls (`shim/ferry_nixl.h`): each
//! unpacks its pointers, calls the [`Engine`], and answers a NIXL status.
//! No panic crosses: each body runs under `catch_unwind`, and a panic is
//! `NIXL_ERR_UNKNOWN` (and its message, on stderr, by the panic hook).

use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::descs::Desc;
use crate::engine::{Engine, Request, Status};

/// The C++ side's byte sink (appends to a `std::string`).
type Sink = extern "C" fn(ctx: *mut c_void, bytes: *const u8, len: usize);
/// The C++ side's notification sink (appends to NIXL's list).
type NotifSink = extern "C" fn(
    ctx: *mut c_void,
    agent: *const u8,
    agent_len: usize,
    msg: *const u8,
    msg_len: usize,
);

/// A backend option as NIXL passes it.
#[repr(C)]
pub struct Param {
    key: *const u8,
    key_len: usize,
    value: *const u8,
    value_len: usize,
}

/// Runs `body`, answering `Unknown` for a panic.
fn guard(body: impl FnOnce() -> Status) -> i32 {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(Status::Unknown) as i32
}

/// The bytes at `ptr`, `len` long.
///
/// # Safety
///
/// `ptr..ptr+len` must be readable for the call (or `len` 0).
unsafe fn slice<'a>(ptr: *const u8, len: usize) -> &'a [u8] {
    if len == 0 || ptr.is_null() {
        return &[];
    }
    // SAFETY: forwarded to the caller.
    unsafe { std::slice::from_raw_parts(ptr, len) }
}

/// A string NIXL passed (agent names and options are UTF-8 in practice;
/// anything else is read lossily rather than refused).
///
/// # Safety
///
/// As [`slice`].
unsafe fn text(ptr: *const u8, len: usize) -> String {
    // SAFETY: forwarded to the caller.
    String::from_utf8_lossy(unsafe { slice(ptr, len) }).into_owned()
}

fn send(sink: Sink, ctx: *mut c_void, bytes: &[u8]) {
    sink(ctx, bytes.as_ptr(), bytes.len());
}

/// # Safety
///
/// `engine` came from [`ferry_nixl_engine_new`] and is not freed yet.
unsafe fn engine<'a>(engine: *const Engine) -> &'a Engine {
    // SAFETY: forwarded to the caller.
    unsafe { &*engine }
}

/// # Safety
///
/// `request` came from [`ferry_nixl_prep`] and is not released yet.
unsafe fn request<'a>(request: *mut c_void) -> &'a Request {
    // SAFETY: forwarded to the caller.
    unsafe { &*(request as *const Request) }
}

/// Starts an engine for agent `agent` with NIXL's options; null (and the
/// reason through `error`) when it cannot.
///
/// # Safety
///
/// Every pointer is readable for its length; `params` holds `n_params`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_nixl_engine_new(
    agent: *const u8,
    agent_len: usize,
    params: *const Param,
    n_params: usize,
    error: Sink,
    error_ctx: *mut c_void,
) -> *mut Engine {
    let made = catch_unwind(AssertUnwindSafe(|| {
        crate::init_logging();
        // SAFETY: the caller's pointers, per this function's contract.
        let (agent, params) = unsafe {
            let params = match n_params {
                0 => &[][..],
                n => std::slice::from_raw_parts(params, n),
            };
            let params: HashMap<String, String> = params
                .iter()
                .map(|p| (text(p.key, p.key_len), text(p.value, p.value_len)))
                .collect();
            (text(agent, agent_len), params)
        };
        Engine::new(&agent, &params)
    }));
    match made {
        Ok(Ok(engine)) => Box::into_raw(Box::new(engine)),
        Ok(Err(reason)) => {
            send(error, error_ctx, reason.as_bytes());
            std::ptr::null_mut()
        }
        Err(_) => {
            send(error, error_ctx, b"the engine panicked while starting");
            std::ptr::null_mut()
        }
    }
}

/// Stops the engine's node and frees it.
///
/// # Safety
///
/// `engine` came from [`ferry_nixl_engine_new`]; it is not used again.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_nixl_engine_free(engine: *mut Engine) {
    if engine.is_null() {
        return;
    }
    // SAFETY: per the contract, the box is ours to take back once.
    let engine = unsafe { Box::from_raw(engine) };
    // A panic while stopping must not unwind into NIXL's destructor.
    _ = catch_unwind(AssertUnwindSafe(move || drop(engine)));
}

/// # Safety
///
/// `engine` is live; `out` appends to `ctx`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_nixl_conn_info(
    engine: *const Engine,
    out: Sink,
    ctx: *mut c_void,
) -> i32 {
    guard(|| {
        // SAFETY: per the contract.
        let info = unsafe { self::engine(engine) }.conn_info();
        send(out, ctx, info.as_bytes());
        Status::Success
    })
}

/// # Safety
///
/// `engine` is live; the byte strings are readable for their lengths.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_nixl_load_conn_info(
    engine: *const Engine,
    agent: *const u8,
    agent_len: usize,
    info: *const u8,
    info_len: usize,
) -> i32 {
    guard(|| {
        // SAFETY: per the contract.
        unsafe {
            self::engine(engine).load_conn_info(&text(agent, agent_len), slice(info, info_len))
        }
    })
}

/// # Safety
///
/// `engine` is live; `agent` is readable for its length.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_nixl_connect(
    engine: *const Engine,
    agent: *const u8,
    agent_len: usize,
) -> i32 {
    // SAFETY: per the contract.
    guard(|| unsafe { self::engine(engine).connect(&text(agent, agent_len)) })
}

/// # Safety
///
/// As [`ferry_nixl_connect`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_nixl_disconnect(
    engine: *const Engine,
    agent: *const u8,
    agent_len: usize,
) -> i32 {
    // SAFETY: per the contract.
    guard(|| unsafe { self::engine(engine).disconnect(&text(agent, agent_len)) })
}

/// # Safety
///
/// `engine` is live; `md` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_nixl_register(
    engine: *const Engine,
    mem: i32,
    addr: u64,
    len: u64,
    md: *mut u64,
) -> i32 {
    guard(|| {
        // SAFETY: per the contract.
        match unsafe { self::engine(engine) }.register(mem, addr, len) {
            Ok(id) => {
                // SAFETY: per the contract.
                unsafe { *md = id };
                Status::Success
            }
            Err(status) => status,
        }
    })
}

/// # Safety
///
/// `engine` is live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_nixl_deregister(engine: *const Engine, md: u64) -> i32 {
    // SAFETY: per the contract.
    guard(|| unsafe { self::engine(engine) }.deregister(md))
}

/// # Safety
///
/// `engine` is live; `out` appends to `ctx`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_nixl_public_data(
    engine: *const Engine,
    md: u64,
    out: Sink,
    ctx: *mut c_void,
) -> i32 {
    guard(|| {
        // SAFETY: per the contract.
        match unsafe { self::engine(engine) }.public_data(md) {
            Ok(data) => {
                send(out, ctx, data.as_bytes());
                Status::Success
            }
            Err(status) => status,
        }
    })
}

/// # Safety
///
/// `engine` is live; byte strings readable for their lengths; `md`
/// writable.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ferry_nixl_load_remote(
    engine: *const Engine,
    agent: *const u8,
    agent_len: usize,
    mem: i32,
    addr: u64,
    len: u64,
    blob: *const u8,
    blob_len: usize,
    md: *mut u64,
) -> i32 {
    guard(|| {
        // SAFETY: per the contract.
        let loaded = unsafe {
            self::engine(engine).load_remote(
                &text(agent, agent_len),
                mem,
                addr,
                len,
                slice(blob, blob_len),
            )
        };
        match loaded {
            Ok(id) => {
                // SAFETY: per the contract.
                unsafe { *md = id };
                Status::Success
            }
            Err(status) => status,
        }
    })
}

/// # Safety
///
/// `engine` is live; `md` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_nixl_load_local(
    engine: *const Engine,
    local_md: u64,
    md: *mut u64,
) -> i32 {
    guard(|| {
        // SAFETY: per the contract.
        match unsafe { self::engine(engine) }.load_local(local_md) {
            Ok(id) => {
                // SAFETY: per the contract.
                unsafe { *md = id };
                Status::Success
            }
            Err(status) => status,
        }
    })
}

/// # Safety
///
/// `engine` is live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_nixl_unload(engine: *const Engine, md: u64) -> i32 {
    // SAFETY: per the contract.
    guard(|| unsafe { self::engine(engine) }.unload(md))
}

/// # Safety
///
/// `engine` is live; `known` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_nixl_query(
    engine: *const Engine,
    addr: u64,
    len: u64,
    known: *mut i32,
) -> i32 {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { *known = i32::from(self::engine(engine).query(addr, len)) };
        Status::Success
    })
}

/// # Safety
///
/// `engine` is live; `local`/`remote` hold `n_local`/`n_remote`
/// descriptors; `agent` is readable; `request` writable.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ferry_nixl_prep(
    engine: *const Engine,
    op: i32,
    local: *const Desc,
    n_local: usize,
    remote: *const Desc,
    n_remote: usize,
    agent: *const u8,
    agent_len: usize,
    request: *mut *mut c_void,
) -> i32 {
    guard(|| {
        let descs = |ptr: *const Desc, n: usize| match n {
            0 => &[][..],
            // SAFETY: per the contract.
            n => unsafe { std::slice::from_raw_parts(ptr, n) },
        };
        let (local, remote) = (descs(local, n_local), descs(remote, n_remote));
        // NIXL_READ is 0, NIXL_WRITE 1.
        let read = match op {
            0 => true,
            1 => false,
            _ => return Status::InvalidParam,
        };
        // SAFETY: per the contract.
        let (engine, agent) = unsafe { (self::engine(engine), text(agent, agent_len)) };
        match engine.prep(read, local, remote, &agent) {
            Ok(made) => {
                // SAFETY: per the contract.
                unsafe { *request = Box::into_raw(Box::new(made)).cast() };
                Status::Success
            }
            Err(status) => status,
        }
    })
}

/// # Safety
///
/// `engine` and `request` are live; `notif` readable for its length.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_nixl_post(
    engine: *const Engine,
    request: *mut c_void,
    notif: *const u8,
    notif_len: usize,
    has_notif: i32,
) -> i32 {
    guard(|| {
        // SAFETY: per the contract.
        unsafe {
            let notif = (has_notif != 0).then(|| slice(notif, notif_len));
            self::engine(engine).post(self::request(request), notif)
        }
    })
}

/// # Safety
///
/// `engine` and `request` are live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_nixl_check(engine: *const Engine, request: *mut c_void) -> i32 {
    // SAFETY: per the contract.
    guard(|| unsafe { self::engine(engine).check(self::request(request)) })
}

/// Frees `request` when the answer is success; otherwise it stays live.
///
/// # Safety
///
/// `engine` and `request` are live; on success `request` is not used again.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_nixl_release(engine: *const Engine, request: *mut c_void) -> i32 {
    guard(|| {
        // SAFETY: per the contract.
        let status = unsafe { self::engine(engine).release(self::request(request)) };
        if status == Status::Success {
            // SAFETY: made by `ferry_nixl_prep`; freed once, here.
            drop(unsafe { Box::from_raw(request.cast::<Request>()) });
        }
        status
    })
}

/// # Safety
///
/// `engine` and `request` are live; the outputs writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_nixl_estimate(
    engine: *const Engine,
    request: *mut c_void,
    micros: *mut i64,
    margin_micros: *mut i64,
) -> i32 {
    guard(|| {
        // SAFETY: per the contract.
        unsafe {
            let (duration, margin) = self::engine(engine).estimate(self::request(request));
            *micros = duration;
            *margin_micros = margin;
        }
        Status::Success
    })
}

/// # Safety
///
/// `engine` is live; `out` appends to `ctx`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_nixl_get_notifs(
    engine: *const Engine,
    out: NotifSink,
    ctx: *mut c_void,
) -> i32 {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { self::engine(engine) }
            .notifs(|agent, msg| out(ctx, agent.as_ptr(), agent.len(), msg.as_ptr(), msg.len()));
        Status::Success
    })
}

/// # Safety
///
/// `engine` is live; byte strings readable for their lengths.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ferry_nixl_gen_notif(
    engine: *const Engine,
    agent: *const u8,
    agent_len: usize,
    msg: *const u8,
    msg_len: usize,
) -> i32 {
    guard(|| {
        // SAFETY: per the contract.
        unsafe { self::engine(engine).gen_notif(&text(agent, agent_len), slice(msg, msg_len)) }
    })
}

/// The options and their defaults, as `key=value` lines.
#[unsafe(no_mangle)]
pub extern "C" fn ferry_nixl_default_options(out: Sink, ctx: *mut c_void) -> i32 {
    guard(|| {
        for (key, default, _) in crate::options::DEFAULTS {
            send(out, ctx, format!("{key}={default}\n").as_bytes());
        }
        Status::Success
    })
}
