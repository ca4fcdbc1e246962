//! libibverbs, loaded at run time: the verbs types and inline calls of
//! `rdma-sys`, and, under the same names, the library's exported functions
//! this crate calls, looked up with `dlopen("libibverbs.so.1")` the first
//! time a device list is asked for.
//!
//! So no ferry binary (the `ferry` command, the Python extension, the NIXL
//! plugin) needs libibverbs to start: a host without rdma-core runs TCP and
//! same-host memory, and its node reports ibverbs unavailable because
//! libibverbs is not found. Where rdma-core is installed, its own
//! libibverbs is the one loaded, and it finds the providers (mlx5, rxe,
//! ...) of the same rdma-core, whose private ABI must match its own: a
//! libibverbs bundled into a wheel would not know where the host keeps its
//! providers, and a provider would load the host's libibverbs beside it.
//!
//! The calls `rdma-sys` implements in Rust through the context's function
//! table (`ibv_post_send`, `ibv_poll_cq`, `ibv_req_notify_cq`, ...) need no
//! symbol and are used from `rdma-sys` as they are. Items defined here
//! shadow the glob re-export, so `use super::sys::*` gives each module the
//! run-time version of every function listed below.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

#[doc(no_inline)]
pub use rdma_sys::*;

/// The library's name as rdma-core installs it (the runtime package, not
/// the `-dev` one's `libibverbs.so`).
pub const LIBRARY: &str = "libibverbs.so.1";

/// Declares the library's functions: a table of pointers filled by
/// `dlsym`, and one `unsafe fn` per function with the C signature, which
/// calls through the table.
macro_rules! functions {
    ($( fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?; )*) => {
        struct Library {
            $( $name: unsafe extern "C" fn($($ty),*) $(-> $ret)?, )*
        }

        impl Library {
            /// Looks every function up in `handle`, an open libibverbs.
            ///
            /// # Safety
            ///
            /// `handle` is a live `dlopen` handle of libibverbs, so that each
            /// symbol has the C signature declared for it.
            unsafe fn resolve(handle: *mut c_void) -> Result<Library, String> {
                Ok(Library {
                    $( $name: {
                        // SAFETY: the name is NUL-terminated; `handle` is live.
                        let symbol = unsafe {
                            libc::dlsym(handle, concat!(stringify!($name), "\0").as_ptr().cast())
                        };
                        if symbol.is_null() {
                            return Err(format!("{LIBRARY} has no {}", stringify!($name)));
                        }
                        // SAFETY: libibverbs exports the function with this
                        // signature (<infiniband/verbs.h>, as rdma-sys binds it).
                        unsafe {
                            std::mem::transmute::<
                                *mut c_void,
                                unsafe extern "C" fn($($ty),*) $(-> $ret)?,
                            >(symbol)
                        }
                    }, )*
                })
            }
        }

        $(
            #[doc = concat!("`", stringify!($name), "`, from libibverbs loaded at run time.")]
            ///
            /// # Safety
            ///
            /// As the C function's; and libibverbs is loaded, which holds
            /// wherever a device, or anything made from one, exists.
            #[allow(clippy::missing_safety_doc)]
            pub unsafe fn $name($($arg: $ty),*) $(-> $ret)? {
                // SAFETY: the caller keeps the C function's contract.
                unsafe { (loaded().$name)($($arg),*) }
            }
        )*
    };
}

functions! {
    fn ibv_get_device_list(num_devices: *mut c_int) -> *mut *mut ibv_device;
    fn ibv_free_device_list(list: *mut *mut ibv_device);
    fn ibv_get_device_name(device: *mut ibv_device) -> *const c_char;
    fn ibv_open_device(device: *mut ibv_device) -> *mut ibv_context;
    fn ibv_close_device(context: *mut ibv_context) -> c_int;
    fn ibv_query_device(context: *mut ibv_context, device_attr: *mut ibv_device_attr) -> c_int;
    fn ibv_query_port(
        context: *mut ibv_context,
        port_num: u8,
        port_attr: *mut _compat_ibv_port_attr,
    ) -> c_int;
    fn ibv_query_gid(
        context: *mut ibv_context,
        port_num: u8,
        index: c_int,
        gid: *mut ibv_gid,
    ) -> c_int;
    fn ibv_alloc_pd(context: *mut ibv_context) -> *mut ibv_pd;
    fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int;
    fn ibv_reg_mr(pd: *mut ibv_pd, addr: *mut c_void, length: usize, access: c_int) -> *mut ibv_mr;
    fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int;
    fn ibv_create_comp_channel(context: *mut ibv_context) -> *mut ibv_comp_channel;
    fn ibv_destroy_comp_channel(channel: *mut ibv_comp_channel) -> c_int;
    fn ibv_create_cq(
        context: *mut ibv_context,
        cqe: c_int,
        cq_context: *mut c_void,
        channel: *mut ibv_comp_channel,
        comp_vector: c_int,
    ) -> *mut ibv_cq;
    fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int;
    fn ibv_get_cq_event(
        channel: *mut ibv_comp_channel,
        cq: *mut *mut ibv_cq,
        cq_context: *mut *mut c_void,
    ) -> c_int;
    fn ibv_ack_cq_events(cq: *mut ibv_cq, nevents: c_uint);
    fn ibv_create_qp(pd: *mut ibv_pd, qp_init_attr: *mut ibv_qp_init_attr) -> *mut ibv_qp;
    fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int;
    fn ibv_modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, attr_mask: c_int) -> c_int;
    fn ibv_get_async_event(context: *mut ibv_context, event: *mut ibv_async_event) -> c_int;
    fn ibv_ack_async_event(event: *mut ibv_async_event);
    fn ibv_wc_status_str(status: ibv_wc_status::Type) -> *const c_char;
}

static LIBRARY_LOADED: OnceLock<Result<Library, String>> = OnceLock::new();

/// Loads libibverbs once (it stays loaded: its providers and every
/// verbs object point into it), or says why it cannot: not installed
/// (`dlopen`'s own words, which name the file), or missing a function.
pub fn load() -> Result<(), String> {
    LIBRARY_LOADED
        .get_or_init(|| {
            let name = format!("{LIBRARY}\0");
            // SAFETY: a NUL-terminated name; the handle is never closed.
            let handle =
                unsafe { libc::dlopen(name.as_ptr().cast(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if handle.is_null() {
                // SAFETY: dlerror's string is valid until the next dl call on
                // this thread, and is copied out at once.
                let why = unsafe { libc::dlerror() };
                let why = if why.is_null() {
                    format!("{LIBRARY}: cannot load it")
                } else {
                    // SAFETY: as above: a NUL-terminated string.
                    unsafe { CStr::from_ptr(why) }
                        .to_string_lossy()
                        .into_owned()
                };
                return Err(why);
            }
            // SAFETY: `handle` is libibverbs, just opened and never closed.
            unsafe { Library::resolve(handle) }
        })
        .as_ref()
        .map(|_| ())
        .map_err(Clone::clone)
}

fn loaded() -> &'static Library {
    match LIBRARY_LOADED.get() {
        Some(Ok(library)) => library,
        // Every path to a verbs object starts at the device list, which
        // loads the library first (`super::with_devices`).
        _ => panic!("a verbs call before libibverbs was loaded"),
    }
}

/// `ibv_query_port` as `<infiniband/verbs.h>` inlines it (rdma-sys's
/// `___ibv_query_port`, whose fallback calls the exported symbol): the
/// provider's extended `query_port`, told the size of the caller's
/// structure, where the context has one.
///
/// # Safety
///
/// `context` is an open device context and `port_attr` points to a
/// writable `ibv_port_attr`.
pub unsafe fn ___ibv_query_port(
    context: *mut ibv_context,
    port_num: u8,
    port_attr: *mut ibv_port_attr,
) -> c_int {
    // SAFETY: the caller's: an open context, a writable attribute. A
    // context whose `abi_compat` is all ones is the `context` field, the
    // last, of a `verbs_context`, whose `sz` counts the bytes the
    // provider filled in, from its end (as `verbs_get_ctx_op` checks).
    unsafe {
        if (*context).abi_compat as usize == u32::MAX as usize {
            let offset = std::mem::offset_of!(verbs_context, context);
            let verbs = context.cast::<u8>().sub(offset).cast::<verbs_context>();
            let has_field = (*verbs).sz
                >= std::mem::size_of::<verbs_context>()
                    - std::mem::offset_of!(verbs_context, query_port);
            if let (true, Some(query_port)) = (has_field, (*verbs).query_port) {
                return query_port(
                    context,
                    port_num,
                    port_attr,
                    std::mem::size_of::<ibv_port_attr>(),
                );
            }
        }
        std::ptr::write_bytes(port_attr, 0, 1);
        ibv_query_port(context, port_num, port_attr.cast())
    }
}
