/*
 * memscope_usdt.h: our own USDT (statically defined tracepoint) macros, written from the public
 * SystemTap SDT note format rather than taken from <sys/sdt.h> or libbpf's usdt.h, so the
 * package has no build dependency and we control the exact layout the tracer parses.
 *
 * What one probe site produces:
 *
 *  - in .text: a numeric local label on a no-op instruction. x86-64 gets the 5-byte
 *    `nopl 0x0(%rax,%rax,1)` (0f 1f 44 00 00): a uprobe on a 5-byte nop is ~20 % cheaper than
 *    on a 1-byte nop, and newer kernels can turn such a site into a direct call. aarch64 gets
 *    its only nop, 4 bytes.
 *  - in the non-allocated note section `.note.stapsdt` ("?", "note"): an ELF note of type 3,
 *    owner "stapsdt", whose descriptor is three 8-byte addresses (the site, the link-time
 *    address of `_.stapsdt.base`, the semaphore or 0) followed by provider\0 name\0 args\0.
 *    The section is not loaded, so its absolute relocations are resolved by the static linker
 *    to link-time addresses; a tool compares the recorded `_.stapsdt.base` with where that
 *    symbol really is to undo any later relocation (prelink), exactly as with sys/sdt.h.
 *  - once per object: the allocated read-only section `.stapsdt.base` holding the one-byte,
 *    weak, hidden symbol `_.stapsdt.base` (comdat, so several translation units share one).
 *
 * Arguments are described as `size@operand`, separated by spaces; the operand text is whatever
 * the compiler prints for an asm operand with constraint "nor" (immediate, offsettable memory
 * or register): `%rdi`, `8(%rsp)`, `$5` on x86-64; `x1`, `[sp, 16]`, `5` on aarch64. Every
 * argument is cast to a 64-bit integer first so the size is always 8 (-8 when signed) and the
 * tracer never has to deal with sub-registers.
 *
 * Usage: MEMSCOPE_USDT2(provider, name, semaphore_symbol, S64, level, PTR, label);
 * type tokens: S64 (int64_t, "-8"), U64 (uint64_t, "8"), PTR (pointer as uint64_t, "8").
 * The semaphore is an `unsigned short` the caller defines (see MEMSCOPE_USDT_SEMAPHORE); pass
 * 0 for none.
 *
 * On targets other than x86-64/aarch64 ELF the macros expand to nothing and
 * MEMSCOPE_USDT_SUPPORTED is 0, so code using them still builds (the probes just do not exist).
 */
#ifndef MEMSCOPE_USDT_H
#define MEMSCOPE_USDT_H

#include <stdint.h>

#if defined(__ELF__) && (defined(__x86_64__) || defined(__aarch64__)) && \
    (defined(__GNUC__) || defined(__clang__)) && !defined(MEMSCOPE_USDT_DISABLE)
#define MEMSCOPE_USDT_SUPPORTED 1
#else
#define MEMSCOPE_USDT_SUPPORTED 0
#endif

/* ---- type tokens: the cast applied to an argument and the size its note spec declares ---- */
#define _MSU_SIZE_S64 "-8"
#define _MSU_SIZE_U64 "8"
#define _MSU_SIZE_PTR "8"
#define _MSU_CAST_S64(x) ((int64_t)(x))
#define _MSU_CAST_U64(x) ((uint64_t)(x))
#define _MSU_CAST_PTR(x) ((uint64_t)(uintptr_t)(x))

#define _MSU_STR(x) #x
#define _MSU_XSTR(x) _MSU_STR(x)

#if MEMSCOPE_USDT_SUPPORTED

#if defined(__x86_64__)
/* nopl 0x0(%rax,%rax,1); spelled as bytes so no '%' needs escaping in an asm with operands. */
#define _MSU_NOP ".byte 0x0f, 0x1f, 0x44, 0x00, 0x00"
#else
#define _MSU_NOP "nop"
#endif

/*
 * The semaphore: the tracer (through the kernel's uprobe ref_ctr_offset, or by writing the
 * target's memory) raises it while the probe is attached, so the wrapper can skip all argument
 * preparation otherwise. It must live in an allocated, writable PROGBITS section backed by the
 * file (the kernel only updates reference counters in a file-backed private writable mapping
 * of the probed file), hence a named section rather than .bss. Hidden visibility keeps the
 * access a direct PC-relative load instead of a GOT indirection.
 */
#define MEMSCOPE_USDT_SEMAPHORE(sym)                                                                \
    __attribute__((used, section(".probes"), visibility("hidden"))) volatile unsigned short sym = 0

/*
 * The site plus its note. `.ifndef _.stapsdt.base` lets every site in a translation unit
 * carry the base definition while the assembler keeps only the first one. `_MSU_ASM_AT` takes
 * the site's instruction (the tests' stand-in of PyTorch's allocator makes 1-byte-nop sites).
 */
#define _MSU_ASM(provider, name, sem, argstr) _MSU_ASM_AT(_MSU_NOP, provider, name, sem, argstr)
#define _MSU_ASM_AT(nop, provider, name, sem, argstr)                                               \
    "990: " nop "\n"                                                                                \
    ".pushsection .note.stapsdt, \"?\", \"note\"\n"                                                 \
    ".balign 4\n"                                                                                   \
    ".4byte 992f-991f, 994f-993f, 3\n"                                                              \
    "991: .asciz \"stapsdt\"\n"                                                                     \
    "992: .balign 4\n"                                                                              \
    "993: .8byte 990b\n"                                                                            \
    ".8byte _.stapsdt.base\n"                                                                       \
    ".8byte " _MSU_STR(sem) "\n"                                                                    \
    ".asciz \"" _MSU_STR(provider) "\"\n"                                                           \
    ".asciz \"" _MSU_STR(name) "\"\n"                                                               \
    ".asciz \"" argstr "\"\n"                                                                       \
    "994: .balign 4\n"                                                                              \
    ".popsection\n"                                                                                 \
    ".ifndef _.stapsdt.base\n"                                                                      \
    ".pushsection .stapsdt.base, \"aG\", \"progbits\", .stapsdt.base, comdat\n"                     \
    ".weak _.stapsdt.base\n"                                                                        \
    ".hidden _.stapsdt.base\n"                                                                      \
    "_.stapsdt.base: .space 1\n"                                                                    \
    ".size _.stapsdt.base, 1\n"                                                                     \
    ".popsection\n"                                                                                 \
    ".endif\n"

/* `asm volatile` keeps the site even though it has no outputs; the compiler cannot delete it,
 * and distinct note text per probe keeps identical-code folding from merging two wrappers. */
#define MEMSCOPE_USDT0(provider, name, sem) __asm__ __volatile__(_MSU_ASM(provider, name, sem, ""))

#define MEMSCOPE_USDT1(provider, name, sem, t1, a1)                                                 \
    __asm__ __volatile__(_MSU_ASM(provider, name, sem, _MSU_SIZE_##t1 "@%[_msu_a1]")                \
                         :                                                                          \
                         : [_msu_a1] "nor"(_MSU_CAST_##t1(a1)))

#define MEMSCOPE_USDT2(provider, name, sem, t1, a1, t2, a2)                                         \
    __asm__ __volatile__(_MSU_ASM(provider, name, sem,                                              \
                                  _MSU_SIZE_##t1 "@%[_msu_a1] " _MSU_SIZE_##t2 "@%[_msu_a2]")       \
                         :                                                                          \
                         : [_msu_a1] "nor"(_MSU_CAST_##t1(a1)), [_msu_a2] "nor"(_MSU_CAST_##t2(a2)))

#define MEMSCOPE_USDT3(provider, name, sem, t1, a1, t2, a2, t3, a3)                                 \
    __asm__ __volatile__(_MSU_ASM(provider, name, sem,                                              \
                                  _MSU_SIZE_##t1 "@%[_msu_a1] " _MSU_SIZE_##t2 "@%[_msu_a2] "       \
                                  _MSU_SIZE_##t3 "@%[_msu_a3]")                                     \
                         :                                                                          \
                         : [_msu_a1] "nor"(_MSU_CAST_##t1(a1)), [_msu_a2] "nor"(_MSU_CAST_##t2(a2)), \
                           [_msu_a3] "nor"(_MSU_CAST_##t3(a3)))

#define MEMSCOPE_USDT4(provider, name, sem, t1, a1, t2, a2, t3, a3, t4, a4)                         \
    __asm__ __volatile__(_MSU_ASM(provider, name, sem,                                              \
                                  _MSU_SIZE_##t1 "@%[_msu_a1] " _MSU_SIZE_##t2 "@%[_msu_a2] "       \
                                  _MSU_SIZE_##t3 "@%[_msu_a3] " _MSU_SIZE_##t4 "@%[_msu_a4]")       \
                         :                                                                          \
                         : [_msu_a1] "nor"(_MSU_CAST_##t1(a1)), [_msu_a2] "nor"(_MSU_CAST_##t2(a2)), \
                           [_msu_a3] "nor"(_MSU_CAST_##t3(a3)), [_msu_a4] "nor"(_MSU_CAST_##t4(a4)))

#else /* !MEMSCOPE_USDT_SUPPORTED */

#define MEMSCOPE_USDT_SEMAPHORE(sym) volatile unsigned short sym = 0
#define MEMSCOPE_USDT0(provider, name, sem) ((void)0)
#define MEMSCOPE_USDT1(provider, name, sem, t1, a1) ((void)(a1))
#define MEMSCOPE_USDT2(provider, name, sem, t1, a1, t2, a2) ((void)(a1), (void)(a2))
#define MEMSCOPE_USDT3(provider, name, sem, t1, a1, t2, a2, t3, a3) ((void)(a1), (void)(a2), (void)(a3))
#define MEMSCOPE_USDT4(provider, name, sem, t1, a1, t2, a2, t3, a3, t4, a4)                         \
    ((void)(a1), (void)(a2), (void)(a3), (void)(a4))

#endif /* MEMSCOPE_USDT_SUPPORTED */

#endif /* MEMSCOPE_USDT_H */
