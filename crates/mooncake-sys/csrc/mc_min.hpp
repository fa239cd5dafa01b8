// Hand-written declarations of the parts of Mooncake's C++ client that the kvlink shim calls.
//
// They must match the PyPI wheel `mooncake-transfer-engine-non-cuda==0.3.13.post1` (cp311) exactly:
//  - parameter types are checked at link time, through the mangled names exported by the wheel's
//    `store.so`;
//  - return types and the layout of `ReplicateConfig` are NOT checked by the linker. They were
//    read from the wheel's Python docstrings and from upstream headers of the same period.
//    `kvlink_mc_abi_info` reports the layout of THIS declaration (so it catches another
//    compiler or standard library, not a wheel whose struct differs); against the wheel only
//    the mooncake-sys smoke test checks it, and only in part (a soft-pin round trip through the
//    master). Bump the wheel => re-check every line of this file.
//
// Nothing here is copied from Mooncake; it only re-declares names the wheel exports.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace mooncake {

class TransferEngine;

// `mooncake::ErrorCode` is `enum class ErrorCode : int32_t`; only its integer values cross the
// shim, and `toString` is used for names.
enum class ErrorCode : int32_t {};
const std::string &toString(ErrorCode code) noexcept;

enum class SoftPinAction : uint8_t { PRESERVE = 0, ENABLE = 1, DISABLE = 2 };
enum class ObjectDataType : uint8_t { UNKNOWN = 0 };

// Field order of `mooncake-store/include/replica.h` for the pinned wheel.
// Expected on x86_64/libstdc++: sizeof 208, soft_pin_action@24, soft_pin_ttl_ms@32,
// with_hard_pin@48, preferred_segments@56, preferred_segment@80, host_id@144, group_ids@176.
struct ReplicateConfig {
    size_t replica_num{1};
    size_t nof_replica_num{0};
    size_t dfs_replica_num{0};
    SoftPinAction soft_pin_action{SoftPinAction::PRESERVE};
    std::optional<uint64_t> soft_pin_ttl_ms{};
    bool with_hard_pin{false};
    std::vector<std::string> preferred_segments{};
    std::string preferred_segment{};
    std::vector<std::string> preferred_nof_segments{};
    bool prefer_alloc_in_same_node{false};
    ObjectDataType data_type{ObjectDataType::UNKNOWN};
    std::string host_id{};
    std::optional<std::vector<std::string>> group_ids{};
};

// Opaque: only ever used through the `shared_ptr` that `create()` returns, and only non-virtual
// calls to exported member symbols are made (no vtable, no field access).
class RealClient {
   public:
    RealClient() = delete;
    static std::shared_ptr<RealClient> create();

    int setup_real(const std::string &local_hostname, const std::string &metadata_server,
                   size_t global_segment_size, size_t local_buffer_size,
                   const std::string &protocol, const std::string &rdma_devices,
                   const std::string &master_server_addr,
                   const std::shared_ptr<TransferEngine> &transfer_engine,
                   const std::string &ipc_socket_path, bool enable_ssd_offload,
                   const std::string &ssd_offload_path, const std::string &tenant_id,
                   bool enable_client_http_server, int client_http_port);
    int tearDownAll();
    int health_check();

    int put(const std::string &key, std::span<const char> value, const ReplicateConfig &config);
    int put_from(const std::string &key, void *buffer, size_t size, const ReplicateConfig &config);
    std::vector<int> batch_put_from(const std::vector<std::string> &keys,
                                    const std::vector<void *> &buffers,
                                    const std::vector<size_t> &sizes,
                                    const ReplicateConfig &config);
    std::vector<int> batch_upsert_from(const std::vector<std::string> &keys,
                                       const std::vector<void *> &buffers,
                                       const std::vector<size_t> &sizes,
                                       const ReplicateConfig &config);

    int64_t get_into(const std::string &key, void *buffer, size_t size);
    std::vector<int64_t> batch_get_into(const std::vector<std::string> &keys,
                                        const std::vector<void *> &buffers,
                                        const std::vector<size_t> &sizes);
    std::vector<int> batch_get_into_multi_buffer_ranges(
        const std::vector<std::string> &keys, const std::vector<std::vector<void *>> &buffers,
        const std::vector<std::vector<size_t>> &sizes,
        const std::vector<std::vector<size_t>> &src_offsets);
    std::vector<int> batch_get_session_start(const std::vector<std::string> &keys);
    int batch_get_session_end(const std::vector<std::string> &keys);

    int isExist(const std::string &key);
    std::vector<int> batchIsExist(const std::vector<std::string> &keys);
    int64_t getSize(const std::string &key);
    std::string get_hostname() const;

    int remove(const std::string &key, bool force);
    long removeByRegex(const std::string &pattern, bool force);
    long removeAll(bool force);

    int register_buffer(void *buffer, size_t size);
    int unregister_buffer(void *buffer);
};

}  // namespace mooncake
