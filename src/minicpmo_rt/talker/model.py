"""MiniCPMTTS with upstream parameter names (``tts.`` prefix in the checkpoint).

The backbone is transformers' own ``LlamaModel``; ``tts.model.embed_tokens`` (LlamaConfig's
default 32000 x hidden) is stored in the real checkpoint but never used: inputs are
always embeddings (text/condition rows, then one ``emb_code`` row per decode step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm
from transformers import LlamaConfig, LlamaModel

from ..checkpoint.config import TTSConfig
from ..hf_compat import cache_kwarg, output_cache


class Projector(nn.Module):
    """linear1 -> ReLU -> linear2 (upstream's ``MultiModalProjector``)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.linear1 = nn.Linear(in_dim, out_dim, bias=True)
        self.linear2 = nn.Linear(out_dim, out_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.relu(self.linear1(x)))


def llama_config(cfg: TTSConfig) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=cfg.backbone_vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_hidden_layers=cfg.num_hidden_layers,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        hidden_act=cfg.hidden_act,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        attention_bias=False,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


class MiniCPMTTS(nn.Module):
    def __init__(self, cfg: TTSConfig):
        super().__init__()
        if cfg.projector_type != "mlp":
            raise ValueError(f"tts_config.projector_type {cfg.projector_type!r} is not supported (only 'mlp')")
        self.cfg = cfg
        self.emb_text = nn.Embedding(cfg.num_text_tokens, cfg.hidden_size)
        self.model = LlamaModel(llama_config(cfg))
        self.projector_spk = Projector(cfg.llm_dim, cfg.hidden_size)
        self.projector_semantic = Projector(cfg.llm_dim, cfg.hidden_size)
        self.emb_code = nn.ModuleList([nn.Embedding(cfg.num_audio_tokens, cfg.hidden_size)
                                       for _ in range(cfg.num_vq)])
        self.head_code = nn.ModuleList([weight_norm(nn.Linear(cfg.hidden_size, cfg.num_audio_tokens, bias=False),
                                                    name="weight", dim=0) for _ in range(cfg.num_vq)])

    @property
    def eos_code(self) -> int:
        return self.cfg.num_audio_tokens - 1

    def condition(self, text_ids: torch.Tensor, hidden: torch.Tensor, text_finished: bool = True) -> torch.Tensor:
        """Conditioning rows for one request: [n (+1) + 1, H].

        Per text token ``emb_text(id) + L2norm(projector_semantic(hidden))`` (the norm only when
        ``normalize_projected_hidden``), then ``emb_text(text_eos)`` if the text is finished, then
        ``emb_text(audio_bos)``.
        """
        if text_ids.ndim != 1 or hidden.ndim != 2 or hidden.shape[0] != text_ids.shape[0]:
            raise ValueError(f"condition: text_ids {tuple(text_ids.shape)} and hidden {tuple(hidden.shape)} "
                             "must be [n] and [n, llm_dim]")
        proj = self.projector_semantic(hidden.to(self.emb_text.weight.dtype))
        if self.cfg.normalize_projected_hidden:
            proj = F.normalize(proj, p=2, dim=-1)
        rows = [self.emb_text(text_ids) + proj]
        tail = ([self.cfg.text_eos_token_id] if text_finished else []) + [self.cfg.audio_bos_token_id]
        rows.append(self.emb_text(torch.tensor(tail, device=text_ids.device)))
        return torch.cat(rows, 0)

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        return self.emb_code[0](codes)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head_code[0](hidden).float()

    def forward_reference(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, past_key_values=None):
        """Plain transformers forward: (final hidden [B,T,H], cache). The oracle of the fast step."""
        kwargs = {} if past_key_values is None else {cache_kwarg(type(self.model)): past_key_values}
        out = self.model(inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=True, **kwargs)
        return out.last_hidden_state, output_cache(out)


def rebuild_rotary_(module: nn.Module) -> nn.Module:
    """Recompute every rotary ``inv_freq`` buffer (non-persistent: garbage after ``to_empty``)."""
    for sub in module.modules():
        if type(sub).__name__.endswith("RotaryEmbedding") and hasattr(sub, "config"):
            fresh = type(sub)(sub.config)
            for name in ("inv_freq", "original_inv_freq"):
                if hasattr(sub, name):
                    setattr(sub, name, getattr(fresh, name).to(getattr(sub, name).device))
    return module


def build_tts(config) -> MiniCPMTTS:
    return MiniCPMTTS(config.tts)


# Legacy checkpoints store weight norm as weight_g / weight_v.
LEGACY_ALIASES = {
    "head_code.0.weight_g": "head_code.0.parametrizations.weight.original0",
    "head_code.0.weight_v": "head_code.0.parametrizations.weight.original1",
}
