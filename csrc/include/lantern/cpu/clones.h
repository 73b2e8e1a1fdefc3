// LANTERN_CPU_CLONES: compile a hot loop for AVX-512, AVX2 and baseline x86-64, picked at load time (GCC /
// clang target_clones). Only the vector width changes: every element sees the same IEEE operations, and
// the build passes -ffp-contract=off, so no fused multiply-add changes a rounding. Off under
// AddressSanitizer and with LANTERN_NO_TARGET_CLONES.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(LANTERN_NO_TARGET_CLONES) && \
    !defined(__SANITIZE_ADDRESS__)
#define LANTERN_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LANTERN_CPU_CLONES
#endif
