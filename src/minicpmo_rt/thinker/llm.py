"""The Thinker's language model: transformers' own Qwen3ForCausalLM (prefix ``llm.``).

Upstream builds ``Qwen3ForCausalLM(config)`` from its MiniCPMOConfig, which extends
Qwen3Config with the LLM fields at the top level. We rebuild an equivalent
Qwen3Config from ``config.llm`` so that no remote code is needed; only stable
config fields are used (they exist in transformers 5.17 and 5.24 alike).
"""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from ..checkpoint.config import MiniCPMOConfig
from ..hf_compat import cache_kwarg, output_cache  # noqa: F401 (re-exported for thinker modules)


def qwen3_config(config: MiniCPMOConfig, attn_implementation: str = "sdpa") -> Qwen3Config:
    """The Qwen3Config equivalent to the top-level LLM fields of ``config``."""
    c = config.llm
    raw = config.raw
    qcfg = Qwen3Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        # rope_parameters is the transformers-5 spelling of rope_theta (+ rope_type).
        rope_parameters={"rope_type": "default", "rope_theta": float(c.rope_theta)},
        tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=c.attention_bias,
        attention_dropout=0.0,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=int(raw.get("max_window_layers", c.num_hidden_layers)),
        use_cache=True,
        bos_token_id=raw.get("bos_token_id", 151643),
        eos_token_id=raw.get("eos_token_id", 151645),
        pad_token_id=raw.get("pad_token_id", 151643),
    )
    qcfg._attn_implementation = attn_implementation
    return qcfg


def build_llm(config: MiniCPMOConfig, attn_implementation: str = "sdpa") -> Qwen3ForCausalLM:
    """An (uninitialised-weights) Qwen3ForCausalLM whose state_dict keys are the checkpoint's
    ``llm.*`` keys minus the prefix. Works under ``torch.device("meta")``."""
    model = Qwen3ForCausalLM(qwen3_config(config, attn_implementation))
    model.eval()
    return model


def final_norm_hidden(model: Qwen3ForCausalLM, inputs_embeds: torch.Tensor,
                      past_key_values=None, position_ids: torch.Tensor | None = None):
    """Run the decoder stack and return (final-norm hidden [B,L,H], cache).

    ``Qwen3Model.last_hidden_state`` is already ``norm(output of the last layer)``, the
    state upstream reads as ``hidden_states[-1]``.
    """
    kwargs = {} if past_key_values is None else {cache_kwarg(type(model.model)): past_key_values}
    out = model.model(inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=True, **kwargs)
    return out.last_hidden_state, output_cache(out)
