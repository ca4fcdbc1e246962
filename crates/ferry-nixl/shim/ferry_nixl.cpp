// The NIXL engine "FERRY": a thin C++ class that NIXL's agent drives
// through its vtable, forwarding every call to the Rust engine
// (src/ffi.rs) over the C interface in ferry_nixl.h. No logic lives here:
// unpacking NIXL's types into plain arrays and strings, and back.
//
// Nothing may unwind into NIXL: every method catches what the standard
// library may throw (allocation) and answers with a status, and the Rust
// side catches its own panics.

#include "ferry_nixl.h"
#include "nixl_abi.h"
#ifdef FERRY_NIXL_PORTABLE
#include "portable.h"
#endif

#include <cstdio>
#include <memory>
#include <mutex>

// The layout NIXL 1.5.1's binaries were seen to use (x86-64, libstdc++):
// an engine defined against a header that drifted would fail here, at
// build time, rather than in NIXL's process.
static_assert(sizeof(nixlBackendEngine) == 208, "nixlBackendEngine layout");
static_assert(sizeof(nixlBackendInitParams) == 96, "nixlBackendInitParams layout");
static_assert(offsetof(nixlBackendInitParams, customParams) == 64, "init params");
static_assert(offsetof(nixlBackendInitParams, enableProgTh) == 72, "init params");
static_assert(offsetof(nixlBackendInitParams, pthrDelay) == 80, "init params");
static_assert(offsetof(nixlBackendInitParams, syncMode) == 88, "init params");
static_assert(offsetof(nixlBackendInitParams, enableTelemetry_) == 92, "init params");
static_assert(sizeof(nixlBasicDesc) == 24 && sizeof(nixlMetaDesc) == 32, "descriptors");
static_assert(sizeof(nixlBlobDesc) == 56 && sizeof(nixlRemoteMetaDesc) == 64, "descriptors");
static_assert(sizeof(nixl_meta_dlist_t) == 40, "descriptor list");
static_assert(sizeof(nixlBackendOptionalArgs) == 72, "optional args");
static_assert(offsetof(nixlBackendOptionalArgs, hasNotif) == 32, "optional args");
static_assert(sizeof(nixlBackendMD) == 16 && sizeof(nixlBackendReqH) == 8, "handles");
static_assert(sizeof(nixlBackendPlugin) == 56, "plugin struct");

namespace {

void append(void *ctx, const uint8_t *bytes, size_t len) {
    static_cast<std::string *>(ctx)->append(reinterpret_cast<const char *>(bytes), len);
}

const uint8_t *bytes(const std::string &s) { return reinterpret_cast<const uint8_t *>(s.data()); }

// A registration's or a loaded handle's metadata: an id into the Rust
// engine's tables. NIXL keeps these pointers inside prepared lists even
// after deregistration, so they are never freed while the engine lives
// (tombstones): a stale one names an id the engine no longer knows, which
// is an error, never a read of freed memory.
class FerryMD : public nixlBackendMD {
public:
    explicit FerryMD(uint64_t id) : nixlBackendMD(true), id(id) {}
    const uint64_t id;
};

// A transfer request: the Rust request it owns.
class FerryReqH : public nixlBackendReqH {
public:
    explicit FerryReqH(void *request) : request(request) {}
    void *request;
};

uint64_t md_id(const nixlBackendMD *md) {
    return md == nullptr ? 0 : static_cast<const FerryMD *>(md)->id;
}

class nixlFerryEngine : public nixlBackendEngine {
public:
    explicit nixlFerryEngine(const nixlBackendInitParams *init) : nixlBackendEngine(init) {
        std::vector<ferry_param> params;
        for (const auto &[key, value] : getCustomParams()) {
            params.push_back({bytes(key), key.size(), bytes(value), value.size()});
        }
        std::string error;
        engine_ = ferry_nixl_engine_new(bytes(localAgent), localAgent.size(), params.data(),
                                        params.size(), append, &error);
        if (engine_ == nullptr) {
            std::fprintf(stderr, "FERRY: cannot start the engine: %s\n", error.c_str());
            initErr = true;
        }
    }

    ~nixlFerryEngine() override {
        if (engine_ != nullptr) {
            ferry_nixl_engine_free(engine_);
        }
    }

    bool supportsRemote() const override { return true; }
    bool supportsLocal() const override { return true; }
    bool supportsNotif() const override { return true; }
    nixl_mem_list_t getSupportedMems() const override { return {DRAM_SEG}; }

    nixl_status_t registerMem(const nixlBlobDesc &mem, const nixl_mem_t &type,
                              nixlBackendMD *&out) override try {
        uint64_t id = 0;
        auto status = ferry_nixl_register(engine_, type, mem.addr, mem.len, &id);
        if (status == NIXL_SUCCESS) {
            out = keep(id);
        }
        return static_cast<nixl_status_t>(status);
    } catch (...) {
        return NIXL_ERR_BACKEND;
    }

    nixl_status_t deregisterMem(nixlBackendMD *md) override {
        return static_cast<nixl_status_t>(ferry_nixl_deregister(engine_, md_id(md)));
    }

    nixl_status_t connect(const std::string &agent) override {
        return static_cast<nixl_status_t>(
            ferry_nixl_connect(engine_, bytes(agent), agent.size()));
    }

    nixl_status_t disconnect(const std::string &agent) override {
        return static_cast<nixl_status_t>(
            ferry_nixl_disconnect(engine_, bytes(agent), agent.size()));
    }

    nixl_status_t unloadMD(nixlBackendMD *md) override {
        if (md == nullptr) {
            return NIXL_SUCCESS;
        }
        return static_cast<nixl_status_t>(ferry_nixl_unload(engine_, md_id(md)));
    }

    nixl_status_t getPublicData(const nixlBackendMD *md, std::string &out) const override try {
        out.clear();
        return static_cast<nixl_status_t>(
            ferry_nixl_public_data(engine_, md_id(md), append, &out));
    } catch (...) {
        return NIXL_ERR_BACKEND;
    }

    nixl_status_t getConnInfo(std::string &out) const override try {
        out.clear();
        return static_cast<nixl_status_t>(ferry_nixl_conn_info(engine_, append, &out));
    } catch (...) {
        return NIXL_ERR_BACKEND;
    }

    nixl_status_t loadRemoteConnInfo(const std::string &agent,
                                     const std::string &info) override {
        return static_cast<nixl_status_t>(ferry_nixl_load_conn_info(
            engine_, bytes(agent), agent.size(), bytes(info), info.size()));
    }

    nixl_status_t loadRemoteMD(const nixlBlobDesc &input, const nixl_mem_t &type,
                               const std::string &agent, nixlBackendMD *&out) override try {
        uint64_t id = 0;
        out = nullptr;
        auto status = ferry_nixl_load_remote(engine_, bytes(agent), agent.size(), type,
                                             input.addr, input.len, bytes(input.metaInfo),
                                             input.metaInfo.size(), &id);
        if (status == NIXL_SUCCESS) {
            out = keep(id);
        }
        return static_cast<nixl_status_t>(status);
    } catch (...) {
        return NIXL_ERR_BACKEND;
    }

    nixl_status_t loadLocalMD(nixlBackendMD *input, nixlBackendMD *&out) override try {
        uint64_t id = 0;
        out = nullptr;
        auto status = ferry_nixl_load_local(engine_, md_id(input), &id);
        if (status == NIXL_SUCCESS) {
            out = keep(id);
        }
        return static_cast<nixl_status_t>(status);
    } catch (...) {
        return NIXL_ERR_BACKEND;
    }

    nixl_status_t prepXfer(const nixl_xfer_op_t &op, const nixl_meta_dlist_t &local,
                           const nixl_meta_dlist_t &remote, const std::string &agent,
                           nixlBackendReqH *&handle,
                           const nixl_opt_b_args_t *) const override try {
        handle = nullptr;
        auto l = descs(local);
        auto r = descs(remote);
        void *request = nullptr;
        auto status = ferry_nixl_prep(engine_, op, l.data(), l.size(), r.data(), r.size(),
                                      bytes(agent), agent.size(), &request);
        if (status == NIXL_SUCCESS) {
            handle = new FerryReqH(request);
        }
        return static_cast<nixl_status_t>(status);
    } catch (...) {
        return NIXL_ERR_BACKEND;
    }

    nixl_status_t postXfer(const nixl_xfer_op_t &, const nixl_meta_dlist_t &,
                           const nixl_meta_dlist_t &, const std::string &,
                           nixlBackendReqH *&handle,
                           const nixl_opt_b_args_t *opt) const override {
        if (handle == nullptr) {
            return NIXL_ERR_INVALID_PARAM;
        }
        bool notify = opt != nullptr && opt->hasNotif;
        const std::string empty;
        const std::string &msg = notify ? opt->notifMsg : empty;
        return static_cast<nixl_status_t>(
            ferry_nixl_post(engine_, static_cast<FerryReqH *>(handle)->request, bytes(msg),
                            msg.size(), notify ? 1 : 0));
    }

    nixl_status_t checkXfer(nixlBackendReqH *handle) const override {
        if (handle == nullptr) {
            return NIXL_ERR_INVALID_PARAM;
        }
        return static_cast<nixl_status_t>(
            ferry_nixl_check(engine_, static_cast<FerryReqH *>(handle)->request));
    }

    nixl_status_t releaseReqH(nixlBackendReqH *handle) const override {
        if (handle == nullptr) {
            return NIXL_SUCCESS;
        }
        auto *h = static_cast<FerryReqH *>(handle);
        auto status = ferry_nixl_release(engine_, h->request);
        if (status == NIXL_SUCCESS) {
            delete h;
        }
        return static_cast<nixl_status_t>(status);
    }

    nixl_status_t getNotifs(notif_list_t &list) override try {
        return static_cast<nixl_status_t>(ferry_nixl_get_notifs(engine_, add_notif, &list));
    } catch (...) {
        return NIXL_ERR_BACKEND;
    }

    nixl_status_t genNotif(const std::string &agent, const std::string &msg) const override {
        return static_cast<nixl_status_t>(ferry_nixl_gen_notif(engine_, bytes(agent), agent.size(),
                                                                bytes(msg), msg.size()));
    }

    nixl_status_t queryMem(const nixl_reg_dlist_t &descs,
                           std::vector<nixl_query_resp_t> &resp) const override try {
        resp.clear();
        for (int i = 0; i < descs.descCount(); i++) {
            int32_t known = 0;
            auto status = ferry_nixl_query(engine_, descs[i].addr, descs[i].len, &known);
            if (status != NIXL_SUCCESS) {
                return static_cast<nixl_status_t>(status);
            }
            if (known) {
                resp.emplace_back(nixl_b_params_t{{"registered", "true"}});
            } else {
                resp.emplace_back(std::nullopt);
            }
        }
        return NIXL_SUCCESS;
    } catch (...) {
        return NIXL_ERR_BACKEND;
    }

    nixl_status_t estimateXferCost(const nixl_xfer_op_t &, const nixl_meta_dlist_t &,
                                   const nixl_meta_dlist_t &, const std::string &,
                                   nixlBackendReqH *const &handle,
                                   std::chrono::microseconds &duration,
                                   std::chrono::microseconds &margin, nixl_cost_t &method,
                                   const nixl_opt_args_t *) const override {
        if (handle == nullptr) {
            return NIXL_ERR_INVALID_PARAM;
        }
        int64_t micros = 0;
        int64_t margin_micros = 0;
        auto status = ferry_nixl_estimate(engine_, static_cast<FerryReqH *>(handle)->request,
                                          &micros, &margin_micros);
        if (status == NIXL_SUCCESS) {
            duration = std::chrono::microseconds(micros);
            margin = std::chrono::microseconds(margin_micros);
            method = nixl_cost_t::ANALYTICAL_BACKEND;
        }
        return static_cast<nixl_status_t>(status);
    }

private:
    static std::vector<ferry_desc> descs(const nixl_meta_dlist_t &list) {
        std::vector<ferry_desc> out;
        out.reserve(list.descCount());
        for (int i = 0; i < list.descCount(); i++) {
            const auto &d = list[i];
            out.push_back({d.addr, d.len, md_id(d.metadataP)});
        }
        return out;
    }

    static void add_notif(void *ctx, const uint8_t *agent, size_t agent_len, const uint8_t *msg,
                          size_t msg_len) {
        static_cast<notif_list_t *>(ctx)->emplace_back(
            std::string(reinterpret_cast<const char *>(agent), agent_len),
            std::string(reinterpret_cast<const char *>(msg), msg_len));
    }

    // A metadata object for `id`, kept until the engine goes (see FerryMD).
    nixlBackendMD *keep(uint64_t id) {
        std::lock_guard<std::mutex> lock(mds_lock_);
        mds_.push_back(std::make_unique<FerryMD>(id));
        return mds_.back().get();
    }

    FerryEngine *engine_ = nullptr;
    std::mutex mds_lock_;
    std::vector<std::unique_ptr<FerryMD>> mds_;
};

nixlBackendEngine *create_engine(const nixlBackendInitParams *init) {
    try {
        return new nixlFerryEngine(init);
    } catch (...) {
        return nullptr;
    }
}

void destroy_engine(nixlBackendEngine *engine) { delete engine; }

const char *plugin_name() { return "FERRY"; }

const char *plugin_version() { return FERRY_NIXL_VERSION; }

nixl_b_params_t backend_options() {
    nixl_b_params_t options;
    try {
        std::string lines;
        ferry_nixl_default_options(append, &lines);
        size_t at = 0;
        while (at < lines.size()) {
            size_t end = lines.find('\n', at);
            if (end == std::string::npos) {
                end = lines.size();
            }
            auto line = lines.substr(at, end - at);
            auto eq = line.find('=');
            if (eq != std::string::npos) {
                options.emplace(line.substr(0, eq), line.substr(eq + 1));
            }
            at = end + 1;
        }
    } catch (...) {
    }
    return options;
}

nixl_mem_list_t backend_mems() { return {DRAM_SEG}; }

nixlBackendPlugin plugin = {
    NIXL_PLUGIN_API_VERSION, create_engine, destroy_engine, plugin_name,
    plugin_version,          backend_options, backend_mems,
};

} // namespace

// Called by the Rust `nixl_plugin_init` once it checked the host NIXL:
// the plugin table NIXL reads. Static, so repeated loads see one table.
extern "C" void *ferry_nixl_plugin_table() { return &plugin; }
