"""Layers of the Llama family, written tensor-parallel (Megatron style).

Column-parallel linears split their output features over the TP group,
row-parallel linears split their input features and all-reduce; the embedding
and LM head split the vocabulary; a MoE layer's experts split their
intermediate dimension (:mod:`~asyncstep.models.layers.moe`). Each parameter
carries a ``weight_loader`` that narrows a full checkpoint tensor to this
rank's shard, so a rank holds only its share of the weights.
"""
