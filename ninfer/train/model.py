"""The training model: a qwen3_5 text decoder plus its MTP layer, in plain torch with autograd.

Module names are the checkpoint's, so ``state_dict()`` is the released tensor layout as it
stands (``model.language_model.*``, ``lm_head.weight``, ``mtp.*``). Shapes come from the
same config.json the checkpoint ships (:class:`HybridConfig`). The maths is the inference
references' (:mod:`ninfer_kernels`), except that Gated DeltaNet's chunked delta rule is
rearranged for training (:mod:`ninfer.train.delta_rule`); it runs in float32, as at inference.
With ``NINFER_TRAIN_FLA=1`` a CUDA run takes flash-linear-attention's chunked kernels for it
instead (forward and backward, called as the engine's prefill calls them; opt-in until timed).

MTP (as vLLM runs Qwen3-Next / Qwen3.5 MTP): at base position ``t``, step 1 takes the
embedding of token ``t + 1`` and the main model's final hidden state at ``t`` (after the
final norm), each normed, concatenated ``[embedding; hidden]``, projected by ``fc``, passed
through one full-attention decoder layer at position ``t`` and the MTP norm; the shared
LM head then scores token ``t + 2``. Step ``j`` feeds step ``j - 1``'s output (after the MTP
norm) and token ``t + j`` at position ``t + j - 1``. Its attention sees what the engine's
MTP KV cache holds at that point: step 1's keys for bases ``<= t`` and the keys the chain
itself wrote for this base at steps ``2 .. j`` (:func:`chain_mask`).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from ninfer_kernels.gated_delta import prepare_qk
from ninfer_kernels.gated_rms_norm import gated_rms_norm
from ninfer_kernels.rope import apply_rope, rope_cos_sin
from ninfer.train.delta_rule import CHUNK, chunk_delta_rule
from ninfer_plugins.models.hybrid_config import LINEAR, HybridConfig

INIT_STD = 0.02

KV = tuple[torch.Tensor, torch.Tensor]


class ZeroCentredRMSNorm(nn.Module):
    """Scales by ``1 + weight`` (the stored weight starts at zero), as Qwen3.5's norms do."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _linear(hidden, inter), _linear(hidden, inter), _linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def causal_conv(x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
    """The depthwise causal convolution of ``x`` [B, L, C] by ``weight`` [C, 1, K] (``nn.Conv1d``'s
    layout, padded by K - 1 and cut to L), as K shifted products: no transposes, and on a CPU
    cheaper than the convolution's own backward. ``history`` [B, K - 1, C]: the inputs before
    ``x`` (zeros without it)."""
    n, size = x.shape[1], weight.shape[-1]
    padded = F.pad(x, (0, 0, size - 1, 0)) if history is None else torch.cat([history, x], dim=1)
    taps = weight[:, 0].t()  # [K, C]
    out = padded[:, :n] * taps[0]
    for i in range(1, size):
        out = torch.addcmul(out, padded[:, i : i + n], taps[i])
    return out


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.hk, self.dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        self.hv, self.dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        conv_dim = 2 * self.key_dim + self.value_dim
        h = cfg.hidden_size
        self.in_proj_qkv = _linear(h, conv_dim)
        self.in_proj_z = _linear(h, self.value_dim)
        self.in_proj_b = _linear(h, self.hv)
        self.in_proj_a = _linear(h, self.hv)
        k = cfg.linear_conv_kernel
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, k, groups=conv_dim, padding=k - 1, bias=False)
        # decay rates and time steps spread over orders of magnitude, as FLA initialises them
        self.A_log = nn.Parameter(torch.empty(self.hv).uniform_(1.0, 16.0).log())
        dt = torch.empty(self.hv).uniform_(math.log(1e-3), math.log(1e-1)).exp()
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) == dt
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = _linear(self.value_dim, h)

    def forward(self, x: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        """``cache`` (decoding only): the conv inputs and recurrent state to continue from
        (an empty dict starts from zeros); updated in place."""
        b, n, _ = x.shape
        mixed = self.in_proj_qkv(x)
        history = None if cache is None else cache.get("conv")
        qkv = F.silu(causal_conv(mixed, self.conv1d.weight, history))
        if cache is not None:
            size = self.conv1d.weight.shape[-1]
            tail = F.pad(mixed, (0, 0, size - 1, 0)) if history is None else torch.cat([history, mixed], dim=1)
            cache["conv"] = tail[:, 1 - size :]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = self.in_proj_b(x).float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        q, k = q.reshape(b, n, self.hk, self.dk), k.reshape(b, n, self.hk, self.dk)
        v = v.reshape(b, n, self.hv, self.dv)
        if cache is None and fla_training(x.device):
            out = fla_delta_rule(q, k, v, g, beta).to(x.dtype)
        else:
            out = self._recurrence(q, k, v, g, beta, cache).to(x.dtype)
        out = self.norm(out, self.in_proj_z(x).reshape(b, n, self.hv, self.dv))
        return self.out_proj(out.reshape(b, n, self.value_dim))

    def _recurrence(self, q, k, v, g, beta, cache: dict | None) -> torch.Tensor:
        """The chunked delta rule in float32 (:mod:`ninfer.train.delta_rule`): [B, L, Hv, Dv]."""
        b, n = q.shape[:2]
        q, k = prepare_qk(q, k, self.hv)

        def fold(t: torch.Tensor) -> torch.Tensor:  # [B, L, H, ...] -> [B*H, L, ...]: batch rows become heads
            return t.transpose(1, 2).reshape(b * self.hv, n, *t.shape[3:])

        with torch.autocast(q.device.type, enabled=False):  # the recurrence stays float32
            args = fold(q), fold(k), fold(v.float()), fold(g), fold(beta)
            if cache is None:
                out = chunk_delta_rule(*args)
            else:  # a prompt in blocks of CHUNK, then (from its state) one token at a time, unpadded
                chunk = 1 if "state" in cache else CHUNK
                out, cache["state"] = chunk_delta_rule(*args, chunk=chunk, state=cache.get("state"), return_state=True)
        return out.reshape(b, self.hv, n, self.dv).transpose(1, 2)


def fla_training(device: torch.device) -> bool:
    """Whether training steps take flash-linear-attention's chunked kernels for the delta
    rule (``NINFER_TRAIN_FLA=1`` on CUDA with fla importable; opt-in until timed)."""
    return device.type == "cuda" and os.environ.get("NINFER_TRAIN_FLA", "0") == "1" and _fla_chunk() is not None


@functools.lru_cache(maxsize=1)
def _fla_chunk():
    """fla's chunked kernel as the engine imports it (None where fla is not importable)."""
    try:
        from ninfer_kernels.triton.gated_delta import fla_chunk
    except Exception:  # noqa: BLE001  (no Triton here)
        return None
    return fla_chunk


def fla_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
                   ) -> torch.Tensor:
    """The delta rule through fla's chunked kernels, forward and backward, called as the
    engine's prefill calls them (kernels/triton/gated_delta.py): q/k [B, L, Hk, Dk] as the
    conv leaves them (fla normalises them and scales q), v [B, L, Hv, Dv] in the model's
    dtype, the decay ``g`` float32, ``beta`` in v's dtype. Returns [B, L, Hv, Dv]."""
    out, _ = _fla_chunk()(q, k, v.to(q.dtype), g.float(), beta.to(q.dtype), scale=q.shape[-1] ** -0.5,
                          use_qk_l2norm_in_kernel=True)
    return out


def chain_mask(n: int, bases: torch.Tensor, step: int) -> torch.Tensor:
    """Which keys chain step ``step`` (from 2) sees at ``bases`` [m], as [m, n + (step - 1) m]:
    step 1's keys at bases up to its own, then per later step only the key of the same base."""
    first = torch.arange(n, device=bases.device)[None, :] <= bases[:, None]
    own = torch.eye(len(bases), dtype=torch.bool, device=bases.device)
    return torch.cat([first] + [own] * (step - 1), dim=1)


class GatedAttention(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.nh, self.nkv, self.d, self.rot = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim
        h = cfg.hidden_size
        self.q_proj = _linear(h, 2 * self.nh * self.d)  # per head [query | output gate]
        self.k_proj = _linear(h, self.nkv * self.d)
        self.v_proj = _linear(h, self.nkv * self.d)
        self.o_proj = _linear(self.nh * self.d, h)
        self.q_norm = ZeroCentredRMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.d, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, past: list[KV], mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, KV]:
        """``past``: earlier keys and values, seen through ``mask``: the MTP chain's earlier steps,
        or without a mask a decoding cache (every key visible: ``x`` is the next token)."""
        b, n, _ = x.shape
        q, gate = self.q_proj(x).view(b, n, self.nh, 2 * self.d).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(b, n, self.nkv, self.d))
        q, k = apply_rope(q.flatten(0, 1), k.flatten(0, 1), positions.repeat(b), cos_sin, self.rot)
        q = q.view(b, n, self.nh, self.d).transpose(1, 2)
        k = k.view(b, n, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.nkv, self.d).transpose(1, 2)
        if mask is None and not past:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            keys = torch.cat([p[0] for p in past] + [k], dim=2)
            values = torch.cat([p[1] for p in past] + [v], dim=2)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(b, n, self.nh * self.d) * torch.sigmoid(gate.reshape(b, n, -1))
        return self.o_proj(out), (k, v)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, kind: str):
        super().__init__()
        self.is_linear = kind == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x, cos_sin, positions, past: list[KV] = (), mask=None, cache: dict | None = None
    ) -> tuple[torch.Tensor, KV | None]:
        """``cache`` (decoding only, updated in place): the layer's state after the tokens so far."""
        kv = None
        if self.is_linear:
            mixed = self.linear_attn(self.input_layernorm(x), cache)
        elif cache is None:
            mixed, kv = self.self_attn(self.input_layernorm(x), cos_sin, positions, list(past), mask)
        else:
            past = [cache["kv"]] if "kv" in cache else []
            mixed, kv = self.self_attn(self.input_layernorm(x), cos_sin, positions, past, None)
            cache["kv"] = tuple(torch.cat([p, new], dim=2) for p, new in zip(cache["kv"], kv)) if past else kv
        x = x + mixed
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class TextModel(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, kind) for kind in cfg.layer_types)
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _Nest(nn.Module):
    """Qwen3.5 checkpoints nest the decoder as ``model.language_model``."""

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.language_model = TextModel(cfg)


class Mtp(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        h = cfg.hidden_size
        self.fc = _linear(2 * h, h)
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, "full_attention") for _ in range(cfg.mtp_num_layers))
        self.norm = ZeroCentredRMSNorm(h, cfg.rms_norm_eps)


class TrainModel(nn.Module):
    def __init__(self, cfg: HybridConfig, max_positions: int):
        super().__init__()
        if cfg.num_experts or cfg.tie_word_embeddings or not cfg.mtp_num_layers:
            raise ValueError("the trainer builds dense, untied qwen3_5 models with an MTP layer")
        self.cfg = cfg
        self.model = _Nest(cfg)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        self.mtp = Mtp(cfg)
        table = rope_cos_sin(max_positions, cfg.rotary_dim, cfg.rope_theta, torch.float32, "cpu", cfg.rope_scaling)
        self.register_buffer("cos_sin", table, persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # residual-branch outputs shrink with depth (GPT-2's rule) so the stream starts near unit scale
        out_std = INIT_STD / math.sqrt(2 * (self.cfg.num_layers + self.cfg.mtp_num_layers))
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = out_std if name.rsplit(".", 1)[-1] in ("o_proj", "out_proj", "down_proj") else INIT_STD
                nn.init.normal_(module.weight, std=std)

    @property
    def text(self) -> TextModel:
        return self.model.language_model

    def hidden(self, tokens: torch.Tensor, cache: list[dict] | None = None, start: int = 0) -> torch.Tensor:
        """Final hidden states [B, L, H] after the final norm (what the LM head and MTP read).

        Decoding: ``cache`` (one dict per layer, empty at first) holds every layer's state
        after the tokens so far, and ``tokens`` continue them from position ``start``:
        a prompt first, then one token per call."""
        x = self.text.embed_tokens(tokens)
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        for i, layer in enumerate(self.text.layers):
            x, _ = layer(x, self.cos_sin, positions, cache=None if cache is None else cache[i])
        return self.text.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def mtp_chain(
        self, tokens: torch.Tensor, hidden: torch.Tensor, depth: int, drafts: bool = False,
        bases: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Chain the MTP ``depth`` times over bases ``t < n = L - depth``.

        Step ``j`` reads token ``t + j`` of ``tokens`` [B, L] (teacher forcing), or with
        ``drafts`` the previous step's greedy draft from step 2 on, as the engine would.
        Step 1 runs at every base (later steps attend to all its keys); steps from 2 on run
        only at ``bases`` (sorted indices, default all), which is where training saves most.
        Returns one [B, n, H] (step 1) then one [B, len(bases), H] per later step.
        """
        n = tokens.shape[1] - depth
        if n < 1:
            raise ValueError(f"need more than {depth} tokens to chain the MTP {depth} times")
        every = torch.arange(n, device=tokens.device)
        bases = every if bases is None else bases
        pasts: list[list[KV]] = [[] for _ in self.mtp.layers]
        prev, ids, at, mask, outs = hidden[:, :n], tokens[:, 1 : 1 + n], every, None, []
        for step in range(1, depth + 1):
            if step == 2:
                prev, at = prev[:, bases], bases
            if step > 1:
                ids = self.logits(prev).argmax(-1) if drafts else tokens[:, bases + step]
                mask = chain_mask(n, bases, step)
            table = self.text.embed_tokens.weight
            emb = self.mtp.pre_fc_norm_embedding(F.embedding(ids, table))
            x = self.mtp.fc(torch.cat([emb, self.mtp.pre_fc_norm_hidden(prev)], dim=-1))
            for layer, past in zip(self.mtp.layers, pasts):
                x, kv = layer(x, self.cos_sin, at + step - 1, past, mask)
                past.append(kv)
            prev = self.mtp.norm(x)
            outs.append(prev)
        return outs
