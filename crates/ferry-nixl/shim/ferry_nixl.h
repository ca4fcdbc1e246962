// The C interface between the C++ engine (ferry_nixl.cpp) and the Rust one
// (src/ffi.rs). Every function returns a nixl_status_t value and never
// throws or unwinds: the Rust side catches panics and answers
// NIXL_ERR_UNKNOWN. Strings and byte strings are (pointer, length) pairs;
// whatever Rust hands back goes through a sink the caller provides, so no
// buffer changes hands between the two allocators.

#ifndef FERRY_NIXL_H
#define FERRY_NIXL_H

#include <cstddef>
#include <cstdint>

extern "C" {

struct FerryEngine;

// Receives bytes for the caller (appends them to a std::string).
typedef void (*ferry_sink)(void *ctx, const uint8_t *bytes, size_t len);

// One notification for getNotifs: the sending agent and the message.
typedef void (*ferry_notif_sink)(void *ctx, const uint8_t *agent, size_t agent_len,
                                 const uint8_t *msg, size_t msg_len);

// A backend option as NIXL passes it.
struct ferry_param {
    const uint8_t *key;
    size_t key_len;
    const uint8_t *value;
    size_t value_len;
};

// One descriptor of a transfer: its bytes and the engine's metadata id of
// the registration (local) or loaded handle (remote) it lies in.
struct ferry_desc {
    uint64_t addr;
    uint64_t len;
    uint64_t md;
};

FerryEngine *ferry_nixl_engine_new(const uint8_t *agent, size_t agent_len,
                                   const ferry_param *params, size_t n_params, ferry_sink error,
                                   void *error_ctx);
void ferry_nixl_engine_free(FerryEngine *engine);

int32_t ferry_nixl_conn_info(const FerryEngine *engine, ferry_sink out, void *ctx);
int32_t ferry_nixl_load_conn_info(FerryEngine *engine, const uint8_t *agent, size_t agent_len,
                                  const uint8_t *info, size_t info_len);
int32_t ferry_nixl_connect(FerryEngine *engine, const uint8_t *agent, size_t agent_len);
int32_t ferry_nixl_disconnect(FerryEngine *engine, const uint8_t *agent, size_t agent_len);

int32_t ferry_nixl_register(FerryEngine *engine, int32_t mem, uint64_t addr, uint64_t len,
                            uint64_t *md);
int32_t ferry_nixl_deregister(FerryEngine *engine, uint64_t md);
int32_t ferry_nixl_public_data(const FerryEngine *engine, uint64_t md, ferry_sink out, void *ctx);
int32_t ferry_nixl_load_remote(FerryEngine *engine, const uint8_t *agent, size_t agent_len,
                               int32_t mem, uint64_t addr, uint64_t len, const uint8_t *blob,
                               size_t blob_len, uint64_t *md);
int32_t ferry_nixl_load_local(FerryEngine *engine, uint64_t local_md, uint64_t *md);
int32_t ferry_nixl_unload(FerryEngine *engine, uint64_t md);
int32_t ferry_nixl_query(const FerryEngine *engine, uint64_t addr, uint64_t len, int32_t *known);

int32_t ferry_nixl_prep(const FerryEngine *engine, int32_t op, const ferry_desc *local,
                        size_t n_local, const ferry_desc *remote, size_t n_remote,
                        const uint8_t *agent, size_t agent_len, void **request);
int32_t ferry_nixl_post(const FerryEngine *engine, void *request, const uint8_t *notif,
                        size_t notif_len, int32_t has_notif);
int32_t ferry_nixl_check(const FerryEngine *engine, void *request);
int32_t ferry_nixl_release(const FerryEngine *engine, void *request);
int32_t ferry_nixl_estimate(const FerryEngine *engine, void *request, int64_t *micros,
                            int64_t *margin_micros);

int32_t ferry_nixl_get_notifs(FerryEngine *engine, ferry_notif_sink out, void *ctx);
int32_t ferry_nixl_gen_notif(const FerryEngine *engine, const uint8_t *agent, size_t agent_len,
                             const uint8_t *msg, size_t msg_len);

// The plugin's options and their defaults, as key=value lines.
int32_t ferry_nixl_default_options(ferry_sink out, void *ctx);
}

#endif
