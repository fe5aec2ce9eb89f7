"""The CPU library's quantized matmuls (``cpu_quant.c``) and decoder stack
(``cpu_decode.c``): the packers keep exactly what a GGUF's Q4_0 / Q4_1 /
Q8_0 tensor holds (and refuse anything else); the matmul computes what its
contract says (activations quantized per block of 32, one or two levels)
for every tile height and output width, in the vector build (AVX512-VNNI or
AVX2) and in the plain C
build alike; the stack gives the layer-by-layer forward's tokens."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from gguf_weights import q4_0_weight, q4_1_weight, q8_0_weight

import asyncstep
from asyncstep import SamplingParams
from asyncstep.config import ModelConfig
from asyncstep.cpu_features import cpu_flags
from asyncstep.models.model_loader import LoadedModel, load_model, pack_weights
from asyncstep.ops.cpu.decode_stack import CpuDecodeStack
from asyncstep.ops.cpu.library import load_cpu_kernels
from asyncstep.ops.cpu.quant import (
    CpuQuantMatmul,
    CpuQuantWeight,
    pack_q4_cpu,
    pack_q8_cpu,
    quant_matmul,
)

KERNELS = load_cpu_kernels()
MATMUL = quant_matmul()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler: the library is off")
BLOCK = 32


def quantized_reference(x: torch.Tensor, weight: torch.Tensor, levels: int) -> torch.Tensor:
    """The kernel's contract in float64: x quantized per block of 32 to int8
    (nearest even, scale max|x| / 127; a second level quantizes the
    remainder with 1/256 of that scale, codes clamped to +-127), times the
    weight exactly."""
    rows, cols = x.shape
    rest = x.float().reshape(rows, cols // BLOCK, BLOCK)
    rebuilt = torch.zeros_like(rest, dtype=torch.float64)
    scale = rest.abs().amax(dim=-1, keepdim=True) / 127
    for level in range(levels):
        if level:
            scale = scale / 256
        codes = torch.round(rest * torch.where(scale > 0, 1 / scale, torch.zeros_like(scale)))
        if level:
            codes = codes.clamp(-127, 127)
        rebuilt += codes.double() * scale.double()
        rest = torch.addcmul(rest, scale, codes, value=-1)
    return rebuilt.reshape(rows, cols) @ weight.double().T


def assert_matches_contract(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, levels: int
) -> None:
    ref = quantized_reference(x, weight, levels)
    # float32 sums of float32 products: a few ulps of the sum of magnitudes;
    # a bfloat16 output rounds to 8 bits of mantissa.
    magnitude = x.abs().double() @ weight.abs().double().T
    rtol = 2**-8 if out.dtype == torch.bfloat16 else 1e-5
    assert ((out.double() - ref).abs() <= rtol * magnitude + 1e-6).all()


PACKERS = {
    "q4_1": (q4_1_weight, pack_q4_cpu),
    "q4_0": (q4_0_weight, pack_q4_cpu),
    "q8_0": (q8_0_weight, pack_q8_cpu),
}


@pytest.mark.parametrize("kind", PACKERS)
@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_matmul_computes_its_contract(kind: str, levels: int, dtype: torch.dtype) -> None:
    """Every tile height (rows 1..25 cross the tiles of 12 rows of the
    AVX-512 build and of 8 and 4 of the AVX2 build) and an output width
    that is not a multiple of 16."""
    make, pack = PACKERS[kind]
    weight = make(40, 96)
    packed = pack(weight, dtype, 32, levels)
    assert packed is not None and packed.levels == levels
    for rows in (1, 2, 3, 4, 5, 8, 9, 12, 13, 17, 25):
        x = torch.randn(rows, 96).to(dtype)
        out = packed.mm(x)
        assert out.dtype == dtype and out.shape == (rows, 40)
        assert_matches_contract(out, x, weight, levels)


def test_two_levels_come_within_bfloat16_rounding_of_the_dense_product() -> None:
    weight = q4_1_weight(64, 576)
    x = torch.randn(4, 576)
    dense = x @ weight.T
    scale = dense.abs().max()
    errors = {}
    for levels in (1, 2):
        packed = pack_q4_cpu(weight, torch.float32, 8, levels)
        assert packed is not None
        errors[levels] = float((packed.mm(x) - dense).abs().max() / scale)
    assert errors[2] < 2**-9 < errors[1]  # int8 activations alone: ~2^-8 of the largest output


def test_a_mix_of_q4_0_and_q4_1_blocks_packs() -> None:
    weight = torch.cat([q4_1_weight(16, 64), q4_0_weight(16, 64)])
    packed = pack_q4_cpu(weight, torch.float32, 8)
    assert packed is not None
    x = torch.randn(3, 64)
    assert_matches_contract(packed.mm(x), x, weight, packed.levels)


@pytest.mark.parametrize(
    "weight",
    [
        torch.randn(32, 64),  # on no grid
        q4_1_weight(32, 64).double(),  # not float32
        q4_1_weight(32, 96)[:, :80].contiguous(),  # columns not whole blocks
        q4_1_weight(32, 64) * 1e5,  # a scale past float16
        torch.empty(0, 64),
    ],
    ids=["dense", "float64", "ragged", "overflow", "empty"],
)
def test_what_is_not_a_gguf_block_stays_dense(weight: torch.Tensor) -> None:
    assert pack_q4_cpu(weight, torch.float32, 8) is None
    assert pack_q8_cpu(weight, torch.float32, 8) is None


def test_a_4_bit_weight_is_no_8_bit_one_and_back() -> None:
    """Q8 packing wants 127 at each block's largest magnitude; Q4 a 4-bit grid."""
    assert pack_q8_cpu(q4_1_weight(16, 64), torch.float32, 8) is None
    assert pack_q4_cpu(q8_0_weight(16, 64), torch.float32, 8) is None


def test_bad_inputs_are_refused_in_one_line() -> None:
    packed = pack_q8_cpu(q8_0_weight(16, 64), torch.float32, 8)
    assert packed is not None
    with pytest.raises(ValueError, match="features"):
        packed.mm(torch.randn(2, 32))
    with pytest.raises(ValueError, match="float32 or bfloat16 rows"):
        packed.mm(torch.randn(2, 64).half())
    with pytest.raises(ValueError, match="float32 or bfloat16 rows"):
        packed.mm(torch.randn(64, 2).T)
    assert packed.mm(torch.randn(0, 64)).shape == (0, 16)


#: Other builds of cpu_quant.c alone: the flags, the ISA it must report, and
#: the CPU flags it needs to run here.
BUILDS = {
    "plain C": (["-O2", "-mno-avx512vnni"], set()),
    "AVX2": (["-O3", "-mavx2", "-mfma", "-mf16c", "-mno-avx512f"], {"avx2", "fma", "f16c"}),
}


def other_build(isa: str, tmp_path: Path) -> CpuQuantMatmul:
    """cpu_quant.c alone, built for the baseline x86-64 (its plain C path)
    or for AVX2 (CI's machine), skipped where this CPU cannot run it."""
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    flags, needs = BUILDS[isa]
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU does not run the {isa} build")
    source = Path(asyncstep.__file__).parent / "ops/cpu/cpu_quant.c"
    target = tmp_path / "cpu_quant_other.so"
    subprocess.run(
        [compiler, *flags, "-std=gnu11", "-fPIC", "-shared", str(source), "-o", str(target)],
        check=True,
        capture_output=True,
    )
    return CpuQuantMatmul(ctypes.CDLL(str(target)))


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("kind", PACKERS)
def test_other_builds_give_what_the_vector_build_gives(
    kind: str, levels: int, isa: str, tmp_path: Path
) -> None:
    other = other_build(isa, tmp_path)
    assert other.isa == isa
    make, pack = PACKERS[kind]
    weight = make(48, 128)
    packed = pack(weight, torch.float32, 8, levels)
    assert packed is not None
    x = torch.randn(13, 128)
    out = other(packed, x)
    assert_matches_contract(out, x, weight, packed.levels)
    assert KERNELS is not None
    assert MATMUL is not None
    torch.testing.assert_close(out, MATMUL(packed, x), rtol=1e-5, atol=1e-6)


#: Rows a row is computed among: tiles of 12 (AVX-512) and 8 / 4 (AVX2), and
#: chunks of rows (about 256 KB of codes: 216 rows at K = 576, two levels)
#: that every group passes over in turn, a ragged last chunk included.
BATCHES = (2, 13, 216, 217, 500, 2048)
#: Where the checked rows sit in each batch: first, last, tile and chunk edges.
PICKS = (0, 1, 11, 12, 215, 216, 499, 2047)


def among_others(matmul: CpuQuantMatmul, packed: CpuQuantWeight, x: torch.Tensor) -> None:
    """Each picked row's output alone equals its output in every batch, bit
    for bit (float32 and bfloat16 outputs)."""
    for dtype in (torch.float32, torch.bfloat16):
        alone = {i: matmul(packed, x[i : i + 1], dtype) for i in PICKS}
        for batch in BATCHES:
            for start in (0, len(x) - batch):  # the row at another place in the batch
                out = matmul(packed, x[start : start + batch], dtype)
                for i in PICKS:
                    if start <= i < start + batch:
                        assert torch.equal(out[i - start : i - start + 1], alone[i]), (batch, i)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a_row_gets_the_same_bits_alone_and_among_2048(
    kind: str, levels: int, threads: int
) -> None:
    """The library's build (OpenMP: its threads split the groups of each chunk of rows)."""
    assert MATMUL is not None
    make, pack = PACKERS[kind]
    weight = make(40, 576)
    packed = pack(weight, torch.float32, 4096, levels)
    assert packed is not None
    x = torch.randn(2048, 576)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        among_others(MATMUL, packed, x)
        one = MATMUL(packed, x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(MATMUL(packed, x), one)  # 1 thread against the default
    assert_matches_contract(one[:64], x[:64], weight, levels)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("levels", [1, 2])
def test_other_builds_keep_a_row_alone_and_among_2048_and_give_the_same_bits(
    isa: str, levels: int, tmp_path: Path
) -> None:
    """The plain C and AVX2 builds: invariant, and bit for bit the vector
    build's (integer sums, then the same float32 operations in one order)."""
    other = other_build(isa, tmp_path)
    weight = q4_1_weight(40, 576)
    packed = pack_q4_cpu(weight, torch.float32, 4096, levels)
    assert packed is not None and MATMUL is not None
    x = torch.randn(2048, 576)
    among_others(other, packed, x)
    assert torch.equal(other(packed, x), MATMUL(packed, x))


# ---- the decoder stack -------------------------------------------------------------


@pytest.fixture(scope="module")
def stacked_smollm2() -> LoadedModel:
    """The embedded model in fp32 with its weights packed by hand (the
    loader keeps an explicit float32 model dense)."""
    loaded = load_model(ModelConfig(device="cpu", dtype="float32"))
    pack_weights(loaded.model, torch.float32, max_tokens=8)
    return loaded


QUESTIONS = ["What is the capital of France?", "Name three colors.", "Hi"]
#: Largest difference of a chosen token's log-prob, stack against layers
#: (the same quantized matmuls; the layers round nothing in fp32 either, but
#: sum in another order).
LOGPROB_TOLERANCE = 1e-3


async def greedy(loaded: LoadedModel, stack: bool) -> list[asyncstep.Completion]:
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=1)
    async with asyncstep.open_engine(loaded, max_model_len=512, max_num_seqs=4) as engine:
        assert isinstance(loaded.model.model.step_path, CpuDecodeStack) == (
            MATMUL is not None and MATMUL.fast
        )
        if not stack:
            loaded.model.model.step_path = None
        tasks: list[Any] = [None] * len(QUESTIONS)

        async def one(i: int) -> None:
            tasks[i] = await engine.generate([{"role": "user", "content": QUESTIONS[i]}], params)

        async with trio.open_nursery() as nursery:  # decodes of 2-3 requests a step too
            for i in range(len(QUESTIONS)):
                nursery.start_soon(one, i)
        return tasks


@pytest.mark.trio
async def test_the_stack_gives_the_layer_by_layer_tokens(
    stacked_smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    if MATMUL is None or not MATMUL.fast:
        pytest.skip("the stack runs on the vector build only (AVX512-VNNI or AVX2)")
    calls: list[int] = []
    original = CpuDecodeStack.__call__

    def counted(self: CpuDecodeStack, hidden: torch.Tensor, *args: Any) -> Any:
        calls.append(hidden.shape[0])
        return original(self, hidden, *args)

    monkeypatch.setattr(CpuDecodeStack, "__call__", counted)
    stacked = await greedy(stacked_smollm2, stack=True)
    assert calls and max(calls) <= 8 and len(set(calls)) > 1  # batch-1 and batch-3 decodes
    calls.clear()
    layered = await greedy(stacked_smollm2, stack=False)
    assert not calls
    for s, layer in zip(stacked, layered, strict=True):
        assert s.token_ids == layer.token_ids
        assert s.logprobs is not None and layer.logprobs is not None
        for a, b in zip(s.logprobs, layer.logprobs, strict=True):
            assert abs(a.logprobs[0] - b.logprobs[0]) <= LOGPROB_TOLERANCE


def test_the_stack_is_not_built_for_dense_weights(smollm2: LoadedModel) -> None:
    assert KERNELS is not None
    assert CpuDecodeStack.build(KERNELS, smollm2.model.model.stage_layers()) is None


def test_packed_weights_record_their_kind(stacked_smollm2: LoadedModel) -> None:
    layer = stacked_smollm2.model.model.stage_layers()[0]
    packed = layer.mlp.down_proj.packed
    assert isinstance(packed, CpuQuantWeight) == bool(MATMUL and MATMUL.fast)
