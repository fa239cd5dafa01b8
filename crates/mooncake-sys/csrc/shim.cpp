// libkvlink_mooncake.so: the C ABI of kvlink_mooncake.h over the Mooncake client (`RealClient`)
// that ships inside the PyPI wheel's `store.so`. Built by scripts/mooncake-build-shim.sh.
//
// Every exported function is `noexcept` in effect: its body runs inside `guarded(...)`, which
// catches every C++ exception and turns it into a negative code.

#include <dlfcn.h>

#include <cstddef>
#include <cstring>
#include <exception>
#include <limits>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include "kvlink_mooncake.h"
#include "mc_min.hpp"

#ifndef KVLINK_MC_WHEEL_VERSION
#error "build with -DKVLINK_MC_WHEEL_VERSION=\"x.y.z\" (scripts/mooncake-build-shim.sh does)"
#endif
#ifndef KVLINK_MC_PYTHON_SONAME
#define KVLINK_MC_PYTHON_SONAME "libpython3.11.so.1.0"
#endif

using mooncake::RealClient;
using mooncake::ReplicateConfig;

namespace {

// The opaque `mooncake_store_t`.
struct Handle {
    std::shared_ptr<RealClient> client;
};

// Thrown by argument checks; mapped to KVLINK_MC_ERR_NULL_ARG / _INVALID_ARG / _BAD_RESULT.
struct ShimError {
    int code;
    const char *what;
};

thread_local std::string t_last_error;

// Set while a client call that moves bytes runs (`transfer`): an exception that leaves it cut
// the call short, with transfers it may have submitted and never waited for.
thread_local bool t_in_transfer = false;

// Runs the client's call `f`, which moves bytes: an exception thrown out of it is reported as
// cutting the call short (KVLINK_MC_ERR_EXCEPTION / _OUT_OF_MEMORY), one before or after it as
// the shim's own (KVLINK_MC_ERR_SHIM_*).
template <class F>
auto transfer(F &&f) -> decltype(f()) {
    t_in_transfer = true;
    auto r = f();
    t_in_transfer = false;
    return r;
}

void remember(const char *msg) noexcept {
    try {
        t_last_error.assign(msg ? msg : "");
    } catch (...) {
        // Keeping the message is best effort; the code still tells what happened.
    }
}

// The failure value of a function returning R: the code itself, or NULL for pointers.
template <class R>
R failure(int code) noexcept {
    if constexpr (std::is_pointer_v<R>) {
        (void)code;
        return nullptr;
    } else {
        return static_cast<R>(code);
    }
}

// Runs `f`; every exception becomes a negative code (or NULL) and its message is remembered.
template <class R, class F>
R guarded(F &&f) noexcept {
    try {
        t_last_error.clear();
        t_in_transfer = false;
        return f();
    } catch (const ShimError &e) {
        remember(e.what);
        return failure<R>(e.code);
    } catch (const std::bad_alloc &e) {
        remember(e.what());
        return failure<R>(t_in_transfer ? KVLINK_MC_ERR_OUT_OF_MEMORY
                                        : KVLINK_MC_ERR_SHIM_OUT_OF_MEMORY);
    } catch (const std::exception &e) {
        remember(e.what());
        return failure<R>(t_in_transfer ? KVLINK_MC_ERR_EXCEPTION : KVLINK_MC_ERR_SHIM_EXCEPTION);
    } catch (...) {
        remember("unknown C++ exception");
        return failure<R>(t_in_transfer ? KVLINK_MC_ERR_EXCEPTION : KVLINK_MC_ERR_SHIM_EXCEPTION);
    }
}

void require(const void *p, const char *what) {
    if (p == nullptr) throw ShimError{KVLINK_MC_ERR_NULL_ARG, what};
}

RealClient &client_of(mooncake_store_t store) {
    require(store, "store handle is NULL");
    auto *h = static_cast<Handle *>(store);
    if (!h->client) throw ShimError{KVLINK_MC_ERR_NULL_ARG, "store handle has no client"};
    return *h->client;
}

std::string str(const char *s, const char *what) {
    require(s, what);
    return std::string(s);
}

std::vector<std::string> keys_of(const char **keys, size_t count) {
    std::vector<std::string> out;
    if (count == 0) return out;
    require(keys, "keys is NULL");
    out.reserve(count);
    for (size_t i = 0; i < count; ++i) out.push_back(str(keys[i], "a key is NULL"));
    return out;
}

ReplicateConfig config_of(const mooncake_replicate_config_t *c) {
    ReplicateConfig r;
    if (c == nullptr) return r;
    r.replica_num = c->replica_num;
    r.soft_pin_action = c->with_soft_pin ? mooncake::SoftPinAction::ENABLE
                                         : mooncake::SoftPinAction::PRESERVE;
    r.with_hard_pin = c->with_hard_pin != 0;
    if (c->preferred_segments_count > 0) {
        require(c->preferred_segments, "preferred_segments is NULL");
        for (size_t i = 0; i < c->preferred_segments_count; ++i)
            r.preferred_segments.push_back(
                str(c->preferred_segments[i], "a preferred segment is NULL"));
    }
    return r;
}

template <class Dst, class Src>
void copy_results(const std::vector<Src> &got, size_t count, Dst *out) {
    if (got.size() != count)
        throw ShimError{KVLINK_MC_ERR_BAD_RESULT, "client returned a result vector of the wrong length"};
    for (size_t i = 0; i < count; ++i) out[i] = static_cast<Dst>(got[i]);
}

const char *shim_code_name(int32_t code) noexcept {
    switch (code) {
        case KVLINK_MC_ERR_NULL_ARG: return "KVLINK_MC_ERR_NULL_ARG";
        case KVLINK_MC_ERR_EXCEPTION: return "KVLINK_MC_ERR_EXCEPTION";
        case KVLINK_MC_ERR_OUT_OF_MEMORY: return "KVLINK_MC_ERR_OUT_OF_MEMORY";
        case KVLINK_MC_ERR_INVALID_ARG: return "KVLINK_MC_ERR_INVALID_ARG";
        case KVLINK_MC_ERR_BAD_RESULT: return "KVLINK_MC_ERR_BAD_RESULT";
        case KVLINK_MC_ERR_SHIM_EXCEPTION: return "KVLINK_MC_ERR_SHIM_EXCEPTION";
        case KVLINK_MC_ERR_SHIM_OUT_OF_MEMORY: return "KVLINK_MC_ERR_SHIM_OUT_OF_MEMORY";
        default: return nullptr;
    }
}

// store.so's ResourceTracker asks dlsym(RTLD_DEFAULT, "Py_IsInitialized") whether it runs
// inside Python; when it does not find it, it may install its own SIGINT/SIGTERM/SIGHUP thread,
// taking signals away from the host process (brief §7). libpython is a NEEDED dependency of
// this shim but, when the shim is dlopen'ed RTLD_LOCAL (libloading's default), not globally
// visible: promote it to the global scope as soon as the shim is loaded (RTLD_NOLOAD: loads
// nothing new). Measured with 0.3.13.post1: the client path used here installed no SIGINT/
// SIGTERM handler with or without this; it is kept as a guard.
__attribute__((constructor)) void promote_libpython() {
    (void)dlopen(KVLINK_MC_PYTHON_SONAME, RTLD_NOW | RTLD_NOLOAD | RTLD_GLOBAL);
}

}  // namespace

extern "C" {

// Referenced so that libpython stays NEEDED even when linked with --as-needed.
int Py_IsInitialized(void);

// ------------------------------------------------------------------------ part 1: store_c.h

mooncake_store_t mooncake_store_create(void) {
    return guarded<mooncake_store_t>([]() -> mooncake_store_t {
        (void)Py_IsInitialized();
        auto client = RealClient::create();
        if (!client) throw ShimError{KVLINK_MC_ERR_EXCEPTION, "RealClient::create returned null"};
        return new Handle{std::move(client)};
    });
}

void mooncake_store_destroy(mooncake_store_t store) {
    if (store == nullptr) return;
    auto *h = static_cast<Handle *>(store);
    (void)guarded<int>([h]() -> int {
        if (h->client) h->client->tearDownAll();
        return 0;
    });
    // Destructors are noexcept: one that throws ends the process (std::terminate) rather
    // than reach this guard. Nothing unwinds into Rust either way.
    (void)guarded<int>([h]() -> int {
        delete h;
        return 0;
    });
}

int mooncake_store_setup(mooncake_store_t store, const char *local_hostname,
                         const char *metadata_server, uint64_t global_segment_size,
                         uint64_t local_buffer_size, const char *protocol,
                         const char *device_name, const char *master_server_addr) {
    return kvlink_mc_setup(store, local_hostname, metadata_server, global_segment_size,
                           local_buffer_size, protocol, device_name, master_server_addr,
                           "default");
}

int mooncake_store_health_check(mooncake_store_t store) {
    return guarded<int>([&]() -> int { return client_of(store).health_check(); });
}

int mooncake_store_put(mooncake_store_t store, const char *key, const void *value, size_t size,
                       const mooncake_replicate_config_t *cfg) {
    return guarded<int>([&]() -> int {
        RealClient &c = client_of(store);
        const std::string k = str(key, "key is NULL");
        if (size > 0) require(value, "value is NULL");
        const ReplicateConfig rc = config_of(cfg);
        return transfer([&] {
            return c.put(k, std::span<const char>(static_cast<const char *>(value), size), rc);
        });
    });
}

int mooncake_store_put_from(mooncake_store_t store, const char *key, void *buffer, size_t size,
                            const mooncake_replicate_config_t *cfg) {
    return guarded<int>([&]() -> int {
        RealClient &c = client_of(store);
        const std::string k = str(key, "key is NULL");
        require(buffer, "buffer is NULL");
        const ReplicateConfig rc = config_of(cfg);
        return transfer([&] { return c.put_from(k, buffer, size, rc); });
    });
}

int mooncake_store_batch_put_from(mooncake_store_t store, const char **keys, void **buffers,
                                  const size_t *sizes, size_t count,
                                  const mooncake_replicate_config_t *cfg, int *results_out) {
    return guarded<int>([&]() -> int {
        RealClient &c = client_of(store);
        if (count == 0) return 0;
        require(buffers, "buffers is NULL");
        require(sizes, "sizes is NULL");
        require(results_out, "results_out is NULL");
        const auto k = keys_of(keys, count);
        std::vector<void *> b(buffers, buffers + count);
        for (void *p : b) require(p, "a buffer is NULL");
        const std::vector<size_t> s(sizes, sizes + count);
        const ReplicateConfig rc = config_of(cfg);
        copy_results(transfer([&] { return c.batch_put_from(k, b, s, rc); }), count, results_out);
        return 0;
    });
}

int64_t mooncake_store_get_into(mooncake_store_t store, const char *key, void *buffer,
                                size_t size) {
    return guarded<int64_t>([&]() -> int64_t {
        RealClient &c = client_of(store);
        const std::string k = str(key, "key is NULL");
        require(buffer, "buffer is NULL");
        return transfer([&] { return c.get_into(k, buffer, size); });
    });
}

int mooncake_store_batch_get_into(mooncake_store_t store, const char **keys, void **buffers,
                                  const size_t *sizes, size_t count, int64_t *results_out) {
    return guarded<int>([&]() -> int {
        RealClient &c = client_of(store);
        if (count == 0) return 0;
        require(buffers, "buffers is NULL");
        require(sizes, "sizes is NULL");
        require(results_out, "results_out is NULL");
        const auto k = keys_of(keys, count);
        std::vector<void *> b(buffers, buffers + count);
        for (void *p : b) require(p, "a buffer is NULL");
        const std::vector<size_t> s(sizes, sizes + count);
        copy_results(transfer([&] { return c.batch_get_into(k, b, s); }), count, results_out);
        return 0;
    });
}

int mooncake_store_is_exist(mooncake_store_t store, const char *key) {
    return guarded<int>([&]() -> int {
        RealClient &c = client_of(store);
        return c.isExist(str(key, "key is NULL"));
    });
}

int mooncake_store_batch_is_exist(mooncake_store_t store, const char **keys, size_t count,
                                  int *results_out) {
    return guarded<int>([&]() -> int {
        RealClient &c = client_of(store);
        if (count == 0) return 0;
        require(results_out, "results_out is NULL");
        copy_results(c.batchIsExist(keys_of(keys, count)), count, results_out);
        return 0;
    });
}

int64_t mooncake_store_get_size(mooncake_store_t store, const char *key) {
    return guarded<int64_t>([&]() -> int64_t {
        RealClient &c = client_of(store);
        return c.getSize(str(key, "key is NULL"));
    });
}

int mooncake_store_get_hostname(mooncake_store_t store, char *buf_out, size_t buf_len) {
    return guarded<int>([&]() -> int {
        RealClient &c = client_of(store);
        require(buf_out, "buf_out is NULL");
        const std::string h = c.get_hostname();
        if (h.size() + 1 > buf_len)
            throw ShimError{KVLINK_MC_ERR_INVALID_ARG, "hostname buffer too small"};
        std::memcpy(buf_out, h.c_str(), h.size() + 1);
        return 0;
    });
}

int mooncake_store_remove(mooncake_store_t store, const char *key, int force) {
    return guarded<int>([&]() -> int {
        RealClient &c = client_of(store);
        return c.remove(str(key, "key is NULL"), force != 0);
    });
}

int64_t mooncake_store_remove_by_regex(mooncake_store_t store, const char *pattern, int force) {
    return guarded<int64_t>([&]() -> int64_t {
        RealClient &c = client_of(store);
        return c.removeByRegex(str(pattern, "pattern is NULL"), force != 0);
    });
}

int64_t mooncake_store_remove_all(mooncake_store_t store, int force) {
    return guarded<int64_t>([&]() -> int64_t { return client_of(store).removeAll(force != 0); });
}

int mooncake_store_register_buffer(mooncake_store_t store, void *buffer, size_t size) {
    return guarded<int>([&]() -> int {
        RealClient &c = client_of(store);
        require(buffer, "buffer is NULL");
        return c.register_buffer(buffer, size);
    });
}

int mooncake_store_unregister_buffer(mooncake_store_t store, void *buffer) {
    return guarded<int>([&]() -> int {
        RealClient &c = client_of(store);
        require(buffer, "buffer is NULL");
        return c.unregister_buffer(buffer);
    });
}

// ------------------------------------------------------------------------ part 2: kvlink_mc_*

int kvlink_mc_abi_info(kvlink_mc_abi_info_t *out) {
    return guarded<int>([&]() -> int {
        require(out, "out is NULL");
        kvlink_mc_abi_info_t info{};
        info.abi_version = KVLINK_MC_ABI_VERSION;
        info.info_size = sizeof(kvlink_mc_abi_info_t);
        info.replicate_config_size = sizeof(ReplicateConfig);
        info.off_soft_pin_action = offsetof(ReplicateConfig, soft_pin_action);
        info.off_soft_pin_ttl_ms = offsetof(ReplicateConfig, soft_pin_ttl_ms);
        info.off_with_hard_pin = offsetof(ReplicateConfig, with_hard_pin);
        info.off_preferred_segments = offsetof(ReplicateConfig, preferred_segments);
        info.off_preferred_segment = offsetof(ReplicateConfig, preferred_segment);
        info.off_host_id = offsetof(ReplicateConfig, host_id);
        info.off_group_ids = offsetof(ReplicateConfig, group_ids);
        static_assert(sizeof(KVLINK_MC_WHEEL_VERSION) <= sizeof(info.wheel_version),
                      "wheel version string too long");
        std::memcpy(info.wheel_version, KVLINK_MC_WHEEL_VERSION, sizeof(KVLINK_MC_WHEEL_VERSION));
        *out = info;
        return 0;
    });
}

const char *kvlink_mc_error_name(int32_t code) {
    if (const char *name = shim_code_name(code)) return name;
    // `toString` is noexcept and returns a reference to a string with static storage (unknown
    // values give the wheel's "UNKNOWN..." string).
    return mooncake::toString(static_cast<mooncake::ErrorCode>(code)).c_str();
}

size_t kvlink_mc_last_error(char *buf, size_t buf_len) {
    const size_t n = t_last_error.size();
    if (buf != nullptr && buf_len > 0) {
        const size_t m = n < buf_len - 1 ? n : buf_len - 1;
        std::memcpy(buf, t_last_error.data(), m);
        buf[m] = '\0';
    }
    return n;
}

int kvlink_mc_batch_get_ranges(mooncake_store_t store, const char **keys, size_t count,
                               const size_t *range_counts, const kvlink_mc_range_t *ranges,
                               size_t range_total, int64_t *results_out) {
    return guarded<int>([&]() -> int {
        RealClient &c = client_of(store);
        if (count == 0) return 0;
        require(range_counts, "range_counts is NULL");
        require(results_out, "results_out is NULL");
        if (range_total > 0) require(ranges, "ranges is NULL");
        const auto k = keys_of(keys, count);
        std::vector<std::vector<void *>> dst(count);
        std::vector<std::vector<size_t>> sizes(count), offsets(count);
        size_t next = 0;
        for (size_t i = 0; i < count; ++i) {
            const size_t n = range_counts[i];
            if (n > range_total - next)
                throw ShimError{KVLINK_MC_ERR_INVALID_ARG, "range_counts exceed range_total"};
            dst[i].reserve(n);
            sizes[i].reserve(n);
            offsets[i].reserve(n);
            uint64_t total = 0;
            for (size_t j = 0; j < n; ++j) {
                const kvlink_mc_range_t &r = ranges[next + j];
                require(r.dst, "a range destination is NULL");
                if (r.size > static_cast<uint64_t>(std::numeric_limits<int>::max()) - total)
                    throw ShimError{KVLINK_MC_ERR_INVALID_ARG,
                                    "a key's ranges add up to more than INT_MAX bytes"};
                total += r.size;
                dst[i].push_back(r.dst);
                sizes[i].push_back(static_cast<size_t>(r.size));
                offsets[i].push_back(static_cast<size_t>(r.offset));
            }
            next += n;
        }
        if (next != range_total)
            throw ShimError{KVLINK_MC_ERR_INVALID_ARG, "range_counts do not add up to range_total"};
        copy_results(transfer([&] {
                         return c.batch_get_into_multi_buffer_ranges(k, dst, sizes, offsets);
                     }),
                     count, results_out);
        return 0;
    });
}

int kvlink_mc_batch_get_session_start(mooncake_store_t store, const char **keys, size_t count,
                                      int *results_out) {
    return guarded<int>([&]() -> int {
        RealClient &c = client_of(store);
        if (count == 0) return 0;
        require(results_out, "results_out is NULL");
        copy_results(c.batch_get_session_start(keys_of(keys, count)), count, results_out);
        return 0;
    });
}

int kvlink_mc_batch_get_session_end(mooncake_store_t store, const char **keys, size_t count) {
    return guarded<int>([&]() -> int {
        RealClient &c = client_of(store);
        if (count == 0) return 0;
        return c.batch_get_session_end(keys_of(keys, count));
    });
}

int kvlink_mc_setup(mooncake_store_t store, const char *local_hostname,
                    const char *metadata_server, uint64_t global_segment_size,
                    uint64_t local_buffer_size, const char *protocol, const char *device_name,
                    const char *master_server_addr, const char *tenant_id) {
    return guarded<int>([&]() -> int {
        RealClient &c = client_of(store);
        const std::string host = str(local_hostname, "local_hostname is NULL");
        const std::string meta = str(metadata_server, "metadata_server is NULL");
        const std::string proto = str(protocol, "protocol is NULL");
        const std::string dev = device_name ? std::string(device_name) : std::string();
        const std::string master = str(master_server_addr, "master_server_addr is NULL");
        const std::string tenant = str(tenant_id, "tenant_id is NULL");
        const std::shared_ptr<mooncake::TransferEngine> no_engine;
        return c.setup_real(host, meta, global_segment_size, local_buffer_size, proto, dev, master,
                            no_engine, /*ipc_socket_path=*/"", /*enable_ssd_offload=*/false,
                            /*ssd_offload_path=*/"", tenant,
                            /*enable_client_http_server=*/false, /*client_http_port=*/9300);
    });
}

int kvlink_mc_batch_upsert_from(mooncake_store_t store, const char **keys, void **buffers,
                                const size_t *sizes, size_t count,
                                const mooncake_replicate_config_t *cfg, int *results_out) {
    return guarded<int>([&]() -> int {
        RealClient &c = client_of(store);
        if (count == 0) return 0;
        require(buffers, "buffers is NULL");
        require(sizes, "sizes is NULL");
        require(results_out, "results_out is NULL");
        const auto k = keys_of(keys, count);
        std::vector<void *> b(buffers, buffers + count);
        for (void *p : b) require(p, "a buffer is NULL");
        const std::vector<size_t> s(sizes, sizes + count);
        const ReplicateConfig rc = config_of(cfg);
        copy_results(transfer([&] { return c.batch_upsert_from(k, b, s, rc); }), count,
                     results_out);
        return 0;
    });
}

}  // extern "C"
