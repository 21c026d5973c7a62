//! A copy that computes the CRC-32 of what it copies: a WRITE's payload
//! goes from the receive buffer into client memory and its ICRC is checked
//! in the same pass (`mem::Span::write_streaming_crc`), instead of one
//! pass for the check and another for the copy.
//!
//! The CRC is crc32fast's (IEEE, reflected), computed by carry-less
//! multiplication folding as in its AVX-512 kernel (Gopal et al., "Fast CRC
//! computation for generic polynomials using PCLMULQDQ", Intel 2009), with
//! the same constants; every 64-byte vector it folds in is also written to
//! the destination with a streaming store. On CPUs without AVX-512 and
//! VPCLMULQDQ, [`available`] is false and callers copy and hash apart: a
//! 128-bit fused loop is slower than crc32fast's wide loop plus a copy.

/// Bytes [`stream_blocks_crc`] takes per step.
pub const BLOCK: usize = 256;

/// Whether [`stream_blocks_crc`] runs on this CPU.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static ON: std::sync::LazyLock<bool> = std::sync::LazyLock::new(|| {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("vpclmulqdq")
                && is_x86_feature_detected!("pclmulqdq")
                && is_x86_feature_detected!("sse4.1")
        });
        *ON
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Copies `blocks` (at least 1) blocks of [`BLOCK`] bytes from `src` to
/// `dst` with streaming stores and returns the CRC-32 of them continued
/// from `crc` (what `crc32fast::Hasher::new_with_initial(crc)` would give
/// after them). The caller fences the stores.
///
/// # Safety
/// [`available`] is true; `dst` is 64-byte aligned; both ranges are
/// valid for `blocks * BLOCK` bytes and do not overlap.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "pclmulqdq", enable = "sse2", enable = "sse4.1", enable = "avx512f", enable = "vpclmulqdq")]
pub unsafe fn stream_blocks_crc(crc: u32, dst: *mut u8, src: *const u8, blocks: usize) -> u32 {
    use std::arch::x86_64::*;
    // Folding by 2048 bits (16 lanes of 128), then by 128, then Barrett.
    const K3: i64 = 0x1751997d0;
    const K4: i64 = 0x0ccaa009e;
    const K5: i64 = 0x163cd6124;
    const P_X: i64 = 0x1DB710641;
    const U_PRIME: i64 = 0x1F7011641;
    const K_2048_LOW: i64 = 0x11542778a;
    const K_2048_HIGH: i64 = 0x1322d1430;
    #[inline(always)]
    unsafe fn fold512(a: __m512i, b: __m512i, k: __m512i) -> __m512i {
        // b ^ clmul(a.lo, k.lo) ^ clmul(a.hi, k.hi), per 128-bit lane.
        _mm512_ternarylogic_epi64(b, _mm512_clmulepi64_epi128(a, k, 0x00), _mm512_clmulepi64_epi128(a, k, 0x11), 0x96)
    }
    #[inline(always)]
    unsafe fn fold128(a: __m128i, b: __m128i, k: __m128i) -> __m128i {
        _mm_xor_si128(_mm_xor_si128(b, _mm_clmulepi64_si128(a, k, 0x00)), _mm_clmulepi64_si128(a, k, 0x11))
    }
    let load = |p: *const u8| _mm512_loadu_si512(p as *const _);
    let (mut s, mut d) = (src, dst);
    let mut v = [load(s), load(s.add(64)), load(s.add(128)), load(s.add(192))];
    for (i, x) in v.iter().enumerate() {
        _mm512_stream_si512(d.add(64 * i) as *mut _, *x);
    }
    v[0] = _mm512_xor_si512(v[0], _mm512_castsi128_si512(_mm_cvtsi32_si128(!crc as i32)));
    let k = _mm512_set_epi64(K_2048_HIGH, K_2048_LOW, K_2048_HIGH, K_2048_LOW, K_2048_HIGH, K_2048_LOW, K_2048_HIGH, K_2048_LOW);
    for _ in 1..blocks {
        s = s.add(BLOCK);
        d = d.add(BLOCK);
        for (i, x) in v.iter_mut().enumerate() {
            let b = load(s.add(64 * i));
            _mm512_stream_si512(d.add(64 * i) as *mut _, b);
            *x = fold512(*x, b, k);
        }
    }
    // The 16 lanes in byte order, each folded into the next.
    let k3k4 = _mm_set_epi64x(K4, K3);
    let mut x = _mm512_castsi512_si128(v[0]);
    for (i, z) in v.iter().enumerate() {
        if i > 0 {
            x = fold128(x, _mm512_castsi512_si128(*z), k3k4);
        }
        x = fold128(x, _mm512_extracti32x4_epi32(*z, 1), k3k4);
        x = fold128(x, _mm512_extracti32x4_epi32(*z, 2), k3k4);
        x = fold128(x, _mm512_extracti32x4_epi32(*z, 3), k3k4);
    }
    // 128 bits to the 32-bit CRC, as crc32fast's reduce_128_to_crc.
    let x = _mm_xor_si128(_mm_clmulepi64_si128(x, k3k4, 0x10), _mm_srli_si128(x, 8));
    let low32 = _mm_set_epi32(0, 0, 0, !0);
    let x = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x, low32), _mm_set_epi64x(0, K5), 0x00), _mm_srli_si128(x, 4));
    let pu = _mm_set_epi64x(U_PRIME, P_X);
    let t1 = _mm_clmulepi64_si128(_mm_and_si128(x, low32), pu, 0x10);
    let t2 = _mm_clmulepi64_si128(_mm_and_si128(t1, low32), pu, 0x00);
    !(_mm_extract_epi32(_mm_xor_si128(x, t2), 1) as u32)
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Every byte lands and the CRC is crc32fast's, for any start value.
    #[test]
    fn copies_every_byte_and_gives_crc32fasts_crc() {
        if !available() {
            eprintln!("no AVX-512/VPCLMULQDQ here: nothing to test");
            return;
        }
        for blocks in [1usize, 2, 3, 16, 17] {
            let n = blocks * BLOCK;
            let src: Vec<u8> = (0..n).map(|i| (i * 131 + i / 7) as u8).collect();
            let mut dst = vec![0u8; n + 64];
            let off = dst.as_ptr().align_offset(64);
            for init in [0u32, 7, 0xdead_beef] {
                dst.fill(0);
                // SAFETY: AVX-512 checked; dst aligned and n bytes long; no overlap.
                let c = unsafe { stream_blocks_crc(init, dst.as_mut_ptr().add(off), src.as_ptr(), blocks) };
                let mut h = crc32fast::Hasher::new_with_initial(init);
                h.update(&src);
                assert_eq!(c, h.finalize(), "{blocks} blocks from {init:#x}");
                assert_eq!(&dst[off..off + n], &src[..]);
            }
        }
    }
}
