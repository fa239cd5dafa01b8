//! Raw binding to the Mooncake Store C ABI (store_c.h plus kvlink's extensions), loaded at run time.
