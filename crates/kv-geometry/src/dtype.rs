//! Element types of KV rows.

/// The element type a KV component is stored in.
///
/// Non-exhaustive: more formats (other FP8 encodings) may come; a match needs a `_` arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ElementType {
    /// bfloat16, 2 bytes.
    Bf16,
    /// IEEE half, 2 bytes.
    F16,
    /// FP8 E4M3, 1 byte.
    Fp8E4m3,
    /// IEEE single, 4 bytes (latents kept in full precision).
    F32,
    /// Opaque bytes (packed formats such as DSA FP8 rows with inline scales).
    Bytes,
}

impl ElementType {
    /// Bytes per element.
    pub const fn size(self) -> u32 {
        match self {
            ElementType::Bf16 | ElementType::F16 => 2,
            ElementType::Fp8E4m3 | ElementType::Bytes => 1,
            ElementType::F32 => 4,
        }
    }

    /// A short lower-case name (`bf16`, `f16`, `fp8e4m3`, `f32`, `bytes`), as namespaces carry it.
    pub const fn name(self) -> &'static str {
        match self {
            ElementType::Bf16 => "bf16",
            ElementType::F16 => "f16",
            ElementType::Fp8E4m3 => "fp8e4m3",
            ElementType::F32 => "f32",
            ElementType::Bytes => "bytes",
        }
    }

    /// Parses the names engines use for a KV cache dtype (`bf16`, `bfloat16`, `fp16`, `f16`,
    /// `float16`, `fp8`, `fp8_e4m3`, `f32`, `fp32`, `float32`), and every [`name`](Self::name) back.
    ///
    /// ```
    /// use kv_geometry::ElementType;
    /// assert_eq!(ElementType::parse("bfloat16"), Some(ElementType::Bf16));
    /// assert_eq!(ElementType::parse(ElementType::Fp8E4m3.name()), Some(ElementType::Fp8E4m3));
    /// ```
    pub fn parse(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Some(ElementType::Bf16),
            "f16" | "fp16" | "float16" | "half" => Some(ElementType::F16),
            "fp8" | "fp8e4m3" | "fp8_e4m3" | "float8_e4m3fn" | "e4m3" => Some(ElementType::Fp8E4m3),
            "f32" | "fp32" | "float32" | "float" => Some(ElementType::F32),
            "bytes" => Some(ElementType::Bytes),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ElementType;

    /// Before, `fp8e4m3` and `bytes` (the names namespaces carry) did not parse back.
    #[test]
    fn every_name_parses_back() {
        for e in [
            ElementType::Bf16,
            ElementType::F16,
            ElementType::Fp8E4m3,
            ElementType::F32,
            ElementType::Bytes,
        ] {
            assert_eq!(ElementType::parse(e.name()), Some(e), "{}", e.name());
        }
    }
}
