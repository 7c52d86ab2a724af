"""Named training recipes: model shape, corpus size and optimisation, all fixed up front.

A run is a fixed number of steps (never "until the time is up"), so that the same seed
gives the same weights. ``default`` is sized for a 2-core CPU in under three minutes,
``test`` for the test suite (seconds), ``gpu`` (about 113M parameters) for benchmarks on
one large GPU, ``gpu-deep`` (as many in 32 narrower layers) for speculative decoding's
cost of a round at a realistic depth.
"""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class Preset:
    name: str
    # -- model (a qwen3_5 text decoder; layer types repeat linear x3, full x1) ----------
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    # -- corpus and tokenizer ------------------------------------------------------------
    vocab_size: int  # BPE size before the control tokens and the padding to 64
    train_bytes: int
    heldout_bytes: int
    include_tests: bool = False  # the stdlib's test suites too (the gpu preset needs the bytes)
    # -- optimisation ----------------------------------------------------------------------
    seq_len: int
    batch_size: int
    micro_batch: int | None = None  # rows per forward/backward (gradients summed over a batch); None: all
    steps: int
    lr: float
    warmup: int = 20
    weight_decay: float = 0.1
    mtp_depth: int = 3  # chained MTP steps trained (and drafted at evaluation)
    mtp_weight: float = 1.0  # weight of each chained step's loss beside the LM loss
    mtp_stride: int = 4  # chained steps from 2 on train at every stride-th position
    # -- evaluation ------------------------------------------------------------------------
    eval_prompts: int = 16
    eval_prompt_len: int = 48
    eval_new_tokens: int = 48
    eval_batch: int = 16


#: ~113M parameters on ~29M tokens (~5 passes over the stdlib with its tests): about 6 * 120M
#: (matmul parameters per token, MTP and heads included) * 29.5M = 2.1e16 FLOPs, ~2.5 minutes
#: at 150 TFLOP/s in bf16, so training and report fit in ~4 minutes on an H200
GPU = Preset(
    name="gpu", hidden_size=768, intermediate_size=2304, num_layers=12, num_heads=6, num_kv_heads=2,
    head_dim=128, linear_key_heads=6, linear_value_heads=12, linear_key_dim=64, linear_value_dim=64,
    vocab_size=8192, train_bytes=40_000_000, heldout_bytes=400_000, include_tests=True,
    seq_len=512, batch_size=64, steps=900, lr=1e-3, warmup=100,
    eval_prompts=64, eval_prompt_len=128, eval_new_tokens=128, eval_batch=64,
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="test", hidden_size=32, intermediate_size=64, num_layers=4, num_heads=2, num_kv_heads=1,
            head_dim=16, linear_key_heads=1, linear_value_heads=2, linear_key_dim=16, linear_value_dim=16,
            vocab_size=384, train_bytes=120_000, heldout_bytes=12_000,
            seq_len=64, batch_size=8, steps=30, lr=3e-3, warmup=5,
            eval_prompts=4, eval_prompt_len=16, eval_new_tokens=12, eval_batch=4,
        ),
        Preset(
            name="default", hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2,
            head_dim=32, linear_key_heads=2, linear_value_heads=4, linear_key_dim=32, linear_value_dim=32,
            vocab_size=512, train_bytes=3_000_000, heldout_bytes=100_000,
            seq_len=128, batch_size=16, steps=600, lr=3e-3,
            eval_prompts=64, eval_batch=32,
        ),
        GPU,
        # as many parameters as ``gpu`` in 32 narrower layers: speculative decoding pays one
        # MTP layer a draft against the target's every layer a verify, so the share a draft
        # costs is the spec's models' only when the target is deep (the 27B has 64 layers;
        # ``gpu``'s 12 made a draft cost about a quarter of a step at c=1, session 21)
        attrs.evolve(GPU, name="gpu-deep", hidden_size=512, intermediate_size=1536, num_layers=32, num_heads=4,
                     linear_key_heads=4, linear_value_heads=8, steps=800,
                     # 32 layers' saved activations for 64 x 512 tokens outgrow an 80 GB card
                     micro_batch=16),
    )
}
