"""The fused decode (``asyncstep.ops.triton.fused_decode``, issue 28): the Q4
GEMV's prologues (the RMS norm, over the row or from the previous kernel's
parts) and epilogues (residual add, the next norm's rows, SiLU·mul of
interleaved gate/up rows) equal their torch references (float32 to 1e-6;
bfloat16 as the unfused kernels round); a decoder stack of packed 4-bit layers
gives the unfused layers' hidden states for a one-token step and leaves a
received residual alone; steps it cannot take (larger, dense layers, the
switch off) run the unfused layers; the int8 activations (opt-in) reach
every Q4 GEMV of the op set that asks for them, and no other.

On the CPU the kernels run under the Triton interpreter
(``TRITON_INTERPRET=1``, set before triton is imported); with
``ASYNCSTEP_TEST_DEVICE=cuda`` (the GPU machine's run) a whole engine on a
4-bit model gives the same greedy tokens with the fused decode on and off,
runs the int8 activations when its config asks, and the fused GEMVs
launched with PDL give the bits they give without.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cuda_graphs import captured, pdl_off_bits
from sm90 import compile_for_sm90

TEST_DEVICE = os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from asyncstep.datatypes import IntermediateTensors  # noqa: E402
from asyncstep.models.layers.attention import AttentionMetadata, kv_cache_shape  # noqa: E402
from asyncstep.models.layers.gpu_quant import (  # noqa: E402
    round_decoder_weights,
    round_to_q4_1,
)
from asyncstep.models.llama import LlamaForCausalLM  # noqa: E402
from asyncstep.ops.torch_attention import TORCH_ATTENTION  # noqa: E402
from asyncstep.ops.triton import TritonOps  # noqa: E402
from asyncstep.ops.triton.fused import silu_and_mul  # noqa: E402
from asyncstep.ops.triton.fused_decode import (  # noqa: E402
    FusedDecodePath,
    FusedDecodeWeights,
    _layer_weights,
)
from asyncstep.ops.triton.quant import (  # noqa: E402
    GROUP_SIZE,
    GemvConfig,
    dequantize_q4_reference,
    interleave_pairs,
    pack_q4,
    q4_gemv,
    q4_gemv_fused,
)
from asyncstep.ops.triton.quant_weight import pack_q4_gpu  # noqa: E402

DEVICE = torch.device(TEST_DEVICE)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("ASYNCSTEP_TEST_DEVICE=cuda but CUDA is unavailable", allow_module_level=True)

#: One rounding to bfloat16 (the interpreter truncates: a whole ulp) and noise.
BF16 = 2.0**-8 if DEVICE.type == "cuda" else 2.0**-7

# (rows of the weight, K, config): unmasked tiles, partial tiles both ways, prefetch off.
CASES = [
    (40, 192, GemvConfig(block_n=8, block_g=2, num_warps=1)),
    (40, 192, GemvConfig(block_n=16, block_g=4, num_warps=4)),
    (40, 192, GemvConfig(block_n=8, block_g=2, num_warps=2, prefetch=False)),
]


def random_q4(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(qweight, scales, w)``: random Q4 codes packed, and their float32 weight."""
    groups = k // GROUP_SIZE
    codes = torch.randint(0, 16, (n, k), device=DEVICE)
    scale = (torch.rand(n, groups, device=DEVICE) * 0.1 + 0.01).half()
    offset = (torch.randn(n, groups, device=DEVICE) * 0.2).half()
    qweight, scales = pack_q4(codes, scale, offset)
    return qweight, scales, dequantize_q4_reference(qweight, scales)


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


# -- the GEMV's prologues and epilogues ---------------------------------------------------


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("n", "k", "config"), CASES)
def test_rms_norm_prologue(rows: int, n: int, k: int, config: GemvConfig) -> None:
    qweight, scales, w = random_q4(n, k)
    x, weight = torch.randn(rows, k, device=DEVICE) * 3, torch.randn(k, device=DEVICE)
    out, normed = q4_gemv_fused(x, qweight, scales, rms_norm_weight=weight, eps=1e-5, config=config)
    expected = F.rms_norm(x.double(), (k,), weight.double(), 1e-5) @ w.double().T
    assert out.shape == (rows, n) and out.dtype == torch.float32 and normed is None
    assert rel(out, expected) < 1e-6


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(
    ("n", "k", "config"),
    [
        (64, 192, GemvConfig(block_n=8, block_g=2, num_warps=1)),  # 8 parts
        (96, 160, GemvConfig(block_n=16, block_g=4, num_warps=4)),  # 6 parts, partial blocks
    ],
)
def test_residual_and_next_norm_then_the_normed_prologue(
    rows: int, n: int, k: int, config: GemvConfig
) -> None:
    """o_proj's epilogue (residual add, the next norm's rows made ready),
    then gate_up's normed prologue: the norm of the new stream."""
    qweight, scales, w = random_q4(n, k)
    x, residual = torch.randn(rows, k, device=DEVICE), torch.randn(rows, n, device=DEVICE)
    next_weight = torch.randn(n, device=DEVICE)
    kept = residual.clone()
    stream, normed = q4_gemv_fused(
        x, qweight, scales, residual=residual, next_rms_norm_weight=next_weight, config=config
    )
    expected = residual.double() + x.double() @ w.double().T
    assert rel(stream, expected) < 1e-6 and torch.equal(residual, kept)
    assert normed is not None
    torch.testing.assert_close(normed.xw, stream * next_weight)
    parts = -(-n // config.block_n)
    assert normed.sq_parts.shape == (rows, parts)
    torch.testing.assert_close(normed.sq_parts.sum(1), (stream * stream).sum(1))
    # The next GEMV folds that norm in from the parts.
    qweight2, scales2, w2 = random_q4(24, n)
    out, _ = q4_gemv_fused(
        normed.xw, qweight2, scales2, sq_parts=normed.sq_parts, eps=1e-5, config=config
    )
    normed_ref = F.rms_norm(stream.double(), (n,), next_weight.double(), 1e-5)
    assert rel(out, normed_ref @ w2.double().T) < 1e-6


def int8_x(x: torch.Tensor) -> torch.Tensor:
    """x as the GEMV's int8 path reads it: per block of 32, ``dx * round(x /
    dx)``, ``dx = max|x| / 127`` (float32)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, GROUP_SIZE)
    amax = blocks.abs().amax(-1, keepdim=True)
    return (torch.round(blocks * (127 / amax)) * (amax / 127)).reshape(x.shape)


@pytest.mark.parametrize(
    ("n", "k", "config"),
    [
        (64, 192, GemvConfig(block_n=8, block_g=2, num_warps=1)),
        (96, 160, GemvConfig(block_n=16, block_g=4, num_warps=4)),  # partial blocks
    ],
)
def test_the_int8_path_quantizes_the_rows_before_the_norm_scale(
    n: int, k: int, config: GemvConfig
) -> None:
    """int8 x: the prologues quantize ``x * weight`` (the norm's ``1 / rms``
    scales the dot products after), the epilogues are the float path's."""
    config = config._replace(int8=True)
    qweight, scales, w = random_q4(n, k)
    x, weight = torch.randn(3, k, device=DEVICE) * 3, torch.randn(k, device=DEVICE)
    out, _ = q4_gemv_fused(x, qweight, scales, rms_norm_weight=weight, eps=1e-5, config=config)
    inv_rms = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert rel(out, (int8_x(x * weight).double() @ w.double().T) * inv_rms) < 1e-5
    residual, next_weight = torch.randn(3, n, device=DEVICE), torch.randn(n, device=DEVICE)
    stream, normed = q4_gemv_fused(
        x, qweight, scales, residual=residual, next_rms_norm_weight=next_weight, config=config
    )
    assert rel(stream, residual.double() + int8_x(x).double() @ w.double().T) < 1e-5
    assert normed is not None
    qweight2, scales2, w2 = random_q4(24, n)
    out, _ = q4_gemv_fused(
        normed.xw, qweight2, scales2, sq_parts=normed.sq_parts, eps=1e-5, config=config
    )
    inv_rms = torch.rsqrt(stream.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert rel(out, (int8_x(normed.xw).double() @ w2.double().T) * inv_rms) < 1e-5


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("n", "k", "config"), CASES)
def test_silu_pairs_epilogue(rows: int, n: int, k: int, config: GemvConfig) -> None:
    qweight, scales, w = random_q4(n, k)
    x = torch.randn(rows, k, device=DEVICE)
    paired = interleave_pairs(qweight, scales)
    out, _ = q4_gemv_fused(x, *paired, silu_pairs=True, config=config)
    gate, up = (x.double() @ w.double().T).chunk(2, -1)
    assert out.shape == (rows, n // 2)
    assert rel(out, F.silu(gate) * up) < 1e-6


def test_bfloat16_rounds_as_the_unfused_layer() -> None:
    """bf16: SiLU·mul rounds as silu_and_mul (after gate_up's rounding), and
    the product is rounded before the residual add (the unfused layer's
    bits, but for the GEMV's own summation order)."""
    qweight, scales, _ = random_q4(64, 256)
    x = torch.randn(1, 256, device=DEVICE).bfloat16()
    out, _ = q4_gemv_fused(x, *interleave_pairs(qweight, scales), silu_pairs=True)
    unfused = silu_and_mul(q4_gemv(x, qweight, scales))
    residual = torch.randn(1, 64, device=DEVICE).bfloat16()
    stream, _ = q4_gemv_fused(x, qweight, scales, residual=residual)
    # (the interpreter truncates where torch's add rounds: an ulp apart there)
    exact = DEVICE.type == "cuda"
    tolerance = {"rtol": 0.0 if exact else BF16, "atol": 0.0 if exact else 1e-2}
    assert out.dtype == stream.dtype == torch.bfloat16
    torch.testing.assert_close(out, unfused, **tolerance)
    torch.testing.assert_close(stream, residual + q4_gemv(x, qweight, scales), **tolerance)


def test_interleaved_weights_still_multiply_stacked() -> None:
    """A layer's packed weight with its rows interleaved for the fused
    decode gives the stacked halves to the unfused path."""
    weight = round_to_q4_1(torch.randn(32, 64, device=DEVICE))
    packed = pack_q4_gpu(weight)
    assert packed is not None
    x = torch.randn(1, 64, device=DEVICE)
    before = packed.mm(x)
    packed.interleave_halves()
    packed.interleave_halves()  # once only
    assert packed.interleaved
    # (the compiled GEMV's sums may round a row differently at another position)
    torch.testing.assert_close(packed.mm(x), before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rms_norm_weight": torch.ones(64), "sq_parts": torch.ones(1, 2)}, "one prologue"),
        ({"rms_norm_weight": torch.ones(32)}, "rms_norm_weight must be"),
        ({"sq_parts": torch.ones(2, 2)}, "sq_parts must be"),
        ({"residual": torch.ones(1, 7)}, "residual must be"),
        ({"residual": torch.ones(1, 16, dtype=torch.float16)}, "residual must be"),
        ({"silu_pairs": True, "residual": torch.ones(1, 16)}, "silu_pairs"),
        ({"next_rms_norm_weight": torch.ones(8)}, "next_rms_norm_weight must be"),
    ],
)
def test_bad_fused_arguments_raise(kwargs: dict[str, Any], match: str) -> None:
    qweight, scales, _ = random_q4(16, 64)
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        q4_gemv_fused(torch.ones(1, 64, device=DEVICE), qweight, scales, **kwargs)


# -- the model --------------------------------------------------------------------------


def metadata(tokens: int, past: int, block_size: int) -> AttentionMetadata:
    """One request's ``tokens`` new tokens after ``past`` cached ones, in blocks 0, 1, ..."""
    total = past + tokens
    qsl = np.array([0, tokens], dtype=np.int32)
    blocks = -(-total // block_size)
    return AttentionMetadata(
        num_actual_tokens=tokens,
        num_decodes=0,
        query_start_loc=torch.from_numpy(qsl).to(DEVICE),
        seq_lens=torch.tensor([total], dtype=torch.int32, device=DEVICE),
        block_table=torch.arange(blocks, dtype=torch.int32, device=DEVICE)[None],
        slot_mapping=torch.arange(past, total, device=DEVICE),
        max_query_len=tokens,
        max_seq_len=total,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=np.array([total]),
        positions=torch.arange(past, total, device=DEVICE),
    )


@pytest.fixture(scope="module")
def q4_tiny() -> LlamaForCausalLM:
    """The tiny Llama (float32) on weights rounded to Q4_1's grid, every
    decoder linear layer packed, KV caches bound (the reference attention)."""
    from asyncstep.models.dummy import dummy_weights, get_shape

    arch = get_shape("tiny-llama")
    model = LlamaForCausalLM(arch, torch.float32).to(DEVICE)
    model.load_weights(round_decoder_weights(dummy_weights(arch, seed=0, device=DEVICE)))
    for layer in model.model.stage_layers():
        for linear in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):
            linear.packed = pack_q4_gpu(linear.weight.data.float())
            assert linear.packed is not None
    shape = kv_cache_shape(4, 16, arch.num_key_value_heads, arch.head_dim)
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros(shape, device=DEVICE)
    return model


def step(
    model: LlamaForCausalLM,
    fused: bool,
    ids: torch.Tensor,
    past: int,
    intermediate: IntermediateTensors | None = None,
) -> Any:
    # The Triton layer ops with the reference attention, the fused decode's step path or none.
    model.use_ops(TritonOps(TORCH_ATTENTION, fused_decode=fused))
    meta = metadata(ids.shape[0], past, 16)
    assert meta.positions is not None
    return model.model(ids, meta.positions, meta, intermediate)


def test_a_one_token_step_equals_the_unfused_layers(q4_tiny: LlamaForCausalLM) -> None:
    prompt = torch.randint(3, 512, (9,), device=DEVICE)
    step(q4_tiny, False, prompt, 0)  # the prompt's keys (dense weights: 9 rows)
    token = torch.tensor([77], device=DEVICE)
    unfused = step(q4_tiny, False, token, 9)
    fused = step(q4_tiny, True, token, 9)
    assert isinstance(q4_tiny.model.step_path, FusedDecodePath)  # the fused path was taken
    assert rel(fused, unfused) < 1e-5
    # Larger steps run the unfused layers: the same bits.
    two = torch.tensor([77, 78], device=DEVICE)
    assert torch.equal(step(q4_tiny, True, two, 9), step(q4_tiny, False, two, 9))


def test_a_qwen3_layer_leaves_its_qk_norms_to_the_fused_decode_attention() -> None:
    """Per-head q/k norms (Qwen3): with the fused decode's attention each
    layer hands q and k over un-normed (``norms_qk``), the split-KV kernel
    norms a decode step's and one kernel a prompt's; the model's output is
    the layers' own norms' (the same op set otherwise)."""
    import dataclasses

    from asyncstep.models.dummy import dummy_weights, get_shape
    from asyncstep.ops.triton.paged_attention import TritonAttention

    arch = dataclasses.replace(get_shape("tiny-llama"), qk_norm=True)
    model = LlamaForCausalLM(arch, torch.float32).to(DEVICE)
    weights = dict(dummy_weights(arch, seed=3, device=DEVICE))
    gen = torch.Generator().manual_seed(4)
    for name in [n for n in weights if n.endswith(("q_norm.weight", "k_norm.weight"))]:
        weights[name] = (torch.rand(weights[name].shape, generator=gen) + 0.5).to(DEVICE)
    model.load_weights(weights.items())
    prompt = torch.randint(3, 512, (9,), generator=gen).to(DEVICE)
    token = torch.tensor([77], device=DEVICE)
    cache = kv_cache_shape(4, 16, arch.num_key_value_heads, arch.head_dim)
    outs = []
    for fused in (True, False):
        model.use_ops(TritonOps(TritonAttention(rotates=True, fused_decode=fused)))
        layers = model.model.stage_layers()
        assert [layer.self_attn.attn.norms_qk for layer in layers] == [fused] * len(layers)
        for attn in model.attention_layers():
            attn.kv_cache = torch.zeros(cache, device=DEVICE)
        for ids, past in ((prompt, 0), (token, 9)):
            meta = metadata(ids.shape[0], past, 16)
            assert meta.positions is not None
            outs.append(model.model(ids, meta.positions, meta, None))
    for fused, unfused in zip(outs[:2], outs[2:], strict=True):
        assert rel(fused, unfused) < 1e-5


def test_a_received_residual_is_read_not_written(q4_tiny: LlamaForCausalLM) -> None:
    hidden, residual = torch.randn(1, 64, device=DEVICE), torch.randn(1, 64, device=DEVICE)
    kept = residual.clone()
    embed = q4_tiny.model.embed_tokens
    q4_tiny.model.embed_tokens = None  # a later stage
    try:
        outs = [
            step(
                q4_tiny,
                fused,
                torch.zeros(1, dtype=torch.long, device=DEVICE),
                9,
                IntermediateTensors({"hidden_states": hidden, "residual": residual}),
            )
            for fused in (True, False)
        ]
    finally:
        q4_tiny.model.embed_tokens = embed
    assert torch.equal(residual, kept)
    assert rel(outs[0], outs[1]) < 1e-5


def test_layers_without_packed_weights_are_not_fused(q4_tiny: LlamaForCausalLM) -> None:
    layer = q4_tiny.model.stage_layers()[0]
    assert _layer_weights(layer) is not None
    packed, layer.mlp.down_proj.packed = layer.mlp.down_proj.packed, None
    try:
        assert _layer_weights(layer) is None
        assert FusedDecodePath.build(q4_tiny.model.stage_layers()) is None
    finally:
        layer.mlp.down_proj.packed = packed
    weights = _layer_weights(layer)
    assert isinstance(weights, FusedDecodeWeights)
    assert weights.applies(torch.ones(1, 64, device=DEVICE))
    assert not weights.applies(torch.ones(2, 64, device=DEVICE))


def test_the_op_set_hands_its_activations_to_every_q4_gemv(q4_tiny: LlamaForCausalLM) -> None:
    """``int8_activations`` (``gpu_q4_activations="int8"``) reaches a packed
    layer's one-row matmul and the fused decode's GEMVs; the default op set
    multiplies 16-bit x as it is."""
    weight = pack_q4_gpu(round_to_q4_1(torch.randn(48, 128, device=DEVICE)))
    assert weight is not None
    x = torch.randn(1, 128, device=DEVICE).bfloat16()
    dense = torch.empty(0)
    as_is = TritonOps(TORCH_ATTENTION).linear(x, dense, weight)
    as_int8 = TritonOps(TORCH_ATTENTION, int8_activations=True).linear(x, dense, weight)
    assert torch.equal(as_is, q4_gemv(x, weight.data, weight.scales))
    assert torch.equal(as_int8, q4_gemv(x, weight.data, weight.scales, int8_x=True))
    assert not torch.equal(as_is, as_int8)
    layers = q4_tiny.model.stage_layers()
    for int8 in (False, True):
        ops = TritonOps(TORCH_ATTENTION, fused_decode=True, int8_activations=int8)
        path = ops.step_path(layers)
        assert isinstance(path, FusedDecodePath) and path.int8_x is int8


# -- PDL (GPU) ----------------------------------------------------------------------------


@pytest.mark.skipif(DEVICE.type != "cuda", reason="programmatic dependent launch on the GPU")
@pytest.mark.parametrize("int8_x", [False, True])
def test_pdl_leaves_the_fused_gemvs_bits_alone(
    int8_x: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four layers' fused GEMVs (bfloat16, x as it is or as int8) launched
    with PDL, each loading its first weights before it waits for the one
    before, give the bits they give launched one after another: eagerly,
    and in replays of a CUDA graph."""
    from asyncstep.ops.triton import pdl

    if not pdl.applies(torch.ones(1, device=DEVICE)):
        pytest.skip("ASYNCSTEP_PDL=0, or a GPU before compute capability 9.0")
    hidden, inter, dt = 1024, 2048, torch.bfloat16
    layers = []
    for _ in range(4):
        gate_up = random_q4(2 * inter, hidden)
        layers.append(
            (
                random_q4(hidden, hidden)[:2],
                interleave_pairs(*gate_up[:2]),
                random_q4(hidden, inter)[:2],
            )
        )
    norm_w = (torch.rand(hidden, device=DEVICE) + 0.5).to(dt)
    attn_out = (torch.randn(1, hidden, device=DEVICE) * 0.1).to(dt)
    stream0 = torch.randn(1, hidden, device=DEVICE).to(dt)

    def chain() -> torch.Tensor:
        stream, normed = stream0, None
        for o, gate_up, down in layers:
            stream, normed = q4_gemv_fused(
                attn_out, *o, residual=stream, next_rms_norm_weight=norm_w, int8_x=int8_x
            )
            assert normed is not None
            act, _ = q4_gemv_fused(
                normed.xw,
                *gate_up,
                sq_parts=normed.sq_parts,
                silu_pairs=True,
                out_dtype=dt,
                int8_x=int8_x,
            )
            stream, normed = q4_gemv_fused(
                act, *down, residual=stream, next_rms_norm_weight=norm_w, int8_x=int8_x
            )
        return stream

    expected = pdl_off_bits(chain, monkeypatch)
    graph, out = captured(chain)
    for _ in range(10):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


# -- the engine (GPU) ---------------------------------------------------------------------


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a whole engine on the GPU")
@pytest.mark.parametrize(
    ("dtype", "packing", "concurrent"),
    [("bfloat16", "q4", False), ("float32", "q4", False), ("bfloat16", "none", True)],
)
@pytest.mark.trio
async def test_the_engine_gives_the_same_greedy_tokens_fused_or_not(
    dtype: str, packing: str, concurrent: bool
) -> None:
    """One request at a time (the 4-bit layers' fused decode) or several at
    once (decode batches of several requests: the attention's fused rotary
    and KV store). (The int8 activations are not compared so: the fused
    layer quantizes ``x * weight``, the unfused one the normed row rounded
    to bfloat16, a code apart here and there, and a tiny random model's
    greedy tokens may part on that.)"""
    import trio

    import asyncstep
    from asyncstep.config import ModelConfig
    from asyncstep.models.model_loader import load_model

    base = {"model": "tiny-llama", "load_format": "dummy", "device": "cuda", "dtype": dtype}
    params = asyncstep.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 17, 301, 42], [7] * 40, list(range(3, 200))]
    outs = []
    for fused in (True, False):
        loaded = load_model(ModelConfig(**base, weight_packing=packing))
        async with asyncstep.open_engine(
            loaded,
            max_model_len=256,
            fused_decode=fused,
            max_num_seqs=4 if concurrent else 1,
            batch_invariant=False,  # the fast op set (CUDA's default for dense 16-bit is not)
        ) as engine:
            got: dict[int, list[int]] = {}

            async def one(i: int, engine: Any = engine, got: dict[int, list[int]] = got) -> None:
                got[i] = list((await engine.generate(prompts[i], params)).token_ids)

            if concurrent:
                async with trio.open_nursery() as nursery:
                    for i in range(len(prompts)):
                        nursery.start_soon(one, i)
            else:
                for i in range(len(prompts)):
                    await one(i)
            outs.append([got[i] for i in range(len(prompts))])
        if fused and packing == "q4":
            path = loaded.model.model.step_path
            assert isinstance(path, FusedDecodePath), "the fused decode did not apply"
    assert outs[0] == outs[1]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a whole engine on the GPU")
@pytest.mark.trio
async def test_the_engine_runs_int8_activations_when_its_config_asks() -> None:
    """``gpu_q4_activations="int8"``: the fused decode's GEMVs take int8 x,
    and the engine decodes whole requests on them."""
    import asyncstep
    from asyncstep.config import ModelConfig
    from asyncstep.models.model_loader import load_model

    config = ModelConfig(
        model="tiny-llama",
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        weight_packing="q4",
    )
    loaded = load_model(config)
    params = asyncstep.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    async with asyncstep.open_engine(
        loaded, max_model_len=256, max_num_seqs=1, gpu_q4_activations="int8"
    ) as engine:
        out = await engine.generate([5, 17, 301, 42], params)
    path = loaded.model.model.step_path
    assert isinstance(path, FusedDecodePath) and path.int8_x
    assert len(out.token_ids) == 24


# -- rotary + KV store inside the decode attention --------------------------------------


def rotary_cache(max_pos: int, head_dim: int) -> torch.Tensor:
    """float32 ``[max_pos, head_dim]``: cos of each position's angles, then sin."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    angles = torch.arange(max_pos).double()[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], -1).float().to(DEVICE)


def decode_step(
    contexts: list[int], num_padding: int, heads: int, kv_heads: int, dim: int, seed: int
) -> dict[str, Any]:
    """A decode batch: request r's one new token after ``contexts[r]`` cached
    keys (a context of -1: a padded request, no token), in random blocks of
    a random cache; ``num_padding`` padding tokens (slot -1) after them."""
    gen = torch.Generator().manual_seed(seed)
    block_size, num_blocks, width = 16, 64, 16
    kv_cache = torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, dim), generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.randint(0, num_blocks, (len(contexts), width), generator=gen, dtype=torch.int32)
    seq_lens, slots, positions, query_lens = [], [], [], []
    for r, context in enumerate(contexts):
        if context < 0:
            seq_lens.append(0)
            query_lens.append(0)
            continue
        blocks = [free.pop() for _ in range(context // block_size + 1)]
        table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        seq_lens.append(context + 1)
        query_lens.append(1)
        positions.append(context)
        slots.append(blocks[context // block_size] * block_size + context % block_size)
    tokens = len(positions) + num_padding
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    return {
        "positions": torch.tensor(positions + [0] * num_padding).to(DEVICE),
        "qkv": qkv.to(DEVICE),
        "kv_cache": kv_cache.to(DEVICE),
        "slot_mapping": torch.tensor(slots + [-1] * num_padding).to(DEVICE),
        "query_start_loc": torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32).to(DEVICE),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32).to(DEVICE),
        "block_table": table.to(DEVICE),
    }


@pytest.mark.parametrize(
    ("num_splits", "qk_norm"), [(1, False), (3, False), (16, False), (1, True), (3, True)]
)
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4)])
def test_rotary_and_kv_store_inside_the_decode_kernel(
    num_splits: int, qk_norm: bool, heads: int, kv_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same output and cache as rotary_and_store_kv then paged_attention
    (float32), padded requests and padding rows included; q and k are left
    unrotated; a batch that is not a uniform decode takes the two calls.
    ``qk_norm`` (Qwen3's per-head q/k norms): normed inside the kernel, as
    qk_rms_norm before the two calls norms them."""
    import dataclasses

    from asyncstep.ops.attention import QkNorm
    from asyncstep.ops.triton import attention as triton_attention
    from asyncstep.ops.triton.attention import rotary_store_and_attend

    choose = triton_attention._decode_launch
    monkeypatch.setattr(
        triton_attention,
        "_decode_launch",
        lambda *a: dataclasses.replace(choose(*a), num_splits=num_splits),
    )
    dim = 32
    # 1 key, a tile and a key (fp32 tiles: 32 keys), several segments, a padded request.
    step = decode_step([0, 32, -1, 200, 47], 1, heads, kv_heads, dim, seed=num_splits)
    cos_sin = rotary_cache(256, dim)
    norms = None
    if qk_norm:
        gen = torch.Generator().manual_seed(7)
        weights = (torch.rand(2, dim, generator=gen) + 0.5).to(DEVICE)
        norms = QkNorm(weights[0], weights[1], 1e-6)
    outs, caches = [], []
    for uniform in (True, False):
        qkv, kv_cache = step["qkv"].clone(), step["kv_cache"].clone()
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
        out = rotary_store_and_attend(
            step["positions"],
            q,
            k,
            v,
            cos_sin,
            kv_cache,
            step["slot_mapping"],
            step["query_start_loc"],
            step["seq_lens"],
            step["block_table"],
            dim**-0.5,
            uniform_decode=uniform,
            qk_norm=norms,
        )
        # Fused: q and k left as they were (normed first: a copy is rotated).
        assert torch.equal(qkv, step["qkv"]) == (uniform or qk_norm)
        outs.append(out[:4])  # the real tokens (the padding row: zeros, unfused only)
        caches.append(kv_cache)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0], caches[1], rtol=1e-6, atol=1e-6)
    assert not torch.equal(caches[0], step["kv_cache"])
    assert not triton_attention.decode_tickets(DEVICE, 1).any()  # every ticket back at zero


@pytest.mark.parametrize("num_splits", [3, 16])
def test_the_last_segment_combines_the_segments(
    num_splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The split-KV kernel's last program of each token and KV head combines
    its segments: the one-segment kernel's output to float32's rounding, a
    padding row zeros; twice in a row (the tickets reset)."""
    import dataclasses

    from asyncstep.ops.triton import attention as triton_attention
    from asyncstep.ops.triton.attention import paged_attention

    heads, kv_heads, dim = 8, 2, 32
    step = decode_step([0, 32, -1, 200, 47], 1, heads, kv_heads, dim, seed=5)
    q = step["qkv"][:, : heads * dim].reshape(-1, heads, dim)
    args = (step["kv_cache"], step["query_start_loc"], step["seq_lens"], step["block_table"])
    choose = triton_attention._decode_launch
    outs = []
    for splits in (1, num_splits, num_splits):
        monkeypatch.setattr(
            triton_attention,
            "_decode_launch",
            lambda *a, n=splits: dataclasses.replace(choose(*a), num_splits=n),
        )
        outs.append(paged_attention(q, *args, dim**-0.5, max_query_len=1))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[2], outs[1])
    assert not outs[1][-1].any()  # the padding row
    tickets = triton_attention.decode_tickets(DEVICE, 1)
    assert not tickets.any()


#: Compiles the split-KV kernel (rotary, q/k norms, sinks, the last
#: segment's combine) for sm_90 with triton's own ptxas, no GPU needed (the interpreter runs code
#: the compiler may refuse: its atomics and cache modifiers among them).
COMPILE = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from asyncstep.ops.triton import decode_kernels as d

SPLIT = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, GROUP=8, BLOCK_SIZE=16, BLOCK_M=16, TILE_N=64,
             NUM_SPLITS=12, DOT_PRECISION="tf32", ROTARY=True, SINKS=True, QK_NORM=True,
             COMBINE_LAST=True, SPLITS_PAD=16, PDL=True)
FLOATS = {"scale_log2": "fp32", "norm_eps": "fp32", "eps": "fp32"}
CASES = [
    (d._decode_split_kernel, SPLIT,
     {"q_ptr": "*bf16", "kv_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
      "lse_ptr": "*fp32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "bt_ptr": "*i32",
      "sinks_ptr": "*fp32", "cos_sin_ptr": "*fp32", "k_new_ptr": "*bf16", "v_new_ptr": "*bf16",
      "slot_ptr": "*i64", "q_norm_ptr": "*bf16", "k_norm_ptr": "*bf16",
      "tickets_ptr": "*i32"}),
]
for fn, consts, types in CASES:
    types = {**FLOATS, **types}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    out = compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                  options={"num_warps": 4, "num_stages": 1})
    print(fn.__name__, len(out.asm["cubin"]) > 0)
"""


def test_the_kernels_compile_for_sm90(tmp_path: Path) -> None:
    words = compile_for_sm90(COMPILE, tmp_path)
    names = ["_decode_split_kernel"]
    assert words == [w for name in names for w in (name, "True")]
