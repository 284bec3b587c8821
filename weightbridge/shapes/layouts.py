"""Shape-only source maps of Megatron-style trainers and SGLang-style rollout engines.

The maps are what `extract_source_map` would report for these frameworks' loaders, built from
the layout description instead of probing: TP column/row shards, grouped fused QKV (Megatron),
fused qkv / gate_up / w13 (SGLang), padded vocab shards, PP stages, EP expert blocks, and
CP/DP replicas (which share one map object, as replicas share regions).

Typical usage::

    trainers = megatron_maps(QWEN3_30B_A3B, num_gpus=16, tp=4, ep=8)
    engine = sglang_maps(QWEN3_30B_A3B, tp=8, ep=8)       # one engine, rank order
"""

from __future__ import annotations

from weightbridge.shapes.models import ModelConfig
from weightbridge.types import ParamSpec, Piece, Region, SourceMap


class _Map:
    """Accumulates one worker's params and pieces."""

    def __init__(self, dtype: str):
        self.dtype = dtype
        self.params: list[ParamSpec] = []
        self.pieces: list[Piece] = []

    def param(self, name: str, shape: tuple[int, ...]) -> str:
        self.params.append(ParamSpec(name, shape, self.dtype))
        return name

    def rows(self, tensor: str, row0: int, num_rows: int, width: int, param: str,
             offset: int = 0, col0: int = 0, num_cols: int | None = None) -> None:
        """Rows [row0, row0 + num_rows), cols [col0, col0 + num_cols) of a 2-d tensor of
        ``width`` columns, into ``param`` at ``offset`` with rows of ``num_cols`` elements."""
        n = width if num_cols is None else num_cols
        self.pieces.append(Piece(Region(tensor, (row0, col0), (num_rows, n), (1, 1)), param,
                                 offset, (n, 1)))

    def vector(self, tensor: str, size: int, param: str) -> None:
        self.pieces.append(Piece(Region(tensor, (0,), (size,), (1,)), param, 0, (1,)))

    def build(self) -> SourceMap:
        return SourceMap(tuple(self.params),
                         tuple(sorted(self.pieces, key=lambda p: (p.param, p.offset))))


def _split(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what}: {n} does not divide by {parts}; pick a degree that divides it")
    return n // parts


def _stage_layers(num_layers: int, pp: int, stage: int) -> range:
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


# --------------------------------------------------------------------------------------------
# Megatron-style trainer
# --------------------------------------------------------------------------------------------


def megatron_maps(cfg: ModelConfig, *, num_gpus: int, tp: int = 1, pp: int = 1, cp: int = 1,
                  ep: int = 1, etp: int = 1, dtype: str = "bfloat16") -> list[SourceMap]:
    """One map per trainer rank, rank = tp + TP * (cp + CP * (dp + DP * pp)).

    Experts use the expert mesh of each stage (etp fastest, then ep, then expert-dp).
    """
    dp = _split(num_gpus, tp * pp * cp, f"{num_gpus} GPUs over TP{tp} PP{pp} CP{cp}")
    per_stage = tp * cp * dp
    _split(per_stage, etp * ep, f"TP*CP*DP = {per_stage} ranks per stage over ETP{etp} EP{ep}")
    cache: dict[tuple[int, int, int, int], SourceMap] = {}
    maps = []
    for rank in range(num_gpus):
        tp_r, in_stage, pp_r = rank % tp, rank % per_stage, rank // per_stage
        key = (tp_r, pp_r, (in_stage // etp) % ep, in_stage % etp)
        if key not in cache:
            cache[key] = _megatron_rank(cfg, tp, pp, ep, etp, *key, dtype)
        maps.append(cache[key])
    return maps


def _megatron_rank(cfg, tp, pp, ep, etp, tp_r, pp_r, ep_r, etp_r, dtype) -> SourceMap:
    m = _Map(dtype)
    H = cfg.hidden
    vocab = _split(cfg.vocab, tp, f"vocab over TP{tp}")
    if pp_r == 0:
        m.rows("model.embed_tokens.weight", tp_r * vocab, vocab, H,
               m.param("embedding.word_embeddings.weight", (vocab, H)))
    for j, i in enumerate(_stage_layers(cfg.num_layers, pp, pp_r)):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{j}."
        m.vector(src + "input_layernorm.weight", H,
                 m.param(dst + "self_attention.linear_qkv.layer_norm_weight", (H,)))
        _megatron_attention(m, cfg, tp, tp_r, src + "self_attn.", dst + "self_attention.")
        m.vector(src + "post_attention_layernorm.weight", H,
                 m.param(dst + "pre_mlp_layernorm.weight", (H,)))
        if i < cfg.num_dense_layers:
            _column_row_mlp(m, src + "mlp.", dst + "mlp.", H, cfg.dense_intermediate, tp, tp_r,
                            ("linear_fc1.weight", "linear_fc2.weight"))
            continue
        E = cfg.num_experts
        m.rows(src + "mlp.gate.weight", 0, E, H, m.param(dst + "mlp.router.weight", (E, H)))
        local = _split(E, ep, f"experts over EP{ep}")
        for k in range(local):
            _column_row_mlp(m, f"{src}mlp.experts.{ep_r * local + k}.", dst + "mlp.experts.",
                            H, cfg.moe_intermediate, etp, etp_r,
                            (f"linear_fc1.weight{k}", f"linear_fc2.weight{k}"))
        if cfg.num_shared_experts:
            _column_row_mlp(m, src + "mlp.shared_experts.", dst + "mlp.shared_experts.", H,
                            cfg.num_shared_experts * cfg.moe_intermediate, tp, tp_r,
                            ("linear_fc1.weight", "linear_fc2.weight"))
    if pp_r == pp - 1:
        m.vector("model.norm.weight", H, m.param("decoder.final_layernorm.weight", (H,)))
        m.rows("lm_head.weight", tp_r * vocab, vocab, H,
               m.param("output_layer.weight", (vocab, H)))
    return m.build()


def _column_row_mlp(m: _Map, src: str, dst: str, H: int, inter: int, tp: int, tp_r: int,
                    names: tuple[str, str]) -> None:
    """fc1 = [gate shard; up shard] (column parallel), fc2 = down shard (row parallel)."""
    n = _split(inter, tp, f"{src} intermediate over TP{tp}")
    fc1 = m.param(dst + names[0], (2 * n, H))
    m.rows(src + "gate_proj.weight", tp_r * n, n, H, fc1)
    m.rows(src + "up_proj.weight", tp_r * n, n, H, fc1, offset=n * H)
    m.rows(src + "down_proj.weight", 0, H, inter, m.param(dst + names[1], (H, n)),
           col0=tp_r * n, num_cols=n)


def _megatron_attention(m: _Map, cfg: ModelConfig, tp: int, tp_r: int, src: str, dst: str):
    H, nh = cfg.hidden, cfg.num_heads
    heads = _split(nh, tp, f"heads over TP{tp}")
    if not cfg.mla:
        hd = cfg.head_dim
        groups = _split(cfg.num_kv_heads, tp, f"Megatron query groups over TP{tp}")
        per_group = nh // cfg.num_kv_heads
        qkv = m.param(dst + "linear_qkv.weight", (groups * (per_group + 2) * hd, H))
        for k in range(groups):  # per query group: its q heads, then k, then v
            g = tp_r * groups + k
            base = k * (per_group + 2) * hd * H
            m.rows(src + "q_proj.weight", g * per_group * hd, per_group * hd, H, qkv, base)
            m.rows(src + "k_proj.weight", g * hd, hd, H, qkv, base + per_group * hd * H)
            m.rows(src + "v_proj.weight", g * hd, hd, H, qkv, base + (per_group + 1) * hd * H)
        m.vector(src + "q_norm.weight", hd, m.param(dst + "q_layernorm.weight", (hd,)))
        m.vector(src + "k_norm.weight", hd, m.param(dst + "k_layernorm.weight", (hd,)))
        m.rows(src + "o_proj.weight", 0, H, nh * hd,
               m.param(dst + "linear_proj.weight", (H, heads * hd)),
               col0=tp_r * heads * hd, num_cols=heads * hd)
        return
    qk = cfg.qk_nope_dim + cfg.qk_rope_dim
    if cfg.q_lora_rank:
        r = cfg.q_lora_rank
        m.rows(src + "q_a_proj.weight", 0, r, H, m.param(dst + "linear_q_down_proj.weight", (r, H)))
        m.vector(src + "q_a_layernorm.weight", r,
                 m.param(dst + "linear_q_up_proj.layer_norm_weight", (r,)))
        m.rows(src + "q_b_proj.weight", tp_r * heads * qk, heads * qk, r,
               m.param(dst + "linear_q_up_proj.weight", (heads * qk, r)))
    else:
        m.rows(src + "q_proj.weight", tp_r * heads * qk, heads * qk, H,
               m.param(dst + "linear_q_proj.weight", (heads * qk, H)))
    kv_a = cfg.kv_lora_rank + cfg.qk_rope_dim
    m.rows(src + "kv_a_proj_with_mqa.weight", 0, kv_a, H,
           m.param(dst + "linear_kv_down_proj.weight", (kv_a, H)))
    m.vector(src + "kv_a_layernorm.weight", cfg.kv_lora_rank,
             m.param(dst + "linear_kv_up_proj.layer_norm_weight", (cfg.kv_lora_rank,)))
    kv_b = cfg.qk_nope_dim + cfg.v_head_dim
    m.rows(src + "kv_b_proj.weight", tp_r * heads * kv_b, heads * kv_b, cfg.kv_lora_rank,
           m.param(dst + "linear_kv_up_proj.weight", (heads * kv_b, cfg.kv_lora_rank)))
    v = cfg.v_head_dim
    m.rows(src + "o_proj.weight", 0, H, nh * v, m.param(dst + "linear_proj.weight", (H, heads * v)),
           col0=tp_r * heads * v, num_cols=heads * v)


# --------------------------------------------------------------------------------------------
# SGLang-style rollout engine
# --------------------------------------------------------------------------------------------


def sglang_maps(cfg: ModelConfig, *, tp: int, ep: int = 1, dtype: str = "bfloat16"
                ) -> list[SourceMap]:
    """One map per rank of one engine (TP = engine size; MoE TP = TP / EP)."""
    moe_tp = _split(tp, ep, f"TP{tp} over EP{ep}")
    return [_sglang_rank(cfg, tp, ep, moe_tp, r, dtype) for r in range(tp)]


def _sglang_rank(cfg, tp, ep, moe_tp, tp_r, dtype) -> SourceMap:
    m = _Map(dtype)
    H = cfg.hidden
    padded = -(-cfg.vocab // 64) * 64  # vocab padded to 64, zero rows on the last shards
    per = -(-padded // tp)
    real = max(0, min(cfg.vocab - tp_r * per, per))
    for tensor, param in (("model.embed_tokens.weight", "model.embed_tokens.weight"),
                          ("lm_head.weight", "lm_head.weight")):
        name = m.param(param, (per, H))
        if real:
            m.rows(tensor, tp_r * per, real, H, name)
    m.vector("model.norm.weight", H, m.param("model.norm.weight", (H,)))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            m.vector(p + norm, H, m.param(p + norm, (H,)))
        _sglang_attention(m, cfg, tp, tp_r, p + "self_attn.")
        if i < cfg.num_dense_layers:
            _gate_up_down(m, p + "mlp.", H, cfg.dense_intermediate, tp, tp_r)
            continue
        E = cfg.num_experts
        m.rows(p + "mlp.gate.weight", 0, E, H, m.param(p + "mlp.gate.weight", (E, H)))
        local = _split(E, ep, f"experts over EP{ep}")
        inter = _split(cfg.moe_intermediate, moe_tp, f"expert intermediate over MoE TP{moe_tp}")
        ep_r, mtp_r = tp_r // moe_tp, tp_r % moe_tp
        w13 = m.param(p + "mlp.experts.w13_weight", (local, 2 * inter, H))
        w2 = m.param(p + "mlp.experts.w2_weight", (local, H, inter))
        for k in range(local):
            e = f"{p}mlp.experts.{ep_r * local + k}."
            m.rows(e + "gate_proj.weight", mtp_r * inter, inter, H, w13, k * 2 * inter * H)
            m.rows(e + "up_proj.weight", mtp_r * inter, inter, H, w13, (k * 2 + 1) * inter * H)
            m.rows(e + "down_proj.weight", 0, H, cfg.moe_intermediate, w2, k * H * inter,
                   col0=mtp_r * inter, num_cols=inter)
        if cfg.num_shared_experts:
            _gate_up_down(m, p + "mlp.shared_experts.", H,
                          cfg.num_shared_experts * cfg.moe_intermediate, tp, tp_r)
    return m.build()


def _gate_up_down(m: _Map, p: str, H: int, inter: int, tp: int, tp_r: int) -> None:
    n = _split(inter, tp, f"{p} intermediate over TP{tp}")
    gate_up = m.param(p + "gate_up_proj.weight", (2 * n, H))
    m.rows(p + "gate_proj.weight", tp_r * n, n, H, gate_up)
    m.rows(p + "up_proj.weight", tp_r * n, n, H, gate_up, n * H)
    m.rows(p + "down_proj.weight", 0, H, inter, m.param(p + "down_proj.weight", (H, n)),
           col0=tp_r * n, num_cols=n)


def _sglang_attention(m: _Map, cfg: ModelConfig, tp: int, tp_r: int, p: str) -> None:
    H, nh = cfg.hidden, cfg.num_heads
    heads = _split(nh, tp, f"heads over TP{tp}")
    if not cfg.mla:
        hd, kv = cfg.head_dim, cfg.num_kv_heads
        # Fewer kv heads than ranks: each kv head is replicated on tp / kv ranks.
        kv_local = max(1, kv // tp)
        kv0 = tp_r * kv // tp if tp >= kv else tp_r * kv_local
        qkv = m.param(p + "qkv_proj.weight", ((heads + 2 * kv_local) * hd, H))
        m.rows(p + "q_proj.weight", tp_r * heads * hd, heads * hd, H, qkv)
        m.rows(p + "k_proj.weight", kv0 * hd, kv_local * hd, H, qkv, heads * hd * H)
        m.rows(p + "v_proj.weight", kv0 * hd, kv_local * hd, H, qkv, (heads + kv_local) * hd * H)
        for norm in ("q_norm.weight", "k_norm.weight"):
            m.vector(p + norm, hd, m.param(p + norm, (hd,)))
        m.rows(p + "o_proj.weight", 0, H, nh * hd, m.param(p + "o_proj.weight", (H, heads * hd)),
               col0=tp_r * heads * hd, num_cols=heads * hd)
        return
    qk = cfg.qk_nope_dim + cfg.qk_rope_dim
    kv_a = cfg.kv_lora_rank + cfg.qk_rope_dim
    if cfg.q_lora_rank:
        r = cfg.q_lora_rank
        fused = m.param(p + "fused_qkv_a_proj_with_mqa.weight", (r + kv_a, H))
        m.rows(p + "q_a_proj.weight", 0, r, H, fused)
        m.rows(p + "kv_a_proj_with_mqa.weight", 0, kv_a, H, fused, r * H)
        m.vector(p + "q_a_layernorm.weight", r, m.param(p + "q_a_layernorm.weight", (r,)))
        m.rows(p + "q_b_proj.weight", tp_r * heads * qk, heads * qk, r,
               m.param(p + "q_b_proj.weight", (heads * qk, r)))
    else:
        m.rows(p + "q_proj.weight", tp_r * heads * qk, heads * qk, H,
               m.param(p + "q_proj.weight", (heads * qk, H)))
        m.rows(p + "kv_a_proj_with_mqa.weight", 0, kv_a, H,
               m.param(p + "kv_a_proj_with_mqa.weight", (kv_a, H)))
    m.vector(p + "kv_a_layernorm.weight", cfg.kv_lora_rank,
             m.param(p + "kv_a_layernorm.weight", (cfg.kv_lora_rank,)))
    kv_b = cfg.qk_nope_dim + cfg.v_head_dim
    m.rows(p + "kv_b_proj.weight", tp_r * heads * kv_b, heads * kv_b, cfg.kv_lora_rank,
           m.param(p + "kv_b_proj.weight", (heads * kv_b, cfg.kv_lora_rank)))
    v = cfg.v_head_dim
    m.rows(p + "o_proj.weight", 0, H, nh * v, m.param(p + "o_proj.weight", (H, heads * v)),
           col0=tp_r * heads * v, num_cols=heads * v)


