"""Attention sinks (gpt-oss) op by op: the torch reference and the CPU
library's kernel against dense attention in float64 whose softmax has each
head's sink logit in its denominator (transformers'
``eager_attention_forward``), with and without a sliding window, decodes
mixed with prompt chunks, grouped-query heads, sinks of moderate and of
huge (+/- 1e4) magnitude; the kernel's rows of a sink layer the same bits
alone and in a batch (a prompt chunk's rows as decodes too), windowed or
not; the CPU decode stack takes sink layers. The Triton ops' are in
``tests/gpu/test_triton_sinks.py``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from asyncstep.models.layers.attention import plan_decode_buckets
from asyncstep.ops.attention import AttentionShape
from asyncstep.ops.cpu.attention import CpuPagedAttention, CpuStepArgs
from asyncstep.ops.cpu.library import load_cpu_kernels
from asyncstep.ops.cpu.paged_attention import CpuAttention, cpu_step_args
from asyncstep.ops.torch_attention import TORCH_ATTENTION
from tests.models.test_cpu_attention import PagedStep, make_step, tolerance
from tests.models.test_sliding_window_ops import windowed_step

HEADS = 6
#: Per query head: moderate logits, and logits that swamp every score or
#: vanish beside them.
SINKS = {
    "moderate": torch.linspace(-2.0, 3.0, HEADS),
    "huge": torch.tensor([1e4, -1e4, 40.0, -40.0, 0.0, 8.0]),
    "-inf": torch.tensor([-torch.inf, 0.0, -torch.inf, 1.0, -torch.inf, -torch.inf]),
}


def dense_with_sinks(step: PagedStep, window: int | None, sinks: torch.Tensor) -> torch.Tensor:
    qsl, outs = step.meta.query_start_loc_cpu, []
    for r, (k, v) in enumerate(zip(step.full_k, step.full_v, strict=True)):
        q = step.q[qsl[r] : qsl[r + 1]].double().view(-1, step.heads, step.dim)
        group = step.heads // k.shape[1]
        k = k.double().repeat_interleave(group, 1)
        v = v.double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * step.scale
        q_len, seq = q.shape[0], k.shape[0]
        ones = torch.ones(q_len, seq, dtype=torch.bool)
        mask = ones.tril(seq - q_len)
        if window is not None:
            mask &= ones.triu(seq - q_len - window + 1)
        scores = scores.masked_fill(~mask, float("-inf"))
        sink = sinks.double().view(-1, 1, 1).expand(-1, q_len, 1)
        probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
        outs.append(torch.einsum("hqk,khd->qhd", probs, v).flatten(1))
    return torch.cat(outs)


def run(
    op: object, step: PagedStep, window: int | None, sinks: torch.Tensor, planned: bool
) -> torch.Tensor:
    shape = AttentionShape(
        step.heads, step.k.shape[1] // step.dim, step.dim, step.scale, window, sinks
    )
    meta = step.meta
    if planned:
        meta.decode_buckets = plan_decode_buckets(
            meta.seq_lens_cpu[: meta.num_decodes], meta.block_table, step.kv_cache.shape[3], 2, 1
        )
    return op(step.q, step.k, step.v, step.kv_cache, meta, shape, None)  # type: ignore[operator]


@pytest.fixture(scope="module")
def kernel() -> CpuPagedAttention:
    loaded = load_cpu_kernels()
    if loaded is None:
        pytest.skip("the CPU kernels do not build here (no C compiler)")
    return loaded.attention


@pytest.mark.parametrize("sinks", list(SINKS))
@pytest.mark.parametrize("window", [None, 8, 5])
def test_reference_sinks_match_dense_attention(window: int | None, sinks: str) -> None:
    step = windowed_step(torch.float32, window or 10_000, 4)
    out = run(TORCH_ATTENTION, step, window, SINKS[sinks], planned=True)
    expected = dense_with_sinks(step, window, SINKS[sinks])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sinks", list(SINKS))
@pytest.mark.parametrize("window", [None, 8, 5])
def test_cpu_kernel_sinks_match_dense_attention(
    kernel: CpuPagedAttention, window: int | None, sinks: str, dtype: torch.dtype
) -> None:
    """The kernel (no reference inside: the op is the kernel's call) on
    decodes and prompt chunks over a cached prefix, 3 query heads a KV
    head, the blocks before each window poisoned."""
    step = windowed_step(dtype, window or 10_000, 4)
    out = run(CpuAttention(kernel), step, window, SINKS[sinks], planned=False)
    expected = dense_with_sinks(step, window, SINKS[sinks])
    torch.testing.assert_close(out.double(), expected, **tolerance(dtype))


def attend_alone(
    kernel: CpuPagedAttention,
    step: PagedStep,
    req: int,
    rows: slice,
    window: int | None,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Request ``req``'s query rows ``rows`` (of its chunk; their keys
    already stored) as a step of their own: the rows' last one sees the
    request's whole sequence, so a single row is that position's decode."""
    qsl = step.meta.query_start_loc_cpu
    begin = int(qsl[req])
    first, last = begin + rows.start, begin + rows.stop
    drop = int(qsl[req + 1]) - last  # the chunk's tokens after these rows
    n = last - first
    args = CpuStepArgs.build(
        n,
        torch.tensor([0, n], dtype=torch.int32),
        step.meta.seq_lens[req : req + 1] - drop,
        step.meta.block_table[req : req + 1],
        step.meta.slot_mapping[first:last],
    )
    out = torch.empty(n, step.q.shape[1], dtype=step.q.dtype)
    q = step.q[first:last]
    kernel(out, q, None, None, step.kv_cache, args, step.scale, None, 1, window, sinks)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 70])
def test_a_sink_row_has_the_same_bits_alone_and_in_a_batch(
    kernel: CpuPagedAttention, window: int | None, dtype: torch.dtype
) -> None:
    """Batch invariance (docs/architecture.md): the batch on 2 threads,
    then each request alone on one, and rows of a prompt chunk as decodes
    and as shorter chunks: the same bits (the sink starts each row's
    softmax, then the keys in fixed chunks in position order)."""
    step = make_step(
        [1, 1, 37, 1, 20], [300, 70, 130, 5, 0],
        heads=HEADS, kv_heads=2, dim=32, block=16, dtype=dtype, seed=5,
    )  # fmt: skip
    sinks = SINKS["moderate"]
    batch = torch.empty_like(step.q)
    kernel(
        batch, step.q, step.k, step.v, step.kv_cache, cpu_step_args(step.meta), step.scale,
        None, 2, window, sinks,
    )  # fmt: skip
    torch.testing.assert_close(
        batch.double(), dense_with_sinks(step, window, sinks), **tolerance(dtype)
    )
    qsl = step.meta.query_start_loc_cpu
    for req in range(5):
        q_len = int(qsl[req + 1] - qsl[req])
        pieces = [slice(0, q_len), slice(q_len - 1, q_len), slice(0, 1)]
        pieces += [slice(3, 29), slice(28, 29)] if q_len == 37 else []
        for rows in pieces:
            alone = attend_alone(kernel, step, req, rows, window, sinks)
            begin = int(qsl[req])
            expected = batch[begin + rows.start : begin + rows.stop]
            assert torch.equal(alone, expected), (req, rows)


@pytest.mark.trio
async def test_the_cpu_decode_stack_takes_sinks(tmp_path: Path) -> None:
    """The CPU library's decoder stack passes each layer's sinks to its
    attention: the windowed Mistral of ``test_sliding_window_parity.py``
    with sinks put on its layers gives the same tokens through the stack
    as layer by layer (the kernel with sinks), and other tokens than
    without sinks."""
    import asyncstep
    from asyncstep.config import ModelConfig
    from asyncstep.models.model_loader import load_model, pack_weights
    from asyncstep.ops.cpu.decode_stack import CpuDecodeStack
    from asyncstep.ops.cpu.quant import quant_matmul
    from tests.gguf_weights import q4_0_weight
    from tests.models.hf_parity import random_model
    from tests.models.test_sliding_window_parity import PARITY, tiny_config

    matmul = quant_matmul()
    if matmul is None or not matmul.fast:
        pytest.skip("the stack runs on the vector build only (AVX512-VNNI or AVX2)")
    model = random_model(tiny_config("mistral"))
    for layer in model.model.layers:  # weights a Q4_0 GGUF would hold: packable
        for linear in (*vars(layer.self_attn)["_modules"].values(), *layer.mlp.children()):
            if isinstance(linear, torch.nn.Linear):
                linear.weight.data = q4_0_weight(*linear.weight.shape)
    model.save_pretrained(tmp_path)
    loaded = load_model(ModelConfig(model=str(tmp_path), device="cpu", dtype="float32"))
    pack_weights(loaded.model, torch.float32, max_tokens=8)
    runs = {}
    for run_name in ("no sinks", "stack", "layer by layer"):
        if run_name == "stack":
            for i, layer in enumerate(loaded.model.model.layers):
                attn = layer.self_attn.attn
                heads = attn.shape.num_heads
                sinks = torch.linspace(1.0, 3.0, heads) * (-1) ** i  # swamping and vanishing
                attn.shape = dataclasses.replace(attn.shape, sinks=sinks)
        async with asyncstep.open_engine(loaded, block_size=4) as engine:
            assert isinstance(loaded.model.model.step_path, CpuDecodeStack)
            if run_name == "layer by layer":
                loaded.model.model.step_path = None
            runs[run_name] = await PARITY.generate_all(engine)
    assert runs["stack"] == runs["layer by layer"]
    assert runs["stack"] != runs["no sinks"]
    assert all(len(t) == PARITY.max_tokens for t in runs["stack"])


@pytest.mark.parametrize(
    "sinks",
    [torch.zeros(HEADS + 1), torch.zeros(HEADS, dtype=torch.int32), torch.zeros(HEADS, 1)],
    ids=["a head too many", "integers", "two dimensions"],
)
def test_sinks_the_kernel_cannot_read_are_refused_in_one_line(
    kernel: CpuPagedAttention, sinks: torch.Tensor
) -> None:
    step = windowed_step(torch.float32, 10_000, 4)
    with pytest.raises(ValueError, match=f"^expected {HEADS} floating-point sink logits") as err:
        run(CpuAttention(kernel), step, None, sinks, planned=False)
    assert "\n" not in str(err.value)
