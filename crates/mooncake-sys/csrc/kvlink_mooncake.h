/*
 * C ABI of libkvlink_mooncake.so, the kvlink shim over the Mooncake client inside the PyPI wheel
 * `mooncake-transfer-engine-non-cuda==0.3.13.post1`.
 *
 * Part 1 re-exposes upstream's `mooncake-store/include/store_c.h` (same names, same signatures),
 * so that a future upstream `libmooncake_store.so` can replace the shim for those functions.
 * Part 2 adds what layer-wise loading needs and store_c.h lacks, prefixed `kvlink_mc_`.
 *
 * Conventions (every function):
 *  - never lets a C++ exception escape: it is caught and reported as a negative code, and its
 *    message is kept per thread for `kvlink_mc_last_error`;
 *  - rejects NULL where a pointer is required (KVLINK_MC_ERR_NULL_ARG), including NULL entries of
 *    key arrays;
 *  - returns Mooncake's own negative `ErrorCode` values unchanged (e.g. -704 OBJECT_NOT_FOUND);
 *    the shim's own codes lie in -90000..-90099, which Mooncake does not use.
 *  - batch functions return 0 (or a shim code for the whole call) and write one result per key to
 *    `results_out` (which must have `count` entries).
 */
#ifndef KVLINK_MOONCAKE_H
#define KVLINK_MOONCAKE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- part 1: store_c.h */

typedef void *mooncake_store_t;

typedef struct mooncake_replicate_config {
    size_t replica_num;
    int with_soft_pin;
    int with_hard_pin;
    const char **preferred_segments;
    size_t preferred_segments_count;
} mooncake_replicate_config_t;

mooncake_store_t mooncake_store_create(void);
void mooncake_store_destroy(mooncake_store_t store);
int mooncake_store_setup(mooncake_store_t store, const char *local_hostname,
                         const char *metadata_server, uint64_t global_segment_size,
                         uint64_t local_buffer_size, const char *protocol,
                         const char *device_name, const char *master_server_addr);
int mooncake_store_health_check(mooncake_store_t store);
int mooncake_store_put(mooncake_store_t store, const char *key, const void *value, size_t size,
                       const mooncake_replicate_config_t *cfg);
int mooncake_store_put_from(mooncake_store_t store, const char *key, void *buffer, size_t size,
                            const mooncake_replicate_config_t *cfg);
int mooncake_store_batch_put_from(mooncake_store_t store, const char **keys, void **buffers,
                                  const size_t *sizes, size_t count,
                                  const mooncake_replicate_config_t *cfg, int *results_out);
int64_t mooncake_store_get_into(mooncake_store_t store, const char *key, void *buffer,
                                size_t size);
int mooncake_store_batch_get_into(mooncake_store_t store, const char **keys, void **buffers,
                                  const size_t *sizes, size_t count, int64_t *results_out);
int mooncake_store_is_exist(mooncake_store_t store, const char *key);
int mooncake_store_batch_is_exist(mooncake_store_t store, const char **keys, size_t count,
                                  int *results_out);
int64_t mooncake_store_get_size(mooncake_store_t store, const char *key);
int mooncake_store_get_hostname(mooncake_store_t store, char *buf_out, size_t buf_len);
int mooncake_store_remove(mooncake_store_t store, const char *key, int force);
int64_t mooncake_store_remove_by_regex(mooncake_store_t store, const char *pattern, int force);
int64_t mooncake_store_remove_all(mooncake_store_t store, int force);
int mooncake_store_register_buffer(mooncake_store_t store, void *buffer, size_t size);
int mooncake_store_unregister_buffer(mooncake_store_t store, void *buffer);

/* ---------------------------------------------------------------- part 2: kvlink extensions */

/* Bumped whenever a kvlink_mc_* signature or struct changes. */
#define KVLINK_MC_ABI_VERSION 2

/* The shim's own error codes (Mooncake's ErrorCode never uses this range). */
#define KVLINK_MC_ERR_NULL_ARG (-90001)      /* a required pointer (or key) was NULL */
/* A C++ exception (or std::bad_alloc) thrown inside a client call that moves bytes: the call was
   cut short and its transfers may still run. See kvlink_mc_last_error. */
#define KVLINK_MC_ERR_EXCEPTION (-90002)
#define KVLINK_MC_ERR_OUT_OF_MEMORY (-90003)
#define KVLINK_MC_ERR_INVALID_ARG (-90004)   /* counts overflow, buffer too small, ... */
#define KVLINK_MC_ERR_BAD_RESULT (-90005)    /* the client returned a result vector of the wrong length */
/* A C++ exception (or std::bad_alloc) in the shim's own work before or after the client's call
   (copying keys and arguments, results), or in a client call that moves no bytes: no transfer
   of the call runs. See kvlink_mc_last_error. */
#define KVLINK_MC_ERR_SHIM_EXCEPTION (-90006)
#define KVLINK_MC_ERR_SHIM_OUT_OF_MEMORY (-90007)

typedef struct kvlink_mc_abi_info {
    uint32_t abi_version;           /* KVLINK_MC_ABI_VERSION the shim was built with */
    uint32_t info_size;             /* sizeof(kvlink_mc_abi_info_t) */
    uint64_t replicate_config_size; /* sizeof(mooncake::ReplicateConfig) as compiled into the shim */
    uint64_t off_soft_pin_action;
    uint64_t off_soft_pin_ttl_ms;
    uint64_t off_with_hard_pin;
    uint64_t off_preferred_segments;
    uint64_t off_preferred_segment;
    uint64_t off_host_id;
    uint64_t off_group_ids;
    char wheel_version[32]; /* NUL-terminated, e.g. "0.3.13.post1" */
} kvlink_mc_abi_info_t;

/* Fills *out; returns 0, or KVLINK_MC_ERR_NULL_ARG. */
int kvlink_mc_abi_info(kvlink_mc_abi_info_t *out);

/* Name of a Mooncake ErrorCode as the wheel's own `mooncake::toString` spells it (e.g.
 * "OBJECT_NOT_FOUND"), or a kvlink shim code name. Never NULL; static storage. */
const char *kvlink_mc_error_name(int32_t code);

/* Copies the message of the last exception caught on the calling thread (NUL-terminated,
 * truncated to buf_len) and returns its full length; 0 when there was none. buf may be NULL when
 * buf_len is 0. */
size_t kvlink_mc_last_error(char *buf, size_t buf_len);

/* One byte range of an object read into caller memory: object[offset .. offset+size) -> dst. */
typedef struct kvlink_mc_range {
    void *dst;
    uint64_t size;
    uint64_t offset;
} kvlink_mc_range_t;

/* Ranged multi-buffer batched read (`RealClient::batch_get_into_multi_buffer_ranges`).
 * Key i owns `range_counts[i]` consecutive entries of `ranges` (in key order; the total is the sum
 * of range_counts). results_out[i] = bytes read for key i (the sum of its range sizes) or a
 * negative ErrorCode. The keys must be inside a read session (kvlink_mc_batch_get_session_start). */
int kvlink_mc_batch_get_ranges(mooncake_store_t store, const char **keys, size_t count,
                               const size_t *range_counts, const kvlink_mc_range_t *ranges,
                               size_t range_total, int64_t *results_out);

/* Starts a read session: resolves replicas once, caches them and takes a read lease per key
 * (pinning the objects against eviction/removal while the lease lives). results_out[i] = 0 or a
 * negative ErrorCode. */
int kvlink_mc_batch_get_session_start(mooncake_store_t store, const char **keys, size_t count,
                                      int *results_out);

/* Ends a read session for these keys (drops the cached replicas). Returns 0 or a negative code. */
int kvlink_mc_batch_get_session_end(mooncake_store_t store, const char **keys, size_t count);

/* Batched upsert (overwrites; plain put is first-write-wins). results_out[i] = 0 or negative. */
int kvlink_mc_batch_upsert_from(mooncake_store_t store, const char **keys, void **buffers,
                                const size_t *sizes, size_t count,
                                const mooncake_replicate_config_t *cfg, int *results_out);

/* mooncake_store_setup in Mooncake tenant `tenant_id` (the wheel's MOONCAKE_TENANT_ID; "default"
 * is what mooncake_store_setup uses): objects are put and found within the tenant's key space.
 * Returns 0, or non-zero on failure. (ABI 2.) */
int kvlink_mc_setup(mooncake_store_t store, const char *local_hostname,
                    const char *metadata_server, uint64_t global_segment_size,
                    uint64_t local_buffer_size, const char *protocol, const char *device_name,
                    const char *master_server_addr, const char *tenant_id);

#ifdef __cplusplus
}
#endif

#endif /* KVLINK_MOONCAKE_H */
