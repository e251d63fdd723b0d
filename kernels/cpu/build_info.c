/* What this build of the kernels was compiled to use, from the compiler's own macros: the loader
 * checks it against the CPU before any kernel runs, and logs and tests name the paths it selects.
 * The names are the macros without underscores (see kernels/capabilities.py MACRO_FLAGS). */


const char *baton_kernel_isa(void) {
    return ""
#if defined(__AVX__)
        "AVX "
#endif
#if defined(__AVX2__)
        "AVX2 "
#endif
#if defined(__FMA__)
        "FMA "
#endif
#if defined(__F16C__)
        "F16C "
#endif
#if defined(__AVX512F__)
        "AVX512F "
#endif
#if defined(__AVX512BW__)
        "AVX512BW "
#endif
#if defined(__AVX512DQ__)
        "AVX512DQ "
#endif
#if defined(__AVX512VL__)
        "AVX512VL "
#endif
#if defined(__AVX512BF16__)
        "AVX512BF16 "
#endif
#if defined(__AVX512VNNI__)
        "AVX512VNNI "
#endif
#if defined(__AVXVNNI__)
        "AVXVNNI "
#endif
#if defined(__AMX_BF16__)
        "AMX_BF16 "
#endif
#if defined(__ARM_NEON)
        "ARM_NEON "
#endif
#if defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
        "ARM_FEATURE_BF16_VECTOR_ARITHMETIC "
#endif
#if defined(__ARM_FEATURE_DOTPROD)
        "ARM_FEATURE_DOTPROD "
#endif
        ;
}
