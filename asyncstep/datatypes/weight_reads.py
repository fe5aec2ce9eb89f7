"""The bytes of weights a forward step reads (:class:`WeightReads`, its
packed layers' :class:`PackedReads` and its experts' :class:`ExpertReads`),
counted on the model as loaded (:mod:`asyncstep.models.weight_reads`) and
sent by the ranks to the engine. Imports msgspec only.
"""

from __future__ import annotations

import msgspec


class PackedReads(msgspec.Struct, frozen=True, array_like=True):
    """The weights of the layers kept packed for steps of at most
    ``max_tokens`` tokens: their packed bytes, and their dense bytes (what
    a larger step reads)."""

    max_tokens: int
    packed_bytes: int
    dense_bytes: int


class ExpertReads(msgspec.Struct, frozen=True, array_like=True):
    """The experts of the MoE layers routing ``top_k`` of ``num_experts``:
    the bytes of the experts a rank holds (weights and biases, summed over
    those layers). A step reads the experts its tokens are routed to: of
    one token, exactly ``top_k`` (``top_k / num_experts`` of the bytes); of
    ``T`` tokens, each held expert is read when any token picks it, with
    probability ``1 - (1 - top_k / num_experts) ** T`` under uniform
    routing (the expectation a step of ``T`` tokens counts)."""

    num_experts: int
    top_k: int
    resident_bytes: int

    def step_bytes(self, num_tokens: int) -> float:
        """The expert bytes a step of ``num_tokens`` tokens reads (see above)."""
        missed = (1 - self.top_k / self.num_experts) ** max(num_tokens, 1)
        return self.resident_bytes * (1 - missed)


class WeightReads(msgspec.Struct, frozen=True):
    """The bytes of weights a forward step reads, by its number of tokens
    (a rank's, or an engine's: its ranks' summed): what the memory floor of
    a step counts. Counted on the model as loaded
    (:func:`~asyncstep.models.weight_reads.weight_reads`)."""

    #: Read whole at every step: the norms, the biases, and every weight
    #: without a packed copy (a tied LM head: the embedding table).
    dense_bytes: int = 0
    #: The layers with a packed copy, by their ``max_tokens``.
    packed: list[PackedReads] = msgspec.field(default_factory=list)
    #: One row of the input embedding: a step reads one per token.
    embedding_row_bytes: int = 0
    #: A MoE model's experts, by their layers' routing (not in ``dense_bytes``).
    experts: list[ExpertReads] = msgspec.field(default_factory=list)

    def step_bytes(self, num_tokens: int) -> int:
        """The weight bytes a step of ``num_tokens`` tokens reads."""
        packed = sum(
            p.packed_bytes if num_tokens <= p.max_tokens else p.dense_bytes for p in self.packed
        )
        experts = sum(e.step_bytes(num_tokens) for e in self.experts)
        return self.dense_bytes + packed + num_tokens * self.embedding_row_bytes + round(experts)

    def plus(self, other: WeightReads) -> WeightReads:
        """Two ranks' reads together (a token's embedding row is on one
        rank: the larger row counts once)."""
        tiers: dict[int, PackedReads] = {p.max_tokens: p for p in self.packed}
        for more in other.packed:
            have = tiers.get(more.max_tokens, PackedReads(more.max_tokens, 0, 0))
            tiers[more.max_tokens] = PackedReads(
                more.max_tokens,
                have.packed_bytes + more.packed_bytes,
                have.dense_bytes + more.dense_bytes,
            )
        routes: dict[tuple[int, int], int] = {}
        for e in (*self.experts, *other.experts):
            key = (e.num_experts, e.top_k)
            routes[key] = routes.get(key, 0) + e.resident_bytes
        return WeightReads(
            self.dense_bytes + other.dense_bytes,
            [tiers[k] for k in sorted(tiers)],
            max(self.embedding_row_bytes, other.embedding_row_bytes),
            [ExpertReads(e, k, b) for (e, k), b in sorted(routes.items())],
        )
