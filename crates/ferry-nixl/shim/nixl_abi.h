// ferry's declaration of the NIXL backend-plugin ABI (plugin API version 1,
// as NIXL 1.5.1 loads it), written for ferry: the same classes, members and
// virtual methods in the same order with the same types as NIXL's own
// headers (src/api/cpp/backend/backend_engine.h, backend_aux.h,
// backend_plugin.h, nixl_types.h, nixl_descriptors.h in ai-dynamo/nixl),
// so that an engine defined here is one NIXL can drive. Like FFI bindings:
// only the shapes, none of NIXL's code. The static_asserts in
// ferry_nixl.cpp pin every size and offset the wheel's binaries were seen
// to use, and the Python suite loads the plugin into the installed wheel.
//
// Only what a backend touches is declared. Descriptor lists are read
// through their inline accessors; nothing here needs a NIXL library at
// link time.

#ifndef FERRY_NIXL_ABI_H
#define FERRY_NIXL_ABI_H

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

// ---------------------------------------------------------------- nixl_types.h

enum nixl_mem_t { DRAM_SEG = 0, VRAM_SEG = 1, BLK_SEG = 2, OBJ_SEG = 3, FILE_SEG = 4 };

enum nixl_xfer_op_t { NIXL_READ = 0, NIXL_WRITE = 1 };

enum nixl_status_t {
    NIXL_IN_PROG = 1,
    NIXL_SUCCESS = 0,
    NIXL_ERR_NOT_POSTED = -1,
    NIXL_ERR_INVALID_PARAM = -2,
    NIXL_ERR_BACKEND = -3,
    NIXL_ERR_NOT_FOUND = -4,
    NIXL_ERR_MISMATCH = -5,
    NIXL_ERR_NOT_ALLOWED = -6,
    NIXL_ERR_REPOST_ACTIVE = -7,
    NIXL_ERR_UNKNOWN = -8,
    NIXL_ERR_NOT_SUPPORTED = -9,
    NIXL_ERR_REMOTE_DISCONNECT = -10,
    NIXL_ERR_CANCELED = -11,
    NIXL_ERR_NO_TELEMETRY = -12,
};

enum class nixl_thread_sync_t { NIXL_THREAD_SYNC_NONE = 0, NIXL_THREAD_SYNC_STRICT = 1, NIXL_THREAD_SYNC_RW = 2 };

enum class nixl_cost_t { ANALYTICAL_BACKEND = 0 };

using nixl_backend_t = std::string;
using nixl_blob_t = std::string;
using nixl_mem_list_t = std::vector<nixl_mem_t>;
using nixl_b_params_t = std::unordered_map<std::string, std::string>;
using notif_list_t = std::vector<std::pair<std::string, std::string>>;
using nixl_query_resp_t = std::optional<nixl_b_params_t>;
using nixlMemViewH = void *;

namespace nixlTime {
using us_t = uint64_t;
}

// Passed to estimateXferCost only by pointer, never read here.
class nixlAgentOptionalArgs;
using nixl_opt_args_t = nixlAgentOptionalArgs;

// ---------------------------------------------------------- nixl_descriptors.h

class nixlBackendMD;

class nixlBasicDesc {
public:
    uintptr_t addr;
    size_t len;
    uint64_t devId;
};

class nixlBlobDesc : public nixlBasicDesc {
public:
    nixl_blob_t metaInfo;
};

class nixlMetaDesc : public nixlBasicDesc {
public:
    nixlBackendMD *metadataP;
};

class nixlRemoteMetaDesc : public nixlMetaDesc {
public:
    std::string remoteAgent;
};

// A list as NIXL builds it: a vtable (its virtual methods are NIXL's and
// are never called here), the memory type, the descriptors. Only read.
template <class T> class nixlDescList {
public:
    virtual ~nixlDescList();

    nixl_mem_t getType() const { return type; }
    int descCount() const { return static_cast<int>(descs.size()); }
    bool isEmpty() const { return descs.empty(); }
    const T &operator[](size_t index) const { return descs[index]; }

protected:
    nixl_mem_t type;
    std::vector<T> descs;
};

using nixl_meta_dlist_t = nixlDescList<nixlMetaDesc>;
using nixl_reg_dlist_t = nixlDescList<nixlBlobDesc>;
using nixl_remote_meta_dlist_t = nixlDescList<nixlRemoteMetaDesc>;

// ----------------------------------------------------------------- backend_aux.h

class nixlBackendMD {
public:
    explicit nixlBackendMD(bool isPrivate) : isPrivateMD(isPrivate) {}
    virtual ~nixlBackendMD() = default;

protected:
    bool isPrivateMD;
};

class nixlBackendReqH {
public:
    nixlBackendReqH() = default;
    virtual ~nixlBackendReqH() = default;
};

class nixlBackendOptionalArgs {
public:
    nixl_blob_t notifMsg;
    bool hasNotif = false;
    nixl_blob_t customParam;
};
using nixl_opt_b_args_t = nixlBackendOptionalArgs;

class nixlBackendInitParams {
public:
    std::string localAgent;
    nixl_backend_t type;
    nixl_b_params_t *customParams = nullptr;
    bool enableProgTh;
    nixlTime::us_t pthrDelay;
    nixl_thread_sync_t syncMode;
    bool enableTelemetry_;
};

// One backend telemetry record (a member of the engine's layout only).
struct nixlTelemetryEvent {
    uint32_t eventType_;
    uint64_t value_;
};

// -------------------------------------------------------------- backend_engine.h

class nixlBackendEngine {
public:
    explicit nixlBackendEngine(const nixlBackendInitParams *init)
        : backendType(init->type), customParams(*init->customParams), initErr(false),
          localAgent(init->localAgent), enableTelemetry_(init->enableTelemetry_) {}

    nixlBackendEngine(const nixlBackendEngine &) = delete;
    nixlBackendEngine &operator=(const nixlBackendEngine &) = delete;

    // Slots 0 and 1.
    virtual ~nixlBackendEngine() = default;

    bool getInitErr() const { return initErr; }
    const nixl_backend_t &getType() const { return backendType; }
    const nixl_b_params_t &getCustomParams() const { return customParams; }

    // Slots 2..14: what every engine defines.
    virtual bool supportsRemote() const = 0;
    virtual bool supportsLocal() const = 0;
    virtual bool supportsNotif() const = 0;
    virtual nixl_mem_list_t getSupportedMems() const = 0;
    virtual nixl_status_t registerMem(const nixlBlobDesc &mem, const nixl_mem_t &nixl_mem,
                                      nixlBackendMD *&out) = 0;
    virtual nixl_status_t deregisterMem(nixlBackendMD *meta) = 0;
    virtual nixl_status_t connect(const std::string &remote_agent) = 0;
    virtual nixl_status_t disconnect(const std::string &remote_agent) = 0;
    virtual nixl_status_t unloadMD(nixlBackendMD *input) = 0;
    virtual nixl_status_t prepXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                                   const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                                   nixlBackendReqH *&handle,
                                   const nixl_opt_b_args_t *opt_args = nullptr) const = 0;
    virtual nixl_status_t postXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                                   const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                                   nixlBackendReqH *&handle,
                                   const nixl_opt_b_args_t *opt_args = nullptr) const = 0;
    virtual nixl_status_t checkXfer(nixlBackendReqH *handle) const = 0;
    virtual nixl_status_t releaseReqH(nixlBackendReqH *handle) const = 0;

    // Slots 15..26: optional, with NIXL's defaults.
    virtual nixl_status_t prepMemView(const nixl_remote_meta_dlist_t &, nixlMemViewH &,
                                      const nixl_opt_b_args_t * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual nixl_status_t prepMemView(const nixl_meta_dlist_t &, nixlMemViewH &,
                                      const nixl_opt_b_args_t * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual void releaseMemView(nixlMemViewH) const {}
    virtual nixl_status_t getPublicData(const nixlBackendMD *, std::string &) const {
        return NIXL_ERR_BACKEND;
    }
    virtual nixl_status_t getConnInfo(std::string &) const { return NIXL_ERR_BACKEND; }
    virtual nixl_status_t loadRemoteConnInfo(const std::string &, const std::string &) {
        return NIXL_ERR_BACKEND;
    }
    virtual nixl_status_t loadRemoteMD(const nixlBlobDesc &, const nixl_mem_t &, const std::string &,
                                       nixlBackendMD *&) {
        return NIXL_ERR_BACKEND;
    }
    virtual nixl_status_t loadLocalMD(nixlBackendMD *, nixlBackendMD *&) { return NIXL_ERR_BACKEND; }
    virtual nixl_status_t getNotifs(notif_list_t &) { return NIXL_ERR_BACKEND; }
    virtual nixl_status_t genNotif(const std::string &, const std::string &) const {
        return NIXL_ERR_BACKEND;
    }
    virtual nixl_status_t queryMem(const nixl_reg_dlist_t &, std::vector<nixl_query_resp_t> &) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual nixl_status_t estimateXferCost(const nixl_xfer_op_t &, const nixl_meta_dlist_t &,
                                           const nixl_meta_dlist_t &, const std::string &,
                                           nixlBackendReqH *const &, std::chrono::microseconds &,
                                           std::chrono::microseconds &, nixl_cost_t &,
                                           const nixl_opt_args_t * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }

private:
    nixl_backend_t backendType;
    nixl_b_params_t customParams;
    std::vector<nixlTelemetryEvent> telemetryEvents_;
    std::mutex telemetryEventsMutex_;

protected:
    bool initErr;
    const std::string localAgent;
    const bool enableTelemetry_;
};

// -------------------------------------------------------------- backend_plugin.h

// What `nixl_plugin_init` returns.
#define NIXL_PLUGIN_API_VERSION 1

struct nixlBackendPlugin {
    int api_version;
    nixlBackendEngine *(*create_engine)(const nixlBackendInitParams *init_params);
    void (*destroy_engine)(nixlBackendEngine *engine);
    const char *(*get_plugin_name)();
    const char *(*get_plugin_version)();
    nixl_b_params_t (*get_backend_options)();
    nixl_mem_list_t (*get_backend_mems)();
};

#endif
