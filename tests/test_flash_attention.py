"""Flash attention (kernels/flash_attention) in interpret mode on CPU, compiled on GPU under
scripts/gpu_check.sh: outputs and dq, dk, dv against the dense jnp reference and against
``jax.nn.dot_product_attention(implementation='xla')``; the block schedule against the dense mask;
that skipped blocks are never read (NaN-poisoned); the model's attention_impl='pallas' training
like 'xla' under a data x tensor mesh; and the GPU path lowered and compiled for sm_90 here."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm.kernels import flash_attention as fa
from maxlm.kernels.flash_attention import kernel, schedule

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
# Max |got - want| over max |want|, for outputs and each gradient. fp32: accumulation order only;
# 16-bit: the inputs are exact in both, the kernel rounds p and ds to the input dtype for its dots
# (as every flash attention does) and the output to it, about 2^-8 (bf16) or 2^-11 (fp16) each.
TOL = {F32: 2e-5, BF16: 2.5e-2, F16: 4e-3}
SMALL = fa.BlockSizes(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
ON_GPU = os.environ.get("MAXLM_TEST_ON_GPU") == "1"


def _segments(b, t, kind, seed=0):
    """None, or [b, t] int32: 'docs' packs 1..4 documents per row (padding, segment 0, at the end
    of row 0); 'shuffled' draws ids at random (a row's documents interleave)."""
    if kind is None:
        return None
    rng = np.random.default_rng(seed)
    if kind == "shuffled":
        return jnp.asarray(rng.integers(0, 3, (b, t)), jnp.int32)
    rows = []
    for r in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), size=min(r + 1, 3, t - 1), replace=False))
        doc = np.searchsorted(cuts, np.arange(t), side="right") + 1
        rows.append(np.where(doc == doc.max(), 0, doc) if r == 0 else doc)
    return jnp.asarray(np.stack(rows), jnp.int32)


def _inputs(b, t, n, kh, h, dtype, s=None, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    s = t if s is None else s
    q = jax.random.normal(ks[0], (b, t, n, h), F32).astype(dtype)
    k, v = (jax.random.normal(kk, (b, s, kh, h), F32).astype(dtype) for kk in ks[1:3])
    return q, k, v, jax.random.normal(ks[3], (b, t, n, h), F32).astype(dtype)


def _value_and_grads(fn, q, k, v, do):
    def run(q, k, v):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(do))
    return jax.jit(run)(q, k, v)


def _jax_xla(q, k, v, q_seg, kv_seg, causal, window):
    mask = fa.reference_mask(q.shape[1], k.shape[1], q_seg, kv_seg, causal=causal, sliding_window=window)
    # fp32 without TF32 on GPU (XLA:CPU takes no precision for 16-bit inputs)
    with jax.default_matmul_precision("highest" if q.dtype == F32 else None):
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="xla")


def _assert_close(got, want, dtype, what):
    got, want = np.asarray(got.astype(F32)), np.asarray(want.astype(F32))
    assert got.shape == want.shape, what
    assert np.isfinite(got).all(), f"{what}: not finite"
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6)
    assert err <= TOL[dtype], f"{what}: max error {err:.2e} of max |want| > {TOL[dtype]:.0e}"


def _check(b, t, n, kh, h, causal, window, segs, dtype, s=None, blocks=SMALL):
    q, k, v, do = _inputs(b, t, n, kh, h, dtype, s)
    q_seg = _segments(b, t, segs)
    kv_seg = None if q_seg is None or s is None else _segments(b, s, segs, seed=1)
    opts = dict(causal=causal, sliding_window=window)
    got = _value_and_grads(lambda q, k, v: fa.flash_attention(q, k, v, q_seg, kv_seg, block_sizes=blocks, **opts),
                           q, k, v, do)
    ref = _value_and_grads(lambda q, k, v: fa.attention_reference(q, k, v, q_seg, kv_seg, **opts), q, k, v, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, ref):
        _assert_close(g, w, dtype, f"{name} vs reference")
    # Self-attention only: every row sees a key, which jax.nn.dot_product_attention needs to
    # agree (it averages a row that sees none). XLA:CPU has no fp16 x fp16 -> fp32 dot for it.
    if s is None and not (dtype == F16 and jax.default_backend() == "cpu"):
        peer = _value_and_grads(lambda q, k, v: _jax_xla(q, k, v, q_seg, q_seg, causal, window), q, k, v, do)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, peer):
            _assert_close(g, w, dtype, f"{name} vs jax.nn.dot_product_attention")


# (batch, length, heads, kv heads, head dim, causal, window, segments, dtype): kv-head ratios
# 1, 2, 4, 8 and 3, head dims 64 / 80 / 128 (and 48, 96, 32 padded), lengths that are block
# multiples (32, 64) and not (20, 40, 50, 77), causal on and off, documents, windows, fp32 / bf16.
FAST = [
    (2, 40, 4, 2, 64, True, 0, "docs", F32),
    (1, 50, 8, 1, 80, True, 12, None, F32),
    (2, 32, 4, 4, 128, False, 0, "docs", BF16),
    (1, 77, 6, 2, 48, True, 0, "shuffled", F32),
]
SLOW = [
    (1, 32, 2, 2, 64, False, 0, None, F32),
    (3, 64, 4, 1, 64, True, 0, None, F32),
    (2, 50, 8, 2, 128, True, 16, "docs", F32),
    (1, 40, 8, 1, 80, False, 0, "docs", F32),
    (2, 77, 4, 2, 96, True, 33, "docs", F32),
    (1, 20, 2, 1, 32, True, 5, None, F32),
    (2, 64, 8, 8, 80, True, 0, "docs", BF16),
    (1, 40, 4, 2, 64, True, 16, "docs", BF16),
    (2, 50, 8, 1, 128, False, 0, None, BF16),
    (1, 64, 8, 4, 64, True, 24, None, BF16),
    (1, 40, 6, 3, 80, True, 0, "shuffled", BF16),
    (2, 33, 4, 2, 64, True, 0, "docs", F16),
]


@pytest.mark.parametrize("b,t,n,kh,h,causal,window,segs,dtype",
                         FAST + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW])
def test_matches_reference_and_jax(b, t, n, kh, h, causal, window, segs, dtype):
    _check(b, t, n, kh, h, causal, window, segs, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("t,s,causal,segs", [(24, 56, False, "docs"), (40, 24, True, None), (40, 40, True, "docs")])
def test_cross_lengths_and_mixed_blocks(t, s, causal, segs):
    """Queries and keys of different lengths (a query may see no key: zeros), and forward and
    backward blocks of different sizes, against the reference."""
    _check(2, t, 4, 2, 64, causal, 0, segs, F32, s=s,
           blocks=fa.BlockSizes(block_q=32, block_k=16, block_q_bwd=16, block_k_bwd=32))


def test_default_blocks_and_scale():
    """The production block sizes (a length under one block) and an explicit scale."""
    q, k, v, do = _inputs(1, 100, 4, 2, 64, F32)
    got = _value_and_grads(lambda q, k, v: fa.flash_attention(q, k, v, causal=True, scale=0.3), q, k, v, do)
    ref = _value_and_grads(lambda q, k, v: fa.attention_reference(q, k, v, causal=True, scale=0.3), q, k, v, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, ref):
        _assert_close(g, w, F32, name)


# ---- the block schedule


def _truly_visible(t, s, bq, bk, causal, window, q_seg, kv_seg):
    """[B, n_q, n_k]: block pairs holding at least one pair the dense mask lets through."""
    mask = np.asarray(fa.reference_mask(t, s, q_seg, kv_seg, causal=causal, sliding_window=window))
    b = mask.shape[0]
    nq, nk = -(-t // bq), -(-s // bk)
    padded = np.zeros((b, nq * bq, nk * bk), bool)
    padded[:, :t, :s] = mask
    return padded.reshape(b, nq, bq, nk, bk).any(axis=(2, 4))


def _tables(t, s, bq, bk, causal, window, q_seg, kv_seg):
    nq, nk = -(-t // bq), -(-s // bk)
    pad = lambda x, n: None if x is None else jnp.pad(x, ((0, 0), (0, n - x.shape[1])),
                                                      constant_values=schedule.PAD_SEGMENT)
    return schedule.block_tables(1 if q_seg is None else q_seg.shape[0], t, s, bq, bk, nq, nk, causal=causal,
                                 window=window, q_segments=pad(q_seg, nq * bq), kv_segments=pad(kv_seg, nk * bk))


@pytest.mark.parametrize("t,bq,bk,causal,window,docs", [
    (128, 16, 16, True, 0, None),  # the causal triangle: 36 of 64 pairs
    (128, 16, 32, True, 16, None),  # a window of one block
    (100, 32, 16, False, 0, [30, 64, 90]),  # four documents, not block-aligned
    (128, 16, 16, True, 0, [32, 64, 96]),  # four aligned documents: only their diagonal blocks
    (96, 16, 16, True, 40, [48]),
])
def test_schedule_visits_exactly_the_blocks_the_mask_needs(t, bq, bk, causal, window, docs):
    seg = None if docs is None else jnp.asarray(np.searchsorted(docs, np.arange(t), side="right")[None] + 1, jnp.int32)
    rows, cols = (np.asarray(x) for x in _tables(t, t, bq, bk, causal, window, seg, seg))
    need = _truly_visible(t, t, bq, bk, causal, window, seg, seg)[0]
    nq, nk = need.shape
    visited = np.zeros_like(need)
    for i, (lo, mid_lo, mid_hi, hi) in enumerate(rows[0]):
        assert lo <= mid_lo <= mid_hi <= hi
        visited[i, lo:hi] = True
        # Full blocks skip the positional mask: every query sees every key there by position.
        for j in range(mid_lo, mid_hi):
            assert (j + 1) * bk <= t and (not causal or (j + 1) * bk - 1 <= i * bq)
            assert not window or min((i + 1) * bq, t) - 1 - j * bk < window
    by_cols = np.zeros_like(need)
    for j, (lo, _, _, hi) in enumerate(cols[0]):
        by_cols[lo:hi, j] = True
    # Block-aligned or not, monotone segment ids make the intervals exact: nothing needed is
    # skipped and nothing skippable is visited; the dk/dv pass visits the transpose.
    np.testing.assert_array_equal(visited, need)
    np.testing.assert_array_equal(by_cols, need)
    assert int(schedule.visited_pairs(rows)[0]) == need.sum() < nq * nk
    if causal and not window and docs is None and bq == bk:
        assert need.sum() == nq * (nq + 1) // 2


def test_schedule_with_shuffled_segments_visits_a_superset():
    seg = _segments(2, 70, "shuffled")
    rows, _ = _tables(70, 70, 16, 16, True, 0, seg, seg)
    need = _truly_visible(70, 70, 16, 16, True, 0, seg, seg)
    for r in range(2):
        for i, (lo, _, _, hi) in enumerate(np.asarray(rows[r])):
            needed = np.flatnonzero(need[r, i])
            assert needed.size == 0 or (lo <= needed.min() and needed.max() < hi)


# ---- skipped blocks are never read


def _static(t, s, bq, bk, causal, window, segments):
    return kernel.Static(causal=causal, window=window, scale=0.125, kv_len=s, segments=segments, block_q=bq,
                         block_k=bk, block_q_bwd=bq, block_k_bwd=bk, num_warps=4, num_warps_bwd=4, num_stages=2,
                         interpret=fa.default_interpret())


@pytest.mark.parametrize("causal,window,docs", [(True, 0, None), (True, 24, None), (False, 0, [24, 40])])
def test_skipped_blocks_are_never_read(causal, window, docs):
    """Poison one block with NaN: exactly the programs whose schedule includes it turn NaN (a
    visited block poisons its rows even where every pair is masked, since 0 * NaN = NaN)."""
    t, bq, bk, h = 64, 16, 16, 64
    seg = None if docs is None else jnp.asarray(np.searchsorted(docs, np.arange(t), side="right")[None] + 1, jnp.int32)
    c = _static(t, t, bq, bk, causal, window, seg is not None)
    rows, cols = _tables(t, t, bq, bk, causal, window, seg, seg)
    rows_np, cols_np = np.asarray(rows[0]), np.asarray(cols[0])
    q, k, v, do = _inputs(1, t, 2, 1, h, F32)
    lse = jnp.zeros((1, 2, t), F32)

    @jax.jit
    def poisoned(j):
        poison = lambda x: jax.lax.dynamic_update_slice_in_dim(x, jnp.full_like(x[:, :bk], jnp.nan), j * bk, 1)
        out, _ = kernel.forward(c, rows, q, k, poison(v), seg, seg)
        dq = kernel.backward_dq(c, rows, q, k, poison(v), do, lse, lse, seg, seg)
        # dk/dv: poison query block j's do; the key blocks whose interval holds it turn NaN.
        return out, dq, kernel.backward_dkv(c, cols, q, k, v, poison(do), lse, lse, seg, seg)[1]

    for j in range(t // bk):
        out, dq, dv = poisoned(j)
        want = np.array([lo <= j < hi for lo, _, _, hi in rows_np])
        for name, x in (("out", out), ("dq", dq)):
            got = np.isnan(np.asarray(x)[0]).reshape(t // bq, -1).any(-1)
            np.testing.assert_array_equal(got, want, err_msg=f"{name}: q blocks reading key block {j}")
        want = np.array([lo <= j < hi for lo, _, _, hi in cols_np])
        got = np.isnan(np.asarray(dv)[0]).reshape(t // bk, -1).any(-1)
        np.testing.assert_array_equal(got, want, err_msg=f"dv: key blocks reading query block {j}")
    assert schedule.visited_pairs(rows)[0] < (t // bq) * (t // bk)


# ---- bad input


@pytest.mark.parametrize("change,message", [
    (dict(k=(1, 32, 3, 64), v=(1, 32, 3, 64)), "4 query heads are not a multiple of 3 kv heads"),
    (dict(v=(1, 32, 2, 32)), r"k \(1, 32, 2, 64\) and v \(1, 32, 2, 32\) must both be"),
    (dict(window=8, causal=False), "a sliding window needs causal=True"),
    (dict(blocks=fa.BlockSizes(block_q=24)), "powers of two >= 16, got 24"),
])
def test_bad_input_is_one_clear_error(change, message):
    shapes = dict(q=(1, 32, 4, 64), k=(1, 32, 2, 64), v=(1, 32, 2, 64))
    shapes.update({key: val for key, val in change.items() if key in shapes})
    q, k, v = (jnp.zeros(shapes[x], F32) for x in "qkv")
    with pytest.raises(ValueError, match=message):
        fa.flash_attention(q, k, v, causal=change.get("causal", True), sliding_window=change.get("window", 0),
                           block_sizes=change.get("blocks"))


# ---- the model: attention_impl="pallas"


@pytest.mark.cpu_only
@pytest.mark.parametrize("mesh", [dict(data=4, tensor=2), pytest.param(
    dict(data=2, tensor=2, pipeline=2, pipeline_microbatches=2), marks=pytest.mark.slow)])
def test_training_with_pallas_matches_xla(mesh):
    """Real train steps on 8 devices (data x tensor, so the kernel runs under shard_map with
    batch and heads split; and inside the pipeline's vmap over stages) give the losses of
    attention_impl='xla'. The first two steps warm up from a zero learning rate."""
    from tests.helpers import small_config, train_losses

    def losses(impl):
        cfg = small_config(model=dict(attention_impl=impl, n_heads=4, n_kv_heads=2, sliding_window=12), mesh=mesh)
        return train_losses(cfg, jax.devices(), steps=4)[0]

    pallas, xla = losses("pallas"), losses("xla")
    np.testing.assert_allclose(pallas, xla, rtol=2e-5)
    assert pallas[-1] < pallas[1]


@pytest.mark.cpu_only
@pytest.mark.parametrize("batch", [4, 3])
def test_attention_seam_shards_the_kernel_over_the_mesh(batch):
    """attention(impl='pallas') under a data x tensor mesh is one shard_map (batch over data,
    heads over tensor; a batch of 3 stays whole) and equals the unsharded call; without a mesh
    there is none."""
    from maxlm.model import attention as A
    from maxlm.parallel import sharding

    q, k, v, _ = _inputs(batch, 24, 4, 2, 32, F32)
    seg = _segments(batch, 24, "docs")
    tokens = A.Tokens(jnp.broadcast_to(jnp.arange(24), seg.shape), seg)
    run = lambda q, k, v: A.attention(q, k, v, tokens, impl="pallas", sliding_window=10)
    plain = jax.jit(run)(q, k, v)
    assert "shard_map" not in str(jax.make_jaxpr(run)(q, k, v))
    mesh = sharding.make_mesh(dict(data=4, fsdp=1, tensor=2, pipeline=1))
    with jax.set_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(run)(q, k, v))
        sharded = jax.jit(run)(q, k, v)
    split = "'data'" if batch == 4 else "None"
    assert jaxpr.count("shard_map") == 1 and f"out_specs=(P({split}, None, 'tensor', None),)" in jaxpr
    np.testing.assert_allclose(sharded, plain, rtol=1e-6, atol=1e-6)
    want = fa.attention_reference(q, k, v, seg, causal=True, sliding_window=10)
    np.testing.assert_allclose(plain, want, rtol=1e-5, atol=1e-5)


# ---- the GPU path, without a GPU


def _triton_modules(fn, *args):
    """The Triton IR of every Pallas kernel in fn(*args), lowered for CUDA here (private Pallas
    APIs: this check only)."""
    import contextlib
    from unittest import mock

    from jax._src.pallas.triton import lowering, pallas_call_registration

    captured, build = [], lowering.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        result = build(*a, **kw)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(lowering, "lower_jaxpr_to_triton_module", capture))
        gpu_info = getattr(pallas_call_registration, "gpu_info_lib", None)
        if gpu_info is not None:  # jax >= 0.11 asks which GPU it lowers for: an H100 (sm_90)
            h100 = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H100)
            stack.enter_context(mock.patch.object(gpu_info, "get_gpu_info", lambda: h100))
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return captured


@pytest.mark.skipif(ON_GPU, reason="compiled for real on the GPU run")
@pytest.mark.parametrize("h,dtype,segs", [(128, BF16, False), pytest.param(80, F16, True, marks=pytest.mark.slow)])
def test_lowers_and_compiles_for_sm90(h, dtype, segs):
    """Forward, dq and dk/dv of the benchmark shape (B=4, N=16, S=4096, causal) lower through
    Pallas' Triton backend and compile for sm_90 with Triton: tensor-core wgmma dots, shared
    memory within Hopper's 227 KiB."""
    def loss(q, k, v, seg):
        out = fa.flash_attention(q, k, v, seg if segs else None, causal=True, interpret=False)
        return jnp.sum(out.astype(F32))

    shape = jax.ShapeDtypeStruct((4, 4096, 16, h), dtype)
    irs = _triton_modules(jax.grad(loss, argnums=(0, 1, 2)), shape, shape, shape,
                          jax.ShapeDtypeStruct((4, 4096), jnp.int32))
    assert len(irs) == 3 and all(ir.count("scf.for") >= 3 for ir in irs)  # three phases per program
    pytest.importorskip("triton")
    from maxlm.kernels.int4_matmul.offline import compile_ir

    for ir in irs:
        compiled = compile_ir(ir, num_warps=8, num_stages=2)
        assert compiled.metadata.shared <= 227 * 1024
        assert "wgmma" in compiled.asm["ptx"]
