"""WGSL numerics shared by hetero's kernels: float32 erf, the normal CDF and erf-form GELU.

``MATH`` declares ``nn_erf``, ``nn_phi`` and ``nn_gelu`` (and the helpers they use) for
any kernel to include; ``GELU4`` adds ``nn_gelu4`` over a vec4. A kernel that includes
``MATH`` sets ``nn_zero`` from a zero in its uniform before calling them.

Rules of the numerics. WGSL has no erf, and ``1 + erf(x / sqrt 2)`` cancels for negative
x, so GELU is computed as ``x * Phi(x)`` with the normal CDF Phi taken from erfc where
that is small: ``erfc(z) = u * exp(-z*z + c(u))``, ``u = 1 / (1 + z/2)``, with the
degree-9 polynomial ``c`` of Numerical Recipes' erfcc (relative error 1.2e-7 in exact
arithmetic). ``-z*z`` is split exactly into a large and a small part (bit-masked 12-bit
halves, no reliance on a fused fma) and exp runs a Cody-Waite range reduction on the two
parts, so the result keeps its relative accuracy down to underflow whatever the
hardware's exp accuracy. The exact step is fenced off by OR-ing a zero the compiler
cannot know (``nn_zero``) into its bits, so that no optimiser reassociates it with its
neighbours. For |z| < 1 erf is an odd degree-13 polynomial fitted to math.erf.
Accuracy against float64 math.erf/erfc: gelu relative error 4.5e-7 at most over
[-14, 14]; erf absolute error 1.3e-7 (relative 1.7e-7) over [-6, 6] (BENCHMARKS.md,
"Kernel defaults on lavapipe"). gelu(NaN) = NaN, gelu(+inf) = +inf, gelu(-inf) = 0 (the limit).
"""

from __future__ import annotations

__all__ = ["GELU4", "MATH"]

MATH = """
const NN_FLT_MAX: f32 = 3.40282347e38;
fn nn_is_nan(v: f32) -> bool { return (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u; }
fn nn_nan() -> f32 { return bitcast<f32>(0x7fc00000u); }
fn nn_inf() -> f32 { return bitcast<f32>(0x7f800000u); }

// A zero the compiler cannot know (kernels set it from their uniform): OR-ing it into
// a value's bits stops optimisers from reassociating exact steps with their neighbours
// (lavapipe's compiler turns (a - k*c1) + (b + k*c2) into (a + b) + k*(c2 - c1),
// which loses the exactness the range reduction below depends on: 4e-6 instead of 5e-7).
var<private> nn_zero: u32;
fn nn_keep(v: f32) -> f32 { return bitcast<f32>(bitcast<u32>(v) | nn_zero); }

// exp(a + b) for a large, exactly known a and a small correction b: Cody-Waite range
// reduction (ln 2 in a 9-bit head and a tail, so k * head and a - k * head are exact)
// keeps the relative error at a few ulp for any a, unlike exp() of a rounded sum.
fn nn_exp_parts(a: f32, b: f32) -> f32 {
    let kf = floor((a + b) * 1.44269504 + 0.5);
    let r = nn_keep(a - kf * 0.693359375) + (b + kf * 2.12194440e-4);
    var q = 1.98412698e-4;          // Taylor series of exp(r), |r| < 0.36: error < 3e-9
    q = q * r + 1.38888889e-3;
    q = q * r + 8.33333333e-3;
    q = q * r + 4.16666667e-2;
    q = q * r + 1.66666667e-1;
    q = q * r + 0.5;
    q = q * r + 1.0;
    q = q * r + 1.0;
    return ldexp(q, max(i32(kf), -160));
}

// x * x = hi + lo, hi exact: x split into 12-bit halves by masking bits (so no
// compiler can turn it into something else, and no fused fma is needed).
fn nn_square_parts(x: f32) -> vec2<f32> {
    let xh = bitcast<f32>(bitcast<u32>(x) & 0xfffff000u);
    let xl = x - xh;
    return vec2<f32>(xh * xh, (2.0 * xh) * xl + xl * xl);
}

// erfc(z) for z >= 0, given z*z = zz.x + zz.y: u * exp(-z*z + c(u)), u = 1 / (1 + z/2),
// c from Numerical Recipes' erfcc (relative error 1.2e-7 in exact arithmetic).
fn nn_erfc_core(z: f32, zz: vec2<f32>) -> f32 {
    let u = 1.0 / (1.0 + 0.5 * z);
    var c = 0.17087277;
    c = c * u - 0.82215223;
    c = c * u + 1.48851587;
    c = c * u - 1.13520398;
    c = c * u + 0.27886807;
    c = c * u - 0.18628806;
    c = c * u + 0.09678418;
    c = c * u + 0.37409196;
    c = c * u + 1.00002368;
    c = c * u - 1.26551223;
    return u * nn_exp_parts(-zz.x, c - zz.y);
}

// erf(z) / z for z*z = s in [0, 1]: least-squares fit on Chebyshev nodes (error 1.2e-9).
fn nn_erf_small(s: f32) -> f32 {
    var p = 7.88249745e-05;
    p = p * s - 8.01885501e-04;
    p = p * s + 5.18931216e-03;
    p = p * s - 2.68543288e-02;
    p = p * s + 1.12835974e-01;
    p = p * s - 3.76126260e-01;
    p = p * s + 1.12837911e+00;
    return p;
}

fn nn_erf(z: f32) -> f32 {
    if (nn_is_nan(z)) { return z; }
    let a = abs(z);
    if (a < 1.0) { return z * nn_erf_small(z * z); }
    var r = 1.0;
    if (a < 4.5) { r = 1.0 - nn_erfc_core(a, nn_square_parts(a)); }  // erfc(4.5) < 2e-10
    return select(r, -r, z < 0.0);
}

// The standard normal CDF Phi(x) = erfc(-x / sqrt 2) / 2, relatively accurate for x < 0.
fn nn_phi(x: f32) -> f32 {
    if (x >= 0.0 && x < 1.41421356) {
        let z = x * 0.707106781;
        return 0.5 + 0.5 * (z * nn_erf_small(z * z));
    }
    if (x >= 10.0) { return 1.0; }   // 1 - Phi(10) = 7.6e-24
    let a = abs(x);
    let sq = nn_square_parts(a);
    let e = 0.5 * nn_erfc_core(a * 0.707106781, 0.5 * sq);  // z*z = x*x / 2, still exact
    return select(1.0 - e, e, x < 0.0);
}

fn nn_gelu(x: f32) -> f32 {
    if (nn_is_nan(x)) { return x; }
    if (x < -14.0) { return 0.0; }   // |gelu| < 1e-43 (and the limit 0 at -inf)
    return x * nn_phi(x);
}
"""

GELU4 = ("fn nn_gelu4(v: vec4<f32>) -> vec4<f32> "
         "{ return vec4<f32>(nn_gelu(v.x), nn_gelu(v.y), nn_gelu(v.z), nn_gelu(v.w)); }\n")
"""``nn_gelu4``: :data:`MATH`'s ``nn_gelu`` on each lane of a vec4 (include after ``MATH``)."""
