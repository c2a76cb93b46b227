"""The time model's communication: collectives priced with ring formulas over the link their group
lies on, and how much of each the step exposes.

Exposed communication, by kind, is priced with ring formulas (all-gather or reduce-scatter of S
bytes over n ranks: (n-1)/n S / bandwidth + (n-1) latency; all-reduce twice that; an all-to-all
sends (n-1)/n of a rank's S bytes away, as many hops) over the link the group lies on: inside a
node when its ranks fit in one (``link_of``), the network otherwise.

The overlap rules, all here and nowhere else (``overlap``):
1. FSDP2 / ZeRO-3 all-gathers (and backward reduce-scatters) are prefetched one block ahead: what
   exceeds the compute of the pass is exposed, plus the first block's gather, which nothing hides.
2. DDP's bucketed all-reduce, ZeRO-1/2's gradient reduce-scatter and HSDP's replica all-reduce run
   during the last micro-batch's backward: what exceeds it is exposed, plus the last bucket (25 MB).
3. Collectives inside a block sit right before (or after) the computation that needs their result:
   always exposed. Tensor parallelism's between dependent matmuls (async TP would hide them; it is
   not priced); context parallelism's K/V all-gathers right before the attention that reads them
   and the dK/dV reduce-scatters right after the backward that makes them; expert parallelism's
   all-to-alls between the router and the experts and between the experts and the combine. Any
   checkpointing policy runs the CP and EP collectives again in its recomputed forward (no policy
   saves an all-gather or an all-to-all). ZeRO-1/2's parameter all-gather after the optimizer
   step: exposed.
4. Pipeline sends overlap other micro-batches, except along the fill and drain: 2 (pp v - 1) sends.
5. On hardware without separate communication engines (``overlap=False``: the CPU, where gloo uses
   the cores that compute), nothing overlaps.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from .hardware import Hardware
from .layout import Layout, Stage


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket: the last one is never hidden


@dataclass(frozen=True)
class Link:
    bandwidth: float
    latency: float


def link_of(hw: Hardware, stride: int, size: int) -> Link:
    """A group of ``size`` ranks ``stride`` apart lies inside one node when it spans at most a node's
    GPUs (the mesh places ranks contiguously); otherwise its slowest hop is the network."""
    if stride * size <= hw.gpus_per_node:
        return Link(hw.intra_bandwidth, hw.intra_latency)
    return Link(hw.inter_bandwidth, hw.inter_latency)


def ring(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds of a collective over ``n`` ranks of a buffer of ``nbytes`` (the whole, unsharded size;
    an all-to-all's: what one rank holds before it): all_gather / reduce_scatter move (n-1)/n of it
    through each link in n - 1 ring steps, all_reduce twice that; an all_to_all sends (n-1)/n of a
    rank's buffer away, to the n - 1 others."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    hops = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return hops * link.latency + hops / n * nbytes / link.bandwidth


def overlap(rule: str, comm: float, window: float, first: float, hw: Hardware) -> float:
    """Exposed seconds of ``comm`` under overlap ``rule`` (module doc, rules 1-5)."""
    if not hw.overlap:
        return comm
    if rule in ("prefetch", "during_backward"):  # 1: the first block's gather waits; 2: the last bucket
        return first + max(0.0, comm - first - window)
    if rule in ("exposed", "tp", "cp", "ep"):  # 3
        return comm
    raise ValueError(rule)


def tp_comm(cfg: ModelConfig, layout: Layout, hw: Hardware, stage: Stage, seq: int, out_len: int) -> float:
    """One micro-batch's TP collectives (all exposed): per sub-layer, all-gather + reduce-scatter of
    the (tokens x d) activations with sequence parallelism, one all-reduce without, in forward, in
    backward and in the recomputed forward; the embedding's and the head's; with loss parallelism
    the loss's two (tokens)-sized all-reduces, without it the gathered logits. Under context
    parallelism the rank's tokens are 1/cp of the (padded) ``seq`` and ``out_len``."""
    tp = layout.tp
    if tp == 1:
        return 0.0
    link = link_of(hw, 1, tp)
    elt = 2 if layout.mixed else 4
    mb = layout.micro_batch
    passes = 3 if layout.ac == "full" else 2
    seq, out_len = seq // layout.cp, out_len // layout.cp

    def activation(tokens: int) -> float:
        nbytes = tokens * cfg.d_model * elt
        if layout.sp:
            return ring("all_gather", nbytes, tp, link) + ring("reduce_scatter", nbytes, tp, link)
        return ring("all_reduce", nbytes, tp, link)

    first, second = stage.blocks
    total = passes * (2 * first * activation(mb * seq) + 3 * second * activation(mb * out_len))
    if stage.embed:
        total += 2 * activation(mb * seq) / (2 if layout.sp else 1)
    if stage.head:
        total += 2 * activation(mb * out_len) / (2 if layout.sp else 1)
        if layout.loss_parallel:
            total += 2 * ring("all_reduce", mb * out_len * 4, tp, link)
        else:
            total += ring("all_gather", mb * out_len * cfg.padded_vocab_size * elt, tp, link)
    return total


def cp_comm(cfg: ModelConfig, layout: Layout, hw: Hardware, stage: Stage, seq: int, out_len: int) -> float:
    """One micro-batch's context-parallel collectives over the cp group (stride tp on the mesh),
    all exposed (rule 3): per attention layer, K and V of every key (``seq`` or, for a decoder's
    cross-attention, the encoder's) all-gathered in forward, again in backward and in a recomputed
    forward, in the activations' dtype; dK and dV reduce-scattered once, in fp32; and the
    micro-batch's labelled-token counts (one per sample) all-reduced (context.loss_tokens)."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    link = link_of(hw, layout.tp, cp)
    elt = 2 if layout.mixed else 4
    gathers = 2 + (layout.ac != "none")
    kv = cfg.kv_heads // layout.tp * cfg.head_dim

    def layer(keys: int) -> float:
        whole = 2 * layout.micro_batch * keys * kv  # K and V of every key, in elements
        return gathers * ring("all_gather", whole * elt, cp, link) + ring("reduce_scatter", whole * 4, cp, link)

    first, second = stage.blocks
    counts = ring("all_reduce", 8 * layout.micro_batch, cp, link)
    return first * layer(seq) + second * (layer(out_len) + layer(seq)) + counts


def ep_comm(cfg: ModelConfig, layout: Layout, hw: Hardware, stage: Stage, seq: int, out_len: int) -> float:
    """One micro-batch's expert-parallel all-to-alls over the ep group (ep neighbouring ranks of
    dp_shard x cp, stride tp), all exposed (rule 3): per MoE layer, the rank's routed rows (its
    tokens x top_k, d_model wide, the activations' dtype) dispatched and combined in forward, their
    gradients likewise in backward, once more in a recomputed forward; and before each forward
    dispatch the row counts (a few bytes: latency only)."""
    ep = layout.ep
    if ep == 1:
        return 0.0
    link = link_of(hw, layout.tp, ep)
    elt = 2 if layout.mixed else 4
    forwards = 1 + (layout.ac != "none")

    def layer(length: int) -> float:
        rows = layout.micro_batch * length // layout.cp * cfg.moe.top_k
        exchange = ring("all_to_all", rows * cfg.d_model * elt, ep, link)
        return (2 * forwards + 2) * exchange + forwards * (ep - 1) * link.latency

    return stage.moe[0] * layer(seq) + stage.moe[1] * layer(out_len)


def data_parallel(
    layout: Layout, hw: Hardware, stage: Stage, fwd: float, bwd: float, blocks: int, float8_weights: float = 0.0
) -> dict:
    """Exposed seconds of the data-parallel collectives of a step (rules 1-2 of ``overlap``), for
    one micro-batch of forward ``fwd`` and backward ``bwd`` compute seconds, by kind. The group is
    dp_shard x cp (the cp ranks hold the same parameters); under expert parallelism FSDP2 moves the
    routed experts' 1/ep over what EP leaves of it (ranks tp x ep apart), the rest over all of it.
    With float8's tensorwise recipe FSDP2 all-gathers the ``float8_weights`` converted block
    weights in float8 (1 byte each, parallel/float8.py)."""
    s, n, rep = layout.strategy, layout.dp_shard * layout.cp, layout.dp_replicate
    tp, ep = layout.tp, layout.ep
    pe = 2 if layout.mixed else 4
    params = stage.params
    shard_link, rep_link = link_of(hw, tp, n), link_of(hw, tp * n, rep)
    m = layout.micro_batches
    units = max(1, blocks)

    def sharded(kind: str, per_param: float, less: float = 0.0) -> float:
        """One pass of ``kind`` over every parameter of the stage, ``per_param`` bytes each, ``less``
        bytes fewer among the dense (not routed-expert) ones."""
        if ep == 1:
            return ring(kind, params * per_param - less, n, shard_link)
        dense, experts = params - stage.experts, stage.experts / ep
        return ring(kind, dense * per_param - less, n, shard_link) + ring(
            kind, experts * per_param, n // ep, link_of(hw, tp * ep, n // ep)
        )

    out: dict[str, float] = {}
    if s in ("fsdp", "fsdp-no-reshard", "zero3"):
        grad = 4 if s.startswith("fsdp") else pe  # FSDP2 reduces in fp32; DeepSpeed in the model's dtype
        float8 = float8_weights * (pe - 1) if layout.float8 == "tensorwise" and s.startswith("fsdp") else 0.0
        gather = sharded("all_gather", pe, float8)
        scatter = sharded("reduce_scatter", grad)
        again = 0.0 if s == "fsdp-no-reshard" else gather
        per_micro = overlap("prefetch", gather, fwd, gather / units, hw) + overlap(
            "prefetch", again + scatter, bwd, (again + scatter) / units, hw
        )
        out["fsdp"] = m * per_micro
        if rep > 1:
            reduce = ring("all_reduce", params * 4 / n, rep, rep_link)
            out["hsdp"] = overlap(
                "during_backward", reduce, bwd, min(reduce, ring("all_reduce", BUCKET_BYTES, rep, rep_link)), hw
            )
    elif s == "ddp":
        reduce = ring("all_reduce", params * 4, n, shard_link)  # fp32 gradients (autocast over fp32 weights)
        out["ddp"] = overlap(
            "during_backward", reduce, bwd, min(reduce, ring("all_reduce", BUCKET_BYTES, n, shard_link)), hw
        )
    else:  # zero1, zero2: gradients reduce-scattered during backward, parameters gathered after the step
        scatter = ring("reduce_scatter", params * pe, n, shard_link)
        bucket = min(scatter, ring("reduce_scatter", BUCKET_BYTES, n, shard_link))
        out[s] = overlap("during_backward", scatter, bwd, bucket, hw) + overlap(
            "exposed", ring("all_gather", params * pe, n, shard_link), 0.0, 0.0, hw
        )
    return out
