"""A Qwen4Exp-shaped model with random weights for ple-bench-prefill: the
shape of transformers' ``Qwen4ExpTextConfig`` defaults (hidden size 2,048,
hyper-connections, linear attention with a full-attention layer in four,
mixture-of-experts MLPs) with Flash-Next's vocabulary and PLE layer (decoder
layer 2, 3-grams of 8 heads, rows of 160 FP8 values), ``layers`` decoder
layers and ``experts`` experts.  Its n-gram table is either the bench's
table, served by ple (``ple.integrations.transformers.offload``), or, for
compute alone, a small table of the model's own in device memory.

transformers' QSA indexer selects each query's keys in a Python loop over
the queries, about 50 operations each: 114,000 of a 2,048-token chunk's
118,000, which bound the model's compute whatever its width.  The model here selects
the same keys for all queries at once (``BatchedQSAIndexer``), so that its
compute follows its width.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from ple_tools.make_table import PREFIX

NGRAM_MODULE = "model.layers.1.ple.ple_embedding.ngram_embedding"
# A full-attention layer's QSA indexer: it attends to a budget of keys, as
# Flash-Next's layers do (rotary dims must fit its heads).
INDEXER = dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=256,
               indexer_budget=2048, indexer_compress_ratio=4)


def flash_next_config(*, layers: int, experts: int, hashing: dict, base: int, shards: int,
                      hidden: int = 2048):
    from transformers import Qwen4ExpTextConfig

    if layers < 3:
        raise ValueError(f"a Qwen4Exp-shaped model needs 3 layers or more (its PLE layer is "
                         f"decoder layer 2, a linear-attention layer), not {layers}")
    # Transformers' pattern (full attention every fourth layer), with at least
    # one: its cache counts the prompt in the full-attention layers.
    types = ["indexed_attention" if (i + 1) % 4 == 0 else "linear_attention"
             for i in range(layers)]
    types[-1] = "indexed_attention" if "indexed_attention" not in types else types[-1]
    # Narrower than the defaults' 2,048: their heads and MLPs in proportion.
    def scaled(n: int, least: int = 1) -> int:
        return max(least, n * hidden // 2048)

    heads = scaled(16)
    return Qwen4ExpTextConfig(
        hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=min(2, heads),
        linear_num_key_heads=scaled(16), linear_num_value_heads=scaled(32),
        hc_lowrank=scaled(320, 16), moe_intermediate_size=scaled(512, 32),
        shared_expert_intermediate_size=scaled(512, 32),
        num_hidden_layers=layers, layer_types=types, num_experts=experts,
        num_experts_per_tok=min(10, experts), ple_layer_ids=[2], ple_embed_dim=2560,
        vocab_size=hashing["vocab_size"], eos_token_id=hashing["eos_id"],
        ngram_size=hashing["ngram_size"], heads_per_ngram=hashing["heads_per_ngram"],
        seed=hashing["seed"], ngram_vocab_size_base=base, split_ngram_parts=shards, **INDEXER)


@functools.cache
def batched_qsa_indexer():
    """The subclass of transformers' ``Qwen4ExpTextQSAIndexer`` that computes
    its selection mask for every query of a call in one pass."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as qwen4_exp

    class BatchedQSAIndexer(qwen4_exp.Qwen4ExpTextQSAIndexer):
        """transformers' selection, batched over the queries: a query's
        visible keys, in order, are grouped in blocks of ``compress_ratio``;
        it keeps the ``block_topk`` complete blocks that score highest against
        it and the incomplete tail.  Batching needs each query's visible keys
        to be the first of one order (a causal mask, with padding or not);
        other masks take transformers' loop."""

        def forward(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs):
            visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
            seen = visible[:, 0].any(dim=1)  # [batch, keys]: the keys some query sees
            counts = visible[:, 0].sum(dim=-1)  # [batch, queries]
            prefixes = seen.unsqueeze(1) & (seen.cumsum(-1).unsqueeze(1) <= counts.unsqueeze(-1))
            if not torch.equal(prefixes, visible[:, 0]):
                return super().forward(hidden_states, position_embeddings, attention_mask, cache,
                                       **kwargs)
            batch_size, seq_length, _ = hidden_states.shape
            full_cos, full_sin = position_embeddings
            q, token_k = self.index_qk_proj(hidden_states).split(
                [self.index_n_heads * self.index_head_dim, self.index_kv_heads * self.index_head_dim],
                dim=-1)
            q = self.q_layernorm(q.reshape(batch_size, seq_length, -1, self.index_head_dim))
            q = qwen4_exp.apply_rotary_pos_emb(q, cos=full_cos[:, -seq_length:],
                                               sin=full_sin[:, -seq_length:], unsqueeze_dim=2)
            keys = token_k.reshape(batch_size, seq_length, -1, self.index_head_dim).squeeze(2)
            if cache is not None:
                keys = cache.update_indexer(keys, self.layer_idx)
            selected = torch.zeros_like(visible)
            for b in range(batch_size):
                selected[b, 0, :, seen[b]] = self._selected_ranks(
                    q[b], keys[b], full_cos[b], full_sin[b], seen[b].nonzero().flatten(),
                    counts[b])
            return selected

        def _selected_ranks(self, q, keys, cos, sin, order, counts):
            """[queries, len(order)]: whether each query keeps the key at each
            rank of ``order`` (the visible keys; query i sees the first
            ``counts[i]``)."""
            ratio = self.compress_ratio
            blocks = order[: order.numel() // ratio * ratio].view(-1, ratio)
            num_blocks = blocks.shape[0]
            complete = counts // ratio  # each query's complete blocks: the first ones
            ranks = torch.arange(order.numel(), device=order.device)
            kept = (ranks >= (complete * ratio).unsqueeze(-1)) & (ranks < counts.unsqueeze(-1))
            if num_blocks == 0:
                return kept
            pooled = keys.index_select(0, blocks.flatten()).view(num_blocks, ratio, -1)
            pooled = self.k_layernorm(pooled.float().mean(dim=1).to(keys.dtype))
            block_keys = qwen4_exp.apply_rotary_pos_emb(
                pooled.unsqueeze(1), cos=cos.index_select(0, blocks[:, 0]),
                sin=sin.index_select(0, blocks[:, 0])).squeeze(1)
            # As transformers computes one query's scores: [heads, blocks], summed over heads.
            scores = torch.matmul(q.float(), block_keys.float().transpose(-1, -2)).transpose(-1, -2)
            scores = torch.relu(scores).sum(dim=-1) / math.sqrt(self.index_head_dim)
            block_ids = torch.arange(num_blocks, device=order.device)
            scores = scores.masked_fill(block_ids >= complete.unsqueeze(-1), -math.inf)
            top = min(self.block_topk, num_blocks)
            values, picks = scores.topk(min(top + 1, num_blocks), dim=-1)
            picks = picks[:, :top]
            if num_blocks > top:
                # Where blocks tie at the cut (scores of 0: every head's dot
                # product negative), the pick is the one of transformers' top-k
                # over the query's complete blocks alone.
                tied = (complete > top) & (values[:, top - 1] == values[:, top])
                for i in tied.nonzero().flatten().tolist():
                    picks[i] = scores[i, : complete[i]].topk(top, dim=0).indices
            # Scores are >= 0, so the first min(block_topk, complete) picks are complete blocks.
            taken = torch.arange(top, device=order.device) < complete.clamp(max=top).unsqueeze(-1)
            chosen = torch.zeros(q.shape[0], num_blocks + 1, dtype=torch.bool, device=q.device)
            chosen.scatter_(1, torch.where(taken, picks, num_blocks), True)
            kept[:, : num_blocks * ratio] |= chosen[:, :num_blocks].repeat_interleave(ratio, dim=1)
            return kept

    return BatchedQSAIndexer


def build(config, device: torch.device, *, table_files=None, gather_config=None,
          lookahead_mib: int = 0) -> nn.Module:
    """The model on ``device`` in bfloat16, random weights.  With
    ``table_files`` (ple_tools.make_table's files: ``ngram_embedding.*``) its
    n-gram table is those files' table, served by ple with ``gather_config``
    and ``lookahead_mib``; without, the model's own table on ``device``."""
    from transformers import Qwen4ExpForCausalLM

    from ple.integrations.transformers import offload

    config.dtype = torch.bfloat16
    torch.manual_seed(0)
    if table_files is None:
        with torch.device(device):
            return _batch_indexers(Qwen4ExpForCausalLM(config).to(torch.bfloat16).eval())
    # On the meta device first: the full-size n-gram table is never allocated.
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(config)
    offload(model, table_files, [NGRAM_MODULE], gather_config=gather_config,
            key_mapping={f"^{PREFIX}": NGRAM_MODULE}, lookahead_mib=lookahead_mib)
    _materialize(model, device)
    model.init_weights()
    return _batch_indexers(model.to(device, torch.bfloat16).eval())


def _batch_indexers(model: nn.Module) -> nn.Module:
    """``model`` with each QSA indexer a ``BatchedQSAIndexer`` (same weights)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer

    batched = batched_qsa_indexer()
    for module in model.modules():
        if type(module) is Qwen4ExpTextQSAIndexer:
            module.__class__ = batched
    return model


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Gives every meta parameter and buffer uninitialized memory on ``device``."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.is_meta:
                module._parameters[name] = nn.Parameter(torch.empty_like(param, device=device),
                                                        requires_grad=False)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=device)
