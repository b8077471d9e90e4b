"""A trained MTP module's depths run by plain tensor operations, for drafting (engine/mtp/native.py).

transformers' MtpModel.forward_layer runs a depth through its modules, its cache classes and the
target's attention interface: on a 2-core CPU that machinery costs more than the depth's
arithmetic (measured on the embedded model in bfloat16: 1.7 ms a depth, of which the attention
0.74 ms and the MLP 0.35 ms, for about 8 MB of weights). For a module whose block is a Llama
decoder layer (RMSNorm, rotary attention with grouped key/value heads and no biases, a SiLU-gated
MLP), `FastModule` computes the same depth directly: the q/k/v and gate/up projections as one
product each, 16-bit weights kept in oneDNN's packed layout on a CPU, rotary tables made once,
each depth's keys and values in buffers that grow in place (`Entries`), and tree branches
attending to the depth's settled entries where they lie instead of copying them per branch.

Drafting need not be bitwise what forward_layer computes (the target's verification decides every
token): the products run in another order, so 16-bit hidden states differ in their last bits and
a draft can differ where two tokens are nearly tied. tests/test_mtp_fast.py checks float32 drafts
against forward_layer recomputed from scratch, and the embedded model's drafts against the
transformers path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.drafters.int8 import int8_weight

MIN_ROOM = 256  # positions an Entries buffer has at least (it doubles when full)
BLOCK_ROWS = 64  # a 16-bit product of more rows runs in blocks of this many (a oneDNN kernel is made per shape)
LONG_ROWS = 16  # rows from which one request's attention runs through SDPA (_attend_long)


def supported(module: torch.nn.Module) -> bool:
    """Is every layer of this MtpModel one that FastModule computes exactly as forward_layer does?"""
    config = module.config
    if (getattr(config, "mtp_hidden_states_first", False) or getattr(module, "use_shared_post_norm", False)
            or not getattr(module, "use_post_norm", False) or getattr(config, "logits_mup_width_multiplier", None)
            or getattr(config, "pretraining_tp", 1) != 1 or getattr(config, "hidden_act", None) != "silu"
            or getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)
            or getattr(config, "sliding_window", None) is not None or module.rotary_emb is None):
        return False
    if any(kind != "full_attention" for kind in (getattr(config, "layer_types", None) or ())):
        return False
    return all(type(layer.mtp_block).__name__ == "LlamaDecoderLayer" for layer in module.layers)


class _Linear:
    """x @ weight.T; a 16-bit CPU weight prepacked for oneDNN once (F.linear reorders it at every
    call), where the kernel takes it; with int8, calls of few rows (drafting steps) multiply by an
    int8 copy instead (engine/drafters/int8.py)."""

    def __init__(self, weight: torch.Tensor, int8: bool = False):
        self.weight = weight.detach().contiguous()
        self.int8 = int8_weight(self.weight) if int8 else None
        self.packed = None
        if self.weight.device.type == "cpu" and self.weight.dtype in (torch.bfloat16, torch.float16):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)
                probe = torch.ones(1, self.weight.shape[1], dtype=self.weight.dtype)
                torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
                self.packed = packed
            except (RuntimeError, AttributeError):  # no oneDNN 16-bit kernel on this build or CPU
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None and self.int8.takes(x):
            return self.int8(x)
        if self.packed is None:
            return F.linear(x, self.weight)
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= BLOCK_ROWS:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, None, "none", [], "")
        else:  # many rows (a prompt): in blocks, so a new prompt length makes no new kernels but the last block's
            out = torch.cat([torch.ops.mkldnn._linear_pointwise(rows[i:i + BLOCK_ROWS], self.packed, None, "none", [], "")
                             for i in range(0, rows.shape[0], BLOCK_ROWS)])
        return out.view(*x.shape[:-1], out.shape[-1])


class _Layer:
    """One MTP layer's weights, fused and packed (and with int8 copies, FastModule's int8)."""

    def __init__(self, layer: torch.nn.Module, int8: bool = False):
        block = layer.mtp_block
        attn, mlp = block.self_attn, block.mlp
        self.norms = {name: (norm.weight.detach(), norm.variance_epsilon) for name, norm in (
            ("enorm", layer.enorm), ("hnorm", layer.hnorm), ("input", block.input_layernorm),
            ("post_attention", block.post_attention_layernorm), ("post", layer.post_norm))}
        self.eh = _Linear(layer.eh_proj.weight, int8)
        self.qkv = _Linear(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), int8)
        self.o = _Linear(attn.o_proj.weight, int8)
        self.gate_up = _Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), int8)
        self.down = _Linear(mlp.down_proj.weight, int8)
        self.scaling = float(attn.scaling)
        self.intermediate = mlp.gate_proj.weight.shape[0]

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, *self.norms[name])


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm over the last dimension: normalised in float32, cast back, then scaled."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class FastFusion:
    """engine.mtp.module.Fusion's forward for drafting (NativeMTP.observe, after every step): the
    feature norms as one RMSNorm over (rows, F, H), the F*H -> H projection packed once (F.linear
    reorders a 16-bit weight at every call) and, with int8, an int8 copy for calls of few rows."""

    def __init__(self, fusion: torch.nn.Module, int8: bool = False):
        self.weights = torch.stack([n.weight.detach() for n in fusion.norms])  # (F, H)
        self.eps = float(fusion.norms[0].variance_epsilon)
        self.proj = _Linear(fusion.proj.weight, int8)

    @staticmethod
    def takes(fusion: torch.nn.Module | None) -> bool:
        """Llama RMSNorms of one epsilon (what the one norm computes)."""
        norms = getattr(fusion, "norms", None)
        return bool(norms) and all(type(n).__name__ == "LlamaRMSNorm" for n in norms) and len(
            {float(n.variance_epsilon) for n in norms}) == 1

    def __call__(self, hidden: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """hidden (n, H), features (n, F * H) -> (n, H) in hidden's dtype."""
        dtype = self.proj.weight.dtype
        parts = features.to(dtype).view(features.shape[0], *self.weights.shape)  # (n, F, H)
        normed = _rms_norm(parts, self.weights, self.eps)
        fused = self.proj(normed.view(features.shape[0], -1))
        return (hidden.to(fused.dtype) + fused).to(hidden.dtype)


class Entries:
    """One depth's keys and values (kv_heads, n, head_dim), float32, in buffers with spare room
    that double when full; `crop` follows DynamicCache's (a negative count drops that many from
    the end). float32 because the attention runs in float32 (FastModule._attend)."""

    def __init__(self):
        self._keys = self._values = None
        self.n = 0

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[:, :self.n]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values[:, :self.n]

    def add(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values (kv_heads, t, head_dim) appended (as float32)."""
        t = keys.shape[1]
        if self._keys is None or self.n + t > self._keys.shape[1]:
            room = max(MIN_ROOM, 2 * (self.n + t))
            grown_k = keys.new_empty(keys.shape[0], room, keys.shape[2], dtype=torch.float32)
            grown_v = values.new_empty(values.shape[0], room, values.shape[2], dtype=torch.float32)
            if self.n:
                grown_k[:, :self.n] = self._keys[:, :self.n]
                grown_v[:, :self.n] = self._values[:, :self.n]
            self._keys, self._values = grown_k, grown_v
        self._keys[:, self.n:self.n + t] = keys
        self._values[:, self.n:self.n + t] = values
        self.n += t

    def crop(self, count: int) -> None:
        if count > 0:
            raise ValueError("crop takes the (negative) number of entries to drop")
        self.n = max(0, self.n + count)


class FastModule:
    """The depths of an MtpModel whose layers `supported` accepts, computed directly (see the
    module docstring). `forward_layer` mirrors MtpModel.forward_layer's arguments. int8: a 16-bit
    module's products of few rows multiply by int8 copies of its weights (engine/drafters/int8.py):
    faster drafting steps, hidden states off by the weights' rounding."""

    def __init__(self, module: torch.nn.Module, int8: bool = False):
        config = module.config
        self.layers = [_Layer(layer, int8) for layer in module.layers]
        self.embed = module.embed_tokens
        self.rotary = module.rotary_emb
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.dtype = self.layers[0].qkv.weight.dtype
        self._cos = self._sin = None  # rotary tables (positions, head_dim) in the layers' dtype

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1
        if self._cos is None or need > self._cos.shape[0]:
            size = max(MIN_ROOM, 2 * need)
            probe = torch.zeros(1, 1, self.head_dim, dtype=self.dtype, device=positions.device)
            cos, sin = self.rotary(probe, torch.arange(size, device=positions.device)[None])
            self._cos, self._sin = cos[0].to(self.dtype), sin[0].to(self.dtype)
        return self._cos[positions], self._sin[positions]  # (B, t, head_dim)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, t, heads, head_dim); cos, sin (B, t, head_dim)."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos[:, :, None] + rotated * sin[:, :, None]

    def forward_layer(self, layer_idx: int, hidden: torch.Tensor, positions: torch.Tensor, entries: Entries | None,
                      input_ids: torch.Tensor, keep: bool = True) -> torch.Tensor:
        """hidden (B, t, H) = h^{d-1} of t rows, input_ids (B, t) the tokens x_{i+d}, positions
        (B or 1, t): h^d (B, t, H). Each row attends to `entries` (the depth's cached rows, shared
        by every batch entry) and causally to its own batch entry's rows. keep: append the t rows'
        keys and values to `entries` (B = 1)."""
        layer = self.layers[layer_idx]
        batch, t, _ = hidden.shape
        x = torch.cat([layer.norm("enorm", self.embed(input_ids).to(hidden.dtype)), layer.norm("hnorm", hidden)], dim=-1)
        x = layer.eh(x)
        h, kvh, hd = self.heads, self.kv_heads, self.head_dim
        qkv = layer.qkv(layer.norm("input", x))
        q = qkv[..., :h * hd].view(batch, t, h, hd)
        k = qkv[..., h * hd:(h + kvh) * hd].view(batch, t, kvh, hd)
        v = qkv[..., (h + kvh) * hd:].view(batch, t, kvh, hd)
        cos, sin = self._rotary(positions.expand(batch, -1))
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        attended = self._attend(q * layer.scaling, k.transpose(1, 2), v.transpose(1, 2), entries)
        if keep and entries is not None:
            if batch != 1:
                raise ValueError("only a single batch entry's rows can be kept")
            entries.add(k[0].transpose(0, 1), v[0].transpose(0, 1))
        x = x + layer.o(attended)
        gate_up = layer.gate_up(layer.norm("post_attention", x))
        x = x + layer.down(F.silu(gate_up[..., :layer.intermediate]) * gate_up[..., layer.intermediate:])
        return layer.norm("post", x)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, entries: Entries | None) -> torch.Tensor:
        """q (B, t, heads, hd) already scaled; k, v (B, kv_heads, t, hd): (B, t, heads * hd) in
        q's dtype. The products run in float32: a 16-bit product on a CPU is a oneDNN kernel made
        for each new shape (about 1.6 ms on a 2-core CPU, and the key count grows every step),
        float32's are not, and these few rows are cheap either way."""
        dtype = q.dtype
        batch, t, h, hd = q.shape
        if t > LONG_ROWS and batch == 1:  # a depth catching up with a long context (the prompt): SDPA's kernel
            return self._attend_long(q, k, v, entries)
        q, k, v = q.float(), k.float(), v.float()
        kvh = self.kv_heads
        groups = h // kvh
        # rows of one key/value head: (group, row) of every query head that reads it
        q = q.view(batch, t, kvh, groups, hd).permute(0, 2, 3, 1, 4).reshape(batch, kvh, groups * t, hd)
        own = torch.matmul(q, k.transpose(-1, -2))  # (B, kvh, groups * t, t)
        if t > 1:
            later = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1).repeat(groups, 1)
            own = own.masked_fill(later, float("-inf"))
        n = 0 if entries is None else entries.n
        if n:
            keys, values = entries.keys, entries.values  # (kvh, n, hd)
            shared_q = q.transpose(0, 1).reshape(kvh, batch * groups * t, hd)
            shared = torch.matmul(shared_q, keys.transpose(-1, -2)).view(kvh, batch, groups * t, n).transpose(0, 1)
            scores = torch.cat([shared, own], dim=-1)
        else:
            scores = own
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs[..., n:], v)  # (B, kvh, groups * t, hd)
        if n:
            shared_p = probs[..., :n].transpose(0, 1).reshape(kvh, batch * groups * t, n)
            out = out + torch.matmul(shared_p, values).view(kvh, batch, groups * t, hd).transpose(0, 1)
        return out.view(batch, kvh, groups, t, hd).permute(0, 3, 1, 2, 4).reshape(batch, t, h * hd).to(dtype)

    def _attend_long(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, entries: Entries | None) -> torch.Tensor:
        """_attend for one request's many rows, in their dtype: PyTorch's fused attention over the
        cached entries and the rows' own, causal among the rows (a prompt's 800 rows: a 16-bit
        kernel's one-off making is nothing beside the product itself)."""
        _, t, h, hd = q.shape
        n = 0 if entries is None else entries.n
        keys, values = k[0], v[0]  # (kvh, t, hd)
        if n:
            keys = torch.cat([entries.keys.to(keys.dtype), keys], dim=1)
            values = torch.cat([entries.values.to(values.dtype), values], dim=1)
        groups = h // self.kv_heads
        keys, values = keys.repeat_interleave(groups, dim=0), values.repeat_interleave(groups, dim=0)  # (h, n + t, hd)
        query, keys, values = q.transpose(1, 2), keys[None], values[None]  # (1, heads, rows or keys, hd)
        if n:
            visible = torch.ones(t, n + t, dtype=torch.bool, device=q.device).tril(n)  # row i sees keys <= n + i
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=1.0)
        else:  # (is_causal takes the fused kernel; a mask, the slower math path)
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=1.0)
        return out.transpose(1, 2).reshape(1, t, h * hd)
