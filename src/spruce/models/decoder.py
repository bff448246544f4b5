"""DecoderLM: what every target model is to the engine: embed, a paged forward returning the final hidden
state and EAGLE-3's aux features, logits, and HF-named weight loading. Architectures (llama.py, deepseek.py)
only build their layers and name their weights."""

from __future__ import annotations

import torch
from torch import nn

from spruce.attention.metadata import ForwardBatch
from spruce.distributed.layers import VocabParallelEmbedding, column_parallel_linear, vocab_parallel_logits
from spruce.errors import ModelLoadError
from spruce.models.hf_config import ModelConfig
from spruce.models.layers import RMSNorm
from spruce.models.rope import Rotary
from spruce.models.weights import load_named_tensors


class DecoderLM(nn.Module):
    """forward -> (final-normed hidden [T, H], aux [T, len(aux_layers) * H] or None).

    aux concatenates the residual-stream input of each layer in `aux_layers` (layer 0's input is the
    embedding; L is the last layer's output): the features an EAGLE-3 head consumes. Subclasses say how to
    build their rope (`build_rotary`) and their PreNormLayer-shaped layers (`build_layer`, also used for MTP
    layers stored after the main ones).

    With a tensor-parallel group `tp` (distributed/group.py) this rank holds its slice of every layer (heads,
    intermediate, experts' intermediate), the embedding and lm head are vocab-parallel, and hidden states, aux
    features and logits are whole on every rank (DESIGN §18)."""

    def __init__(self, cfg: ModelConfig, backend, aux_layers: tuple[int, ...] = (), tp=None):
        super().__init__()
        for i in aux_layers:
            if not 0 <= i <= cfg.num_layers:
                raise ModelLoadError(f"aux hidden-state layer input {i} is outside [0, {cfg.num_layers}] "
                                     f"(the target has {cfg.num_layers} layers; {cfg.num_layers} = last layer's output)")
        self.config = cfg
        self.tp = tp
        self.aux_layers = tuple(aux_layers)
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size) if tp is None
                             else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp))
        self.layers = nn.ModuleList()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else column_parallel_linear(cfg.hidden_size, cfg.vocab_size, tp, "vocab_size"))
        self.rotary = self.build_rotary(cfg)
        self.layers.extend(self.build_layer(cfg, self.rotary, backend, i, i, tp) for i in range(cfg.num_layers))

    @staticmethod
    def build_rotary(cfg: ModelConfig) -> Rotary:
        """The Rotary the architecture's attention uses: the config's head_dim, rope_theta and rope_scaling
        (architectures with another rope override it)."""
        return Rotary(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    @staticmethod
    def build_layer(cfg: ModelConfig, rotary, backend, index: int, pool_layer: int, tp=None) -> nn.Module:
        """Checkpoint layer `index`, caching its K/V (or latents) in layer `pool_layer` of its pool (this rank's
        slice of it with a tensor-parallel group `tp`)."""
        raise NotImplementedError

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: ids [n] -> [n, H]."""
        return self.embed_tokens(ids)

    def forward(self, batch: ForwardBatch, kv, page_table: torch.Tensor, aux: bool = True):
        """One forward over batch.input_ids at batch.positions, writing every layer's cache entries into `kv`.

        Returns (hidden [T, H] after the final norm, aux [T, len(aux_layers) * H] or None). T may be 0.
        `aux` False: no aux features are kept (aux None), as for a target without aux layers (a plain step that
        no draft will read)."""
        x = self.embed(batch.input_ids)  # [T, H]
        residual = None
        aux_layers = self.aux_layers if aux else ()
        inputs = {}  # aux layer index -> its residual-stream input x + residual

        def stream_input(x, residual):
            return x if residual is None else x + residual

        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                inputs[i] = stream_input(x, residual)
            x, residual = layer.forward_residual(x, residual, batch, kv, page_table)
        last = len(self.layers)
        if last in aux_layers:
            inputs[last] = stream_input(x, residual)
        hidden = self.norm(x) if residual is None else self.norm.add_forward(x, residual)[0]
        if not aux_layers:
            return hidden, None
        return hidden, torch.cat([inputs[i] for i in aux_layers], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, V] float32 (tensor-parallel: every rank's V/tp logits gathered, on every rank)."""
        if self.tp is not None:
            return vocab_parallel_logits(hidden, self.output_weight, self.tp)
        return nn.functional.linear(hidden, self.output_weight).float()

    @property
    def output_weight(self) -> torch.Tensor:
        """[V, H] the lm_head (the embedding when tied); this rank's [V/tp, H] rows when tensor-parallel."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def weight_bytes_read(self, num_tokens: int) -> float:
        """Weight bytes one forward over `num_tokens` tokens reads at least once: every parameter except the
        embedding table (only its rows are gathered; tied, it is read whole as the lm_head), with each routed
        expert bank counted by the expected share of experts the tokens pick (E * (1 - (1 - k/E)^T) under
        uniform routing; exactly k of E at one token). Tensor-parallel: this rank's slices (bytes per GPU)."""
        from spruce.models.moe import MoE

        total = 0.0
        for name, p in self.named_parameters():
            if name == "embed_tokens.weight" and self.lm_head is not None:
                continue
            total += p.numel() * p.element_size()
        for module in self.modules():
            if isinstance(module, MoE):
                e, k = module.cfg.num_experts, module.cfg.top_k
                share = 1.0 - (1.0 - k / e) ** max(num_tokens, 1)
                bank = sum(p.numel() * p.element_size() for p in module.experts.parameters())
                total -= bank * (1.0 - share)
        return total

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name in this module (None: not loaded): the `model.` prefix dropped; rotary
        tables and, when tied, lm_head skipped."""
        if name.endswith("rotary_emb.inv_freq") or (self.lm_head is None and name == "lm_head.weight"):
            return None
        return name.removeprefix("model.")

    def load_weights(self, tensors) -> None:
        """Copy HF-named (name, tensor) pairs (model.layers.N.self_attn.q_proj.weight, lm_head.weight, ...) into
        the fused parameters. ModelLoadError naming the tensor on a missing, unknown or wrongly shaped one."""
        load_named_tensors(self, tensors, self.checkpoint_name)
