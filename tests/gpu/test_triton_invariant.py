"""The batch-invariant Triton op set (issue 40): a row's bits do not depend on
the step around it.

The matmul's row i alone and inside batches of 1 to 130 rows, K in one
split or several (the last one shorter), by the split programs and by a
program per tile (and against float64; its splits' order bit for bit
under the interpreter; the LM head's float32 sums); RMSNorm row-wise; the
attention's rows of one request as a whole prompt, a decode, a verify
step and two prompt chunks, beside other requests of other lengths, by
both launches (split programs + combine, and the tile loop); a whole tiny
model's logits for a prompt whole, chunked and
decoded; the op-set choice by device type. On the CPU the kernels
run under the Triton interpreter (``TRITON_INTERPRET=1``, set before triton
is imported), in float32 and float16 (its bfloat16 is not numpy's);
``ASYNCSTEP_TEST_DEVICE=cuda`` compiles them and adds bfloat16 and a real
CUDA-graph replay. Under the interpreter ``tl.dot`` sums in K order
(``row_wise_interpreted_dot``: ``tests/gpu/conftest.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch

TEST_DEVICE = os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="the Triton kernels need triton")

from asyncstep.errors import ConfigError  # noqa: E402
from asyncstep.models.layers.attention import kv_cache_shape  # noqa: E402
from asyncstep.ops import OpSet, select  # noqa: E402
from asyncstep.ops.attention import AttentionMetadata  # noqa: E402
from asyncstep.ops.torch_ref import TORCH_OPS  # noqa: E402
from asyncstep.ops.triton import invariant_attention, invariant_counters  # noqa: E402
from asyncstep.ops.triton import invariant_matmul as invariant_matmul_module  # noqa: E402
from asyncstep.ops.triton.attention import paged_attention  # noqa: E402
from asyncstep.ops.triton.invariant_attention import invariant_paged_attention  # noqa: E402
from asyncstep.ops.triton.invariant_matmul import (  # noqa: E402
    TARGET_PROGRAMS,
    TILE,
    invariant_matmul,
    launch_is_parallel,
    split_k,
)
from asyncstep.ops.triton.invariant_norm import rms_norm  # noqa: E402
from asyncstep.ops.triton.invariant_ops import TritonInvariantOps  # noqa: E402
from asyncstep.ops.triton.invariant_prompt import prompt_matmul, tma_fits  # noqa: E402

DEVICE = torch.device(TEST_DEVICE)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("ASYNCSTEP_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)


#: Under the interpreter, a dot that sums each row in K order (tests/gpu/conftest.py).
pytestmark = pytest.mark.usefixtures("row_wise_interpreted_dot")


DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
#: llama-8b's linear shapes (N, K): qkv, o, gate_up, down, the LM head.
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


# --------------------------------------------------------------------------
# matmul


#: (N, K): K in one split (three BLOCK_K chunks and a tail; N two column
#: tiles and a tail), in two splits (the last one 216 features: not a
#: multiple of BLOCK_K), in three (384, 384, 232) over three column tiles.
SHAPES = [(TILE.block_n + 11, 2 * TILE.block_k + 37), (75, 600), (130, 1000)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])  # the interpreter takes float16
def test_a_matmul_row_is_the_same_bits_in_any_batch(dtype: torch.dtype, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    rows = torch.randn(130, k, generator=gen).to(dtype).to(DEVICE)
    alone = invariant_matmul(rows[5:6], w)
    for m in (1, 3, 17, 64, 65, 130):
        at = m // 2  # row 5's values at row `at` of a batch of m rows
        batch = rows[:m].clone()
        batch[at] = rows[5]
        # Each launch (the split programs or a program per tile) and the one M picks.
        for parallel in (None, True, False):
            got = invariant_matmul(batch, w, parallel=parallel)
            assert torch.equal(got[at], alone[0]), (m, parallel)
    expected = rows.double() @ w.double().T
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    got = invariant_matmul(rows, w)
    torch.testing.assert_close(got.double(), expected, atol=tol * k**0.5, rtol=tol)


@pytest.mark.parametrize("n,k", SHAPES[1:])
def test_both_launches_sum_the_splits_in_one_order(n: int, k: int) -> None:
    """K split: the split programs and a program per tile give a whole
    batch the same bits, the tiles' counters are back to zero after the
    split programs (the next launch, a graph's next replay, counts from
    zero), and the sum is the splits' float32 partials (each its
    features' products chained in K order from zero) added in split order
    from zero: bit for bit under the interpreter (whose dot chains each
    product), within rounding on a GPU (its MMA sums a step's products in
    its own way)."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(n, k, generator=gen).to(DEVICE)
    x = torch.randn(40, k, generator=gen).to(DEVICE)
    split = split_k(n, k)
    assert split % TILE.block_k == 0 and split < k and k % split != 0
    parallel = invariant_matmul(x, w, parallel=True)
    assert torch.equal(invariant_matmul(x, w, parallel=True), parallel)
    assert torch.equal(invariant_matmul(x, w, parallel=False), parallel)
    for state in invariant_counters.COUNTERS.values():
        for counters in [*state.by_stream.values(), *state.reserve]:
            assert int(counters.count_nonzero()) == 0
    xs, ws = x.cpu().numpy(), np.ascontiguousarray(w.cpu().numpy().T)
    total = np.zeros((40, n), np.float32)
    for start in range(0, k, split):
        part = np.zeros((40, n), np.float32)
        for c in range(start, min(start + split, k)):
            part += xs[:, c, None] * ws[None, c, :]
        total = total + part
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        assert np.array_equal(parallel.cpu().numpy(), total)
    else:
        torch.testing.assert_close(parallel.cpu(), torch.from_numpy(total), atol=1e-4, rtol=1e-4)


def test_the_split_follows_the_weight_shape_alone() -> None:
    """llama-8b's decode shapes: the split programs at one row (as many
    splits as keep TARGET_PROGRAMS programs busy), a program per tile for a
    long prompt, the LM head unsplit; the split size is a function of (N, K)."""
    cpu = torch.device("cpu")
    splits = {(n, k): -(-k // split_k(n, k)) for n, k in LLAMA_8B}
    assert splits == {(6144, 4096): 2, (4096, 4096): 2, (28672, 4096): 1, (4096, 14336): 2,
                      (128256, 4096): 1}  # fmt: skip
    for (n, k), s in splits.items():
        assert -(-n // TILE.block_n) * s >= min(TARGET_PROGRAMS, n // TILE.block_n * k // 256)
        assert launch_is_parallel(1, n, k, cpu) == (s > 1)
        assert launch_is_parallel(32, n, k, cpu) == (s > 1)
        assert not launch_is_parallel(4096, n, k, cpu)
    # llama-1b's o_proj at 256 rows: 4 splits' partials would outweigh the weight.
    assert launch_is_parallel(64, 2048, 2048, cpu) and not launch_is_parallel(256, 2048, 2048, cpu)


def test_a_stream_capturing_a_graph_takes_counters_zeroed_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The split programs' counters (bookkeeping alone, on a stand-in CUDA
    device): a buffer a stream; a stream first seen in a capture takes a
    reserve buffer zeroed eagerly (one allocated in the capture would be
    zeroed only by its graph's replay), none left or no eager launch yet:
    None (the caller runs a program per tile)."""
    module = invariant_counters
    cuda = torch.device("cuda", 0)
    state = {"capturing": False, "stream": 1}
    monkeypatch.setattr(module, "COUNTERS", {})
    monkeypatch.setattr(
        module, "zeroed_counters", lambda device, size: torch.zeros(size, dtype=torch.int32)
    )
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(
        torch.cuda,
        "current_stream",
        lambda device=None: type("Stream", (), {"cuda_stream": state["stream"]}),
    )
    state["capturing"] = True
    assert module.tile_counters(cuda, 4) is None  # no eager launch yet
    state["capturing"] = False
    eager = module.tile_counters(cuda, 4)
    assert eager is not None and module.tile_counters(cuda, 4) is eager
    reserve = list(module.COUNTERS[cuda].reserve)
    assert len(reserve) == module.RESERVE
    state["capturing"] = True
    taken = []
    for stream in range(2, 2 + module.RESERVE):
        state["stream"] = stream
        taken.append(module.tile_counters(cuda, 4))
        assert module.tile_counters(cuda, 4) is taken[-1]
    assert {id(t) for t in taken} == {id(t) for t in reserve}
    state["stream"] = 99
    assert module.tile_counters(cuda, 4) is None  # the reserve is spent
    state["capturing"], state["stream"] = False, 1
    assert module.tile_counters(cuda, 4) is eager


#: Prompt tiles: PROMPT_TILES' and one of TILE's rows, wider columns.
PROMPT_TILES = [
    *(tile for _, tile in invariant_matmul_module.PROMPT_TILES),
    invariant_matmul_module.MatmulTile(64, 128, TILE.block_k, 4, 3, 3),
]


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("tile", PROMPT_TILES, ids=lambda t: f"{t.block_m}x{t.block_n}x{t.block_k}")
@pytest.mark.parametrize("dtype", [torch.float16, *DTYPES[1:]])  # 16-bit rows
def test_a_prompt_tile_gives_every_row_the_bits_of_the_decode_tile(
    monkeypatch: pytest.MonkeyPatch,
    tile: invariant_matmul_module.MatmulTile,
    dtype: torch.dtype,
    tma: bool,
) -> None:
    """A prompt-sized step's wider tile (the same splits), by TMA and
    persistent programs or by a program per tile: the whole product the
    same bits as TILE's launch, and a row the same as alone (the split
    programs), K in one split and in several. Under the interpreter the dot
    chains a chunk's products in K order for any block shape, so it checks
    the kernels' order; on CUDA, the tensor cores' own."""
    module = invariant_matmul_module
    monkeypatch.setattr(module, "_PROMPT_TILE_DEVICES", frozenset({DEVICE.type}))
    monkeypatch.setattr(module, "_PROMPT_TMA", tma)
    launches = []

    def counted(*args: object, **kwargs: object) -> None:
        launches.append(1)
        prompt_matmul(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "prompt_matmul", counted)
    gen = torch.Generator().manual_seed(11)
    fits = 0
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
        x = torch.randn(150, k, generator=gen).to(dtype).to(DEVICE)
        monkeypatch.setattr(module, "PROMPT_TILES", ())
        want = invariant_matmul(x, w, parallel=False)
        alone = invariant_matmul(x[140:141], w, parallel=True)
        monkeypatch.setattr(module, "PROMPT_TILES", ((100, tile),))
        assert module.launch_tile(150, False, DEVICE, dtype) is tile
        assert module.launch_tile(99, False, DEVICE, dtype) is TILE  # decode-sized
        assert module.launch_tile(150, True, DEVICE, dtype) is TILE  # the split programs
        got = invariant_matmul(x, w, parallel=False)
        assert torch.equal(got, want), (n, k)
        assert torch.equal(got[140], alone[0]), (n, k)
        fits += tma_fits(x, w)
    # TMA took every product whose tensors it fits (two of the three K's).
    assert fits == 2 and len(launches) == (fits if tma else 0)


def test_tma_takes_16_bit_rows_contiguous_and_16_byte_aligned() -> None:
    w = torch.zeros(64, 72, dtype=torch.float16, device=DEVICE)
    assert tma_fits(w, w[8:])
    assert not tma_fits(w.float())  # 32-bit
    assert not tma_fits(w.T)  # the rows' features not contiguous
    assert not tma_fits(w[:, 1:])  # the base 2 bytes past 16
    assert not tma_fits(torch.zeros(64, 70, dtype=torch.float16, device=DEVICE))  # 140-byte rows
    assert not tma_fits(w[0])  # not 2-D


def test_the_prompt_tiles_by_rows_and_off_cuda_the_decode_tile() -> None:
    """On CUDA, 16-bit steps of 256-1023 rows and of 1024 and more launch
    their prompt tiles (whose BLOCK_K divide TILE's: a split's chunks are
    whole); the interpreter's own dot (numpy's) rounds by block shape: off
    CUDA no step launches a prompt tile."""
    module = invariant_matmul_module
    assert "cpu" not in module._PROMPT_TILE_DEVICES
    (wide_rows, wide), (rows, narrow) = module.PROMPT_TILES
    assert (wide_rows, rows) == (1024, 256)
    assert all(TILE.block_k % t.block_k == 0 for t in (wide, narrow))
    cuda = torch.device("cuda", 0)
    tiles = [module.launch_tile(m, False, cuda, torch.bfloat16) for m in (255, 256, 1023, 1024)]
    assert tiles == [TILE, narrow, narrow, wide]
    for dtype in (torch.float32, torch.bfloat16):
        assert module.launch_tile(4096, False, torch.device("cpu"), dtype) is TILE
    # float32's blocks would outgrow an SM's shared memory: TILE on CUDA too.
    assert module.launch_tile(4096, False, cuda, torch.float32) is TILE


@pytest.mark.parametrize("dtype", [torch.float16, *DTYPES[1:]])
def test_the_logits_of_16_bit_rows_are_their_float32_sums(dtype: torch.dtype) -> None:
    """The LM head: 16-bit x and weight, float32 out, the float32 total
    (not rounded to 16 bits), the same bits at any M, either launch."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(150, 700, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(20, 700, generator=gen).to(dtype).to(DEVICE)
    alone = invariant_matmul(x[7:8], w, torch.float32)
    assert alone.dtype == torch.float32
    for parallel in (None, True, False):
        assert torch.equal(invariant_matmul(x, w, torch.float32, parallel=parallel)[7], alone[0])
    expected = x.double() @ w.double().T
    got = invariant_matmul(x, w, torch.float32)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)
    assert not torch.equal(got, got.to(dtype).float())  # float32's bits, not 16 bits'


# --------------------------------------------------------------------------
# RMSNorm


def test_rms_norm_is_per_row_and_matches_torch() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 300, generator=gen).to(DEVICE)
    weight = torch.randn(300, generator=gen).to(DEVICE)
    full = rms_norm(x, weight, 1e-6)
    for i, m in ((0, 1), (4, 3), (8, 9)):
        assert torch.equal(rms_norm(x[i : i + m], weight, 1e-6)[0], full[i])
    expected = torch.nn.functional.rms_norm(x.double(), (300,), weight.double(), 1e-6)
    torch.testing.assert_close(full.double(), expected, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------
# attention

HEADS, KV_HEADS, DIM, BLOCK, NUM_BLOCKS, TABLE_WIDTH = 4, 2, 16, 8, 64, 12
#: Keys per split in these tests (a multiple of every key tile: 32 keys in
#: float32, 64 in 16 bits): two splits for the 70-key request, so the fold
#: is exercised.
SPLIT = 64


@dataclass
class Requests:
    """Whole sequences in one cache: each request's queries, keys in their
    blocks (a random block table row), so a step can take any slice."""

    q: list[torch.Tensor]  # per request [seq_len, heads, dim]
    kv_cache: torch.Tensor
    table: torch.Tensor  # [requests, TABLE_WIDTH] int32

    def inputs(self, parts: list[tuple[int, int, int]], padding: int = 0) -> list[torch.Tensor]:
        """q, query_start_loc, seq_lens and the block table of a step of
        ``(request, first position, query count)`` parts (a request's keys
        up to its last query in the cache), then ``padding`` rows."""
        q = torch.cat([self.q[r][p : p + n] for r, p, n in parts])
        q = torch.cat([q, torch.zeros(padding, HEADS, DIM, dtype=q.dtype)])
        qsl = torch.tensor([0] + [n for _, _, n in parts], dtype=torch.int32).cumsum(0)
        seq_lens = torch.tensor([p + n for _, p, n in parts], dtype=torch.int32)
        table = self.table[[r for r, _, _ in parts]]
        return [t.to(DEVICE) for t in (q, qsl.to(torch.int32), seq_lens, table)]

    def attend(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        q, qsl, seq_lens, table = inputs
        return invariant_paged_attention(q, self.kv_cache, qsl, seq_lens, table, DIM**-0.5)

    def step(self, parts: list[tuple[int, int, int]], padding: int = 0) -> torch.Tensor:
        """The step's attention, its output rows in the parts' order."""
        return self.attend(self.inputs(parts, padding))


def make_requests(seq_lens: list[int], dtype: torch.dtype) -> Requests:
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(kv_cache_shape(NUM_BLOCKS, BLOCK, KV_HEADS, DIM), generator=gen)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    table = torch.randint(0, NUM_BLOCKS, (len(seq_lens), TABLE_WIDTH), generator=gen)
    for r, s in enumerate(seq_lens):
        table[r, : -(-s // BLOCK)] = torch.tensor([free.pop() for _ in range(-(-s // BLOCK))])
    q = [torch.randn(s, HEADS, DIM, generator=gen).to(dtype) for s in seq_lens]
    return Requests(q, cache.to(dtype).to(DEVICE), table.to(torch.int32))


def use_launch(monkeypatch: pytest.MonkeyPatch, parallel: bool) -> None:
    """The test's split size, and the split programs + combine (``parallel``)
    or the tile loop."""
    monkeypatch.setattr(invariant_attention, "SPLIT_KEYS", SPLIT)
    monkeypatch.setattr(invariant_attention, "MAX_SCRATCH_BYTES", 1 << 40 if parallel else 0)


#: (split programs, dtype): both launches in float32 and in the GPU's
#: bfloat16; float16 (which the interpreter takes) by the tile loop.
LAUNCHES = [(True, torch.float32), (False, torch.float32), (False, torch.float16)]
if DEVICE.type == "cuda":
    LAUNCHES += [(True, torch.bfloat16), (False, torch.bfloat16), (True, torch.float16)]


@pytest.mark.parametrize("parallel,dtype", LAUNCHES)
def test_a_query_is_the_same_bits_however_its_request_comes(
    monkeypatch: pytest.MonkeyPatch, parallel: bool, dtype: torch.dtype
) -> None:
    use_launch(monkeypatch, parallel)
    # Request 0 (70 keys: two splits) beside requests of other lengths.
    reqs = make_requests([70, 41, 50, 7], dtype)
    whole = reqs.step([(0, 0, 70)])  # the whole prompt alone
    others = [(1, 40, 1), (2, 30, 9), (3, 0, 7)]
    # A decode among a decode, a prompt chunk and a short prompt; padding after.
    decode = reqs.step([others[0], (0, 69, 1), *others[1:]], padding=3)
    assert torch.equal(decode[1], whole[69])
    assert bool((decode[-3:] == 0).all())
    # A verify step: 4 queries of request 0, other requests around.
    verify = reqs.step([others[1], (0, 60, 4), others[0]])
    assert torch.equal(verify[9:13], whole[60:64])
    # Two prompt chunks over the cached prefix, in steps with others.
    first = reqs.step([(0, 0, 40), others[2]])
    second = reqs.step([others[1], (0, 40, 30)])
    assert torch.equal(first[:40], whole[:40])
    assert torch.equal(second[9:], whole[40:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_both_launches_give_the_same_bits_and_the_values(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """A step's size picks the launch (the scratch it needs): the same bits
    either way."""
    reqs = make_requests([70, 41, 50], dtype)
    step = [(0, 50, 20), (1, 40, 1), (2, 30, 9)]
    use_launch(monkeypatch, True)
    split_programs = reqs.step(step)
    use_launch(monkeypatch, False)
    assert torch.equal(reqs.step(step), split_programs)
    # The values: the existing kernel (another order) within rounding.
    q = torch.cat([reqs.q[r][p : p + n] for r, p, n in step]).to(DEVICE)
    qsl = torch.tensor([0, 20, 21, 30], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([70, 41, 39], dtype=torch.int32, device=DEVICE)
    table = reqs.table.to(DEVICE)
    expected = paged_attention(q, reqs.kv_cache, qsl, seq_lens, table, DIM**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(split_programs, expected, atol=tol, rtol=tol)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("parallel", [True, False])
def test_a_cuda_graph_replays_with_new_metadata(
    monkeypatch: pytest.MonkeyPatch, parallel: bool
) -> None:
    """The attention and the matmul captured once replay other steps of the
    same shapes bit for bit (the launch reads only shapes on the host); the
    matmul's split programs too (K split: the capture stream's tile
    counters, from the reserve zeroed eagerly, are back to zero after each
    replay)."""
    use_launch(monkeypatch, parallel)
    reqs = make_requests([70, 41, 50, 7], torch.bfloat16)
    a = reqs.inputs([(0, 69, 1), (1, 40, 1), (2, 30, 4)], padding=2)
    b = reqs.inputs([(1, 40, 1), (0, 50, 1), (3, 3, 4)], padding=2)
    w = torch.randn(40, 16 * HEADS, device=DEVICE).to(torch.bfloat16)
    w_split = torch.randn(96, 16 * 16 * HEADS, device=DEVICE).to(torch.bfloat16)
    assert launch_is_parallel(8, 96, w_split.shape[1], DEVICE)

    def project(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = out.view(out.shape[0], -1)
        return (
            invariant_matmul(rows, w, torch.float32),
            invariant_matmul(rows.repeat(1, 16), w_split),
        )

    static = [t.clone() for t in a]
    project(reqs.attend(static))  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = reqs.attend(static)
        logits, split = project(out)
    for inputs in (a, b, a):
        for target, source in zip(static, inputs, strict=True):
            target.copy_(source)
        graph.replay()
        torch.cuda.synchronize()
        eager = reqs.attend(inputs)
        assert torch.equal(out, eager)
        eager_logits, eager_split = project(eager)
        assert torch.equal(logits, eager_logits) and torch.equal(split, eager_split)


# --------------------------------------------------------------------------
# a whole model


def one_request(tokens: int, past: int) -> AttentionMetadata:
    """One request's ``tokens`` new tokens after ``past`` cached ones, blocks 0, 1, ..."""
    total, qsl = past + tokens, np.array([0, tokens], dtype=np.int32)
    return AttentionMetadata(
        num_actual_tokens=tokens,
        num_decodes=0,
        query_start_loc=torch.from_numpy(qsl).to(DEVICE),
        seq_lens=torch.tensor([total], dtype=torch.int32, device=DEVICE),
        block_table=torch.arange(-(-total // BLOCK), dtype=torch.int32, device=DEVICE)[None],
        slot_mapping=torch.arange(past, total, device=DEVICE),
        max_query_len=tokens,
        max_seq_len=total,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=np.array([total]),
        positions=torch.arange(past, total, device=DEVICE),
    )


def test_a_model_gives_a_position_the_same_logits_whole_chunked_or_decoded() -> None:
    """The tiny Llama on the op set: a prompt whole, and in two chunks then
    its last token as a decode, give each position the same float32 logits
    (and the reference's, within rounding)."""
    from asyncstep.models.dummy import dummy_weights, get_shape
    from asyncstep.models.llama import LlamaForCausalLM
    from asyncstep.ops.torch_ref import TORCH_OPS

    arch = get_shape("tiny-llama")
    model = LlamaForCausalLM(arch, torch.float32).to(DEVICE)
    model.load_weights(dummy_weights(arch, seed=0, device=DEVICE))
    ids = torch.randint(3, arch.vocab_size, (12,), device=DEVICE)

    def run(ops: OpSet, chunks: list[int]) -> torch.Tensor:
        model.use_ops(ops)
        shape = kv_cache_shape(2, BLOCK, arch.num_key_value_heads, arch.head_dim)
        for attn in model.attention_layers():
            attn.kv_cache = torch.zeros(shape, device=DEVICE)
        rows, past = [], 0
        for n in chunks:
            meta = one_request(n, past)
            assert meta.positions is not None
            hidden = model.model(ids[past : past + n], meta.positions, meta, None)
            rows.append(model.compute_logits(hidden))
            past += n
        return torch.cat(rows)

    invariant = TritonInvariantOps()
    whole = run(invariant, [12])
    assert whole.dtype == torch.float32
    assert torch.equal(run(invariant, [7, 4, 1]), whole)  # two chunks, then a decode
    torch.testing.assert_close(whole, run(TORCH_OPS, [12]), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------
# selection


def test_batch_invariant_picks_the_invariant_op_set_on_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    ops = select.select_ops(cuda, "triton", fused_kernels=True, batch_invariant=True)
    assert isinstance(ops, TritonInvariantOps) and ops.step_path([]) is None
    assert ops.attention_op.name == "triton-invariant" and ops.rotates_in_kv_store
    # None: the device's default; on CUDA where the invariant op set fits the
    # model, on a GPU where its cost was measured within 10 %.
    assert select.BATCH_INVARIANT_DEFAULT == {"cpu": True, "cuda": True}
    assert {"NVIDIA H100 80GB HBM3"} == select.CUDA_INVARIANT_DEVICES
    assert select.resolve_batch_invariant(None, cpu, fits_cuda_default=False)
    assert not select.resolve_batch_invariant(None, torch.device("mps"))
    assert select.resolve_batch_invariant(True, cuda, fits_cuda_default=False)
    for measured in (True, False):
        monkeypatch.setattr(select, "measured_cuda_device", lambda device, m=measured: m)
        assert select.resolve_batch_invariant(None, cuda) is measured
        assert not select.resolve_batch_invariant(None, cuda, fits_cuda_default=False)
        default = select.select_ops(cuda, "triton", fused_kernels=True)
        assert isinstance(default, TritonInvariantOps) is measured
        for fused_decode in (False, True):  # packed weights or experts: the Triton op set
            packed = select.select_ops(
                cuda, "triton", fused_kernels=True, fused_decode=fused_decode, dense_16_bit=False
            )
            assert not isinstance(packed, TritonInvariantOps)
        # The fused kernels asked away or the torch attention: not by default.
        unfused = select.select_ops(cuda, "triton", fused_kernels=False)
        assert not isinstance(unfused, TritonInvariantOps)
        assert select.select_ops(cuda, "torch", fused_kernels=True) is TORCH_OPS
    fast = select.select_ops(cuda, "triton", fused_kernels=True, batch_invariant=False)
    assert not isinstance(fast, TritonInvariantOps)
    # On the CPU the CPU's op set stays (its kernels are invariant already).
    on_cpu = select.select_ops(cpu, "torch", fused_kernels=False, batch_invariant=True)
    assert not isinstance(on_cpu, TritonInvariantOps)
    with pytest.raises(ConfigError, match="triton attention"):
        select.select_ops(cuda, "torch", fused_kernels=True, batch_invariant=True)
    monkeypatch.setattr(select, "triton_available", lambda: False)
    with pytest.raises(ConfigError, match="needs triton"):
        select.select_ops(cuda, "triton", fused_kernels=True, batch_invariant=True)


def test_the_op_set_runs_its_matmul_norms_and_attention() -> None:
    ops = TritonInvariantOps()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 32, generator=gen).to(DEVICE)
    w = torch.randn(8, 32, generator=gen).to(DEVICE)
    bias = torch.randn(8, generator=gen).to(DEVICE)
    assert torch.equal(ops.linear(x, w, None, bias), invariant_matmul(x, w) + bias)
    assert ops.logits(x, w, None).dtype == torch.float32
    norm_w = torch.randn(32, generator=gen).to(DEVICE)
    normed, stream = ops.add_rms_norm(
        x, None, norm_w, 1e-6, float32_residual=False, own_residual=False
    )
    assert stream is x and torch.equal(normed, rms_norm(x, norm_w, 1e-6))
    assert torch.equal(
        ops.rms_norm(x, norm_w, 1e-6, float32_residual=False), rms_norm(x, norm_w, 1e-6)
    )


@pytest.mark.parametrize("value", [None, True, False])
def test_the_engine_option_reaches_the_op_set_choice(
    monkeypatch: pytest.MonkeyPatch, value: bool | None
) -> None:
    """``batch_invariant`` goes from the engine's config to every
    ``select_ops`` call of the runner (the CPU's choice ignores it)."""
    from asyncstep.config import ModelConfig
    from asyncstep.engine.front_end.api import make_config
    from asyncstep.models.model_loader import load_model
    from asyncstep.runner import build, model_runner

    seen: list[bool | None] = []
    choose = model_runner.select_ops

    def recording(*args: object, **kwargs: object) -> OpSet:
        seen.append(kwargs.get("batch_invariant"))  # type: ignore[arg-type]
        return choose(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(model_runner, "select_ops", recording)
    loaded = load_model(
        ModelConfig(model="tiny-llama", load_format="dummy", device="cpu", dtype="float32")
    )
    config = make_config(max_model_len=64, max_num_batched_tokens=64, batch_invariant=value)
    build.build_runner(config, loaded)
    assert seen == [value]
