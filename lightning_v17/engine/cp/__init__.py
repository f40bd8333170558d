"""Context parallelism: the sequence dim of every batch sharded over the ``cp`` mesh axis (``sharding``), attention
over the whole rows by Ulysses all-to-all (``ulysses``) or all-gathered K/V (``allgather``), packed documents
masked exactly in both, and the token-weighted loss over the shards (``loss``). ``apply`` holds the one attention
call a model switches to (:func:`context_parallel_attention`, :class:`CPContext`) and the choice of the scheme."""

from lightning_v17.engine.cp.allgather import allgather_attention, gather_sequence, local_document_mask
from lightning_v17.engine.cp.apply import (
    CPContext,
    CPMode,
    choose_cp_mode,
    context_parallel_attention,
    cp_comm_elements,
    current_cp_context,
    hf_attention_forward,
    set_cp_context,
    use_cp_context,
)
from lightning_v17.engine.cp.loss import context_parallel_cross_entropy, global_loss
from lightning_v17.engine.cp.sharding import (
    CPBalance,
    CPBatch,
    SequenceLayout,
    attention_work,
    balance_ratio,
    check_sequence_parallel_split,
    cu_seqlens_from_segment_ids,
    make_layout,
    segment_ids_from_position_ids,
    sequence_multiple,
    shard_batch,
    shift_labels,
    token_work,
)
from lightning_v17.engine.cp.ulysses import (
    AttentionFn,
    check_ulysses_heads,
    document_causal_sdpa,
    head_to_seq,
    seq_to_head,
    ulysses_attention,
)

__all__ = [
    "AttentionFn",
    "CPBalance",
    "CPBatch",
    "CPContext",
    "CPMode",
    "SequenceLayout",
    "allgather_attention",
    "attention_work",
    "balance_ratio",
    "check_sequence_parallel_split",
    "check_ulysses_heads",
    "choose_cp_mode",
    "context_parallel_attention",
    "context_parallel_cross_entropy",
    "cp_comm_elements",
    "cu_seqlens_from_segment_ids",
    "current_cp_context",
    "document_causal_sdpa",
    "gather_sequence",
    "global_loss",
    "head_to_seq",
    "hf_attention_forward",
    "local_document_mask",
    "make_layout",
    "segment_ids_from_position_ids",
    "seq_to_head",
    "sequence_multiple",
    "set_cp_context",
    "shard_batch",
    "shift_labels",
    "token_work",
    "ulysses_attention",
    "use_cp_context",
]
