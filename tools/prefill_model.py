"""A Qwen4Exp-shaped model with random weights for ple-bench-prefill: the
shape of transformers' ``Qwen4ExpTextConfig`` defaults (hidden size 2,048,
hyper-connections, linear attention with a full-attention layer in four,
mixture-of-experts MLPs) with Flash-Next's vocabulary and PLE layer (decoder
layer 2, 3-grams of 8 heads, rows of 160 FP8 values), ``layers`` decoder
layers and ``experts`` experts.  Its n-gram table is either the bench's
table, served by ple (``ple.integrations.transformers.offload``), or, for
compute alone, a small table of the model's own in device memory."""

from __future__ import annotations

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
            return Qwen4ExpForCausalLM(config).to(torch.bfloat16).eval()
    # On the meta device first: the full-size n-gram table is never allocated.
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(config)
    offload(model, table_files, [NGRAM_MODULE], gather_config=gather_config,
            key_mapping={f"^{PREFIX}": NGRAM_MODULE}, lookahead_mib=lookahead_mib)
    _materialize(model, device)
    model.init_weights()
    return model.to(device, torch.bfloat16).eval()


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
